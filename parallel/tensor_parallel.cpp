#include "parallel/tensor_parallel.h"

#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "parallel/scatter.h"

namespace tandem::parallel {

namespace {

void check_per_device(const char* who, const Communicator& comm, const std::vector<Tensor>& xs) {
  TANDEM_CHECK(xs.size() == comm.size(), Value, who, ": ", xs.size(), " tensors for ", comm.size(),
               " devices");
  for (size_t i = 0; i < xs.size(); ++i) {
    TANDEM_CHECK(xs[i].defined(), Value, who, ": tensor ", i, " is undefined");
    TANDEM_CHECK(xs[i].device() == comm.devices()[i], Device, who, ": tensor ", i, " is on ",
                 xs[i].device().str(), ", not on ", comm.devices()[i].str());
  }
}

bool recording(const std::vector<Tensor>& xs) {
  if (!grad_enabled()) return false;
  for (const Tensor& x : xs) {
    if (x.requires_grad()) return true;
  }
  return false;
}

// A Linear of in x out on `device` holding full's weight[rows, cols] (and bias[rows] when
// with_bias), copied without autograd.
std::shared_ptr<nn::Linear> make_shard(const nn::Linear& full, int64_t r0, int64_t r1, int64_t c0,
                                       int64_t c1, bool with_bias, Device device) {
  Generator unused(0);  // the values are overwritten below
  auto shard = std::make_shared<nn::Linear>(c1 - c0, r1 - r0, with_bias, unused);
  shard->to(device);
  NoGradGuard no_grad;
  shard->weight().copy_(full.weight().slice(0, r0, r1).slice(1, c0, c1));
  if (with_bias) shard->bias().copy_(full.bias().slice(0, r0, r1));
  return shard;
}

std::vector<Tensor> all_parameters(const std::vector<std::shared_ptr<nn::Linear>>& shards) {
  std::vector<Tensor> out;
  for (const auto& s : shards) {
    for (const Tensor& p : s->parameters()) out.push_back(p);
  }
  return out;
}

}  // namespace

std::vector<Tensor> copy_to_tensor_parallel_region(Communicator& comm,
                                                   const std::vector<Tensor>& xs) {
  check_per_device("copy_to_tensor_parallel_region", comm, xs);
  std::vector<Tensor> ys;
  for (const Tensor& x : xs) ys.push_back(x.detach());  // identity: the same storage
  if (recording(xs)) {
    std::vector<Shape> shapes;
    for (const Tensor& x : xs) shapes.push_back(x.shape());
    const DType dtype = xs[0].dtype();
    autograd::record(
        "CopyToTensorParallelRegion", xs, ys, [&comm, shapes, dtype](autograd::TensorList&& g) {
          for (size_t i = 0; i < g.size(); ++i) {
            // Our own buffers to sum into: the engine's may alias a gradient still in use.
            g[i] = g[i].defined() ? g[i].clone() : zeros(shapes[i], dtype, comm.devices()[i]);
          }
          comm.allreduce_sum(g);
          return std::move(g);
        });
  }
  return ys;
}

std::vector<Tensor> reduce_from_tensor_parallel_region(Communicator& comm,
                                                       const std::vector<Tensor>& partials) {
  check_per_device("reduce_from_tensor_parallel_region", comm, partials);
  std::vector<Tensor> sums;
  for (const Tensor& p : partials) sums.push_back(p.detach().clone());
  comm.allreduce_sum(sums);
  if (recording(partials)) {
    autograd::record("ReduceFromTensorParallelRegion", partials, sums,
                     [](autograd::TensorList&& g) { return std::move(g); });
  }
  return sums;
}

ColumnParallelLinear::ColumnParallelLinear(const nn::Linear& full, Communicator& comm)
    : comm_(&comm) {
  TANDEM_CHECK(full.out_features() >= static_cast<int64_t>(comm.size()), Value,
               "ColumnParallelLinear: ", full.out_features(), " output features over ", comm.size(),
               " devices; every device needs one");
  const auto sizes = split_sizes(full.out_features(), comm.size());
  int64_t r0 = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    shards_.push_back(make_shard(full, r0, r0 + sizes[i], 0, full.in_features(),
                                 full.bias().defined(), comm.devices()[i]));
    r0 += sizes[i];
  }
}

std::vector<Tensor> ColumnParallelLinear::forward(const std::vector<Tensor>& xs) {
  const auto ins = copy_to_tensor_parallel_region(*comm_, xs);
  std::vector<Tensor> ys;
  for (size_t i = 0; i < shards_.size(); ++i) {
    DeviceGuard guard(comm_->devices()[i]);
    ys.push_back(shards_[i]->forward(ins[i]));
  }
  return ys;
}

std::vector<Tensor> ColumnParallelLinear::parameters() const {
  return all_parameters(shards_);
}

Tensor ColumnParallelLinear::full_weight() const {
  std::vector<Tensor> parts;
  for (const auto& s : shards_) parts.push_back(s->weight().detach().to(kCPU));
  return cat(parts, 0);
}

Tensor ColumnParallelLinear::full_bias() const {
  if (!shards_[0]->bias().defined()) return Tensor();
  std::vector<Tensor> parts;
  for (const auto& s : shards_) parts.push_back(s->bias().detach().to(kCPU));
  return cat(parts, 0);
}

RowParallelLinear::RowParallelLinear(const nn::Linear& full, Communicator& comm) : comm_(&comm) {
  TANDEM_CHECK(full.in_features() >= static_cast<int64_t>(comm.size()), Value,
               "RowParallelLinear: ", full.in_features(), " input features over ", comm.size(),
               " devices; every device needs one");
  const auto sizes = split_sizes(full.in_features(), comm.size());
  int64_t c0 = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const bool with_bias = i == 0 && full.bias().defined();
    shards_.push_back(
        make_shard(full, 0, full.out_features(), c0, c0 + sizes[i], with_bias, comm.devices()[i]));
    c0 += sizes[i];
  }
}

std::vector<Tensor> RowParallelLinear::forward(const std::vector<Tensor>& xs) {
  check_per_device("RowParallelLinear", *comm_, xs);
  std::vector<Tensor> partials;
  for (size_t i = 0; i < shards_.size(); ++i) {
    DeviceGuard guard(comm_->devices()[i]);
    partials.push_back(shards_[i]->forward(xs[i]));
  }
  return reduce_from_tensor_parallel_region(*comm_, partials);
}

std::vector<Tensor> RowParallelLinear::parameters() const {
  return all_parameters(shards_);
}

Tensor RowParallelLinear::full_weight() const {
  std::vector<Tensor> parts;
  for (const auto& s : shards_) parts.push_back(s->weight().detach().to(kCPU));
  return cat(parts, 1);
}

Tensor RowParallelLinear::full_bias() const {
  const Tensor b = shards_[0]->bias();
  return b.defined() ? b.detach().to(kCPU) : Tensor();
}

}  // namespace tandem::parallel
