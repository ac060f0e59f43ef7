#include "parallel/replicate.h"

#include <algorithm>
#include <cmath>

#include "autograd/grad_mode.h"
#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/device_api.h"
#include "parallel/flat_buffer.h"

namespace tandem::parallel {

namespace {

// Parameters then buffers, in the module's order: the tensors a replica must mirror.
std::vector<std::pair<std::string, Tensor>> state_of(const nn::Module& m, bool buffers = true) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, p] : m.named_parameters()) out.emplace_back(name, p);
  if (!buffers) return out;
  for (const auto& [name, b] : m.named_buffers()) out.emplace_back(name, b);
  return out;
}

// Makes `dst` a view of src's storage without touching dst's TensorImpl identity (its
// autograd state, requires_grad and hooks stay), the same trick as Module::to.
void share_storage(const Tensor& src, const Tensor& dst) {
  TensorImpl* impl = dst.impl();
  impl->storage = src.storage();
  impl->shape = src.shape();
  impl->strides = src.strides();
  impl->offset = src.offset();
}

}  // namespace

Tensor coalesce(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return Tensor();
  const int64_t total = checked_flat_numel(tensors, "coalesce", "tensor");
  for (size_t k = 0; k < tensors.size(); ++k) {
    for (size_t j = 0; j < k; ++j) {
      TANDEM_CHECK(!tensors[j].same(tensors[k]), Value, "coalesce: tensor ", k, " repeats tensor ", j);
    }
  }
  const Tensor& first = tensors[0];
  NoGradGuard no_grad;
  DeviceGuard device(first.device());
  Tensor flat = empty({total}, first.dtype(), first.device());
  const std::vector<Tensor> slices = split_views(flat, tensors);
  for (size_t k = 0; k < tensors.size(); ++k) {
    slices[k].copy_(tensors[k]);
    share_storage(slices[k], tensors[k]);
  }
  return flat;
}

Tensor try_coalesce(const std::vector<Tensor>& tensors) {
  for (const Tensor& t : tensors) {
    if (!t.defined() || t.dtype() != tensors[0].dtype() || t.device() != tensors[0].device()) return Tensor();
  }
  return coalesce(tensors);
}

CoalescedGroups coalesce_by_dtype(const std::vector<Tensor>& tensors) {
  CoalescedGroups out;
  std::vector<DType> dtypes;
  for (const Tensor& t : tensors) {
    TANDEM_CHECK(t.defined(), Value, "coalesce_by_dtype: undefined tensor");
    const auto it = std::find(dtypes.begin(), dtypes.end(), t.dtype());
    const size_t g = static_cast<size_t>(it - dtypes.begin());
    if (it == dtypes.end()) {
      dtypes.push_back(t.dtype());
      out.groups.emplace_back();
    }
    out.groups[g].push_back(t);
  }
  for (const auto& group : out.groups) out.flats.push_back(coalesce(group));
  return out;
}

bool is_coalesced(const std::vector<Tensor>& tensors, const Tensor& flat) {
  const Tensor span = contiguous_span(tensors);
  return span.defined() && flat.defined() && span.storage() == flat.storage() &&
         span.offset() == flat.offset() && span.numel() == flat.numel();
}

std::vector<Tensor> trainable_parameters(const nn::Module& module) {
  std::vector<Tensor> out;
  for (const Tensor& p : module.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

Replicas replicate(const std::shared_ptr<nn::Module>& module, const std::vector<Device>& devices) {
  TANDEM_CHECK(module != nullptr, Value, "replicate: null module");
  check_device_list(devices, "replicate");
  NoGradGuard no_grad;
  Replicas replicas;
  module->to(devices[0]);
  replicas.push_back(module);
  for (size_t i = 1; i < devices.size(); ++i) {
    std::shared_ptr<nn::Module> copy = module->clone();
    copy->to(devices[i]);
    replicas.push_back(std::move(copy));
  }
  return replicas;
}

void check_replicas(const Replicas& replicas) {
  TANDEM_CHECK(!replicas.empty(), Value, "check_replicas: no replicas");
  for (size_t i = 0; i < replicas.size(); ++i) {
    TANDEM_CHECK(replicas[i] != nullptr, Value, "check_replicas: replica ", i, " is null");
  }
  const auto ref = state_of(*replicas[0]);
  for (size_t i = 1; i < replicas.size(); ++i) {
    const auto st = state_of(*replicas[i]);
    TANDEM_CHECK(st.size() == ref.size(), Value, "replica ", i, " has ", st.size(),
                 " parameters and buffers but replica 0 has ", ref.size());
    for (size_t k = 0; k < ref.size(); ++k) {
      const auto& [name, t] = st[k];
      const auto& [ref_name, r] = ref[k];
      TANDEM_CHECK(name == ref_name, Value, "replica ", i, ": entry ", k, " is '", name,
                   "' but replica 0 has '", ref_name, "'");
      TANDEM_CHECK(t.shape() == r.shape(), Shape, "replica ", i, ": '", name, "' is ",
                   shape_str(t.shape()), " but replica 0 has ", shape_str(r.shape()));
      TANDEM_CHECK(t.dtype() == r.dtype(), DType, "replica ", i, ": '", name, "' is ",
                   dtype_name(t.dtype()), " but replica 0 has ", dtype_name(r.dtype()));
    }
  }
}

void broadcast_parameters(const Replicas& replicas, Communicator* comm) {
  check_replicas(replicas);
  NoGradGuard no_grad;
  std::vector<std::vector<std::pair<std::string, Tensor>>> states;
  for (const auto& r : replicas) states.push_back(state_of(*r));
  for (size_t k = 0; k < states[0].size(); ++k) {
    if (comm != nullptr) {
      std::vector<Tensor> ts;
      for (const auto& st : states) ts.push_back(st[k].second);
      comm->broadcast(ts, 0);
      continue;
    }
    for (size_t i = 1; i < states.size(); ++i) {
      DeviceGuard device(states[i][k].second.device());
      states[i][k].second.copy_(states[0][k].second);
    }
  }
}

double replicas_max_difference(const Replicas& replicas, bool buffers) {
  check_replicas(replicas);
  const auto ref = state_of(*replicas[0], buffers);
  std::vector<std::vector<double>> ref_values;
  for (const auto& [name, t] : ref) ref_values.push_back(t.to(kCPU, kFloat64).to_vector<double>());
  double worst = 0;
  for (size_t i = 1; i < replicas.size(); ++i) {
    const auto st = state_of(*replicas[i], buffers);
    for (size_t k = 0; k < st.size(); ++k) {
      const std::vector<double> v = st[k].second.to(kCPU, kFloat64).to_vector<double>();
      const std::vector<double>& r = ref_values[k];
      double scale = 1, diff = 0;
      for (size_t j = 0; j < v.size(); ++j) {
        scale = std::max(scale, std::abs(r[j]));
        diff = std::max(diff, std::abs(v[j] - r[j]));
        if (std::isnan(v[j]) != std::isnan(r[j])) diff = INFINITY;
      }
      worst = std::max(worst, diff / scale);
    }
  }
  return worst;
}

bool replicas_in_sync(const Replicas& replicas, double tol, bool buffers) {
  return replicas_max_difference(replicas, buffers) <= tol;
}

std::shared_ptr<nn::Module> shallow_replica(const nn::Module& module) {
  std::shared_ptr<nn::Module> copy;
  {
    NoGradGuard no_grad;
    copy = module.clone();
  }
  reshare_storage(module, *copy);
  return copy;
}

void reshare_storage(const nn::Module& module, nn::Module& shallow) {
  if (shallow.device() != module.device()) {
    NoGradGuard no_grad;
    shallow.to(module.device());  // pins the device; the storage is replaced just below
  }
  const auto src = state_of(module);
  const auto dst = state_of(shallow);
  TANDEM_CHECK(src.size() == dst.size(), Value, "reshare_storage: ", src.size(), " vs ",
               dst.size(), " parameters and buffers");
  for (size_t k = 0; k < src.size(); ++k) {
    TANDEM_CHECK(src[k].second.shape() == dst[k].second.shape(), Shape, "reshare_storage: '",
                 src[k].first, "' is ", shape_str(src[k].second.shape()), " vs ",
                 shape_str(dst[k].second.shape()));
    if (src[k].second.storage() != dst[k].second.storage() ||
        src[k].second.offset() != dst[k].second.offset()) {
      share_storage(src[k].second, dst[k].second);
    }
  }
}

}  // namespace tandem::parallel
