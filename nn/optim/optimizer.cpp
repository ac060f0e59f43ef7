#include "nn/optim/optimizer.h"

#include <cmath>
#include <map>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tandem::nn::optim {

Optimizer::Optimizer(std::vector<Tensor> params, double lr, bool capturable)
    : params_(std::move(params)), capturable_(capturable) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    TANDEM_CHECK(p.defined(), Value, "Optimizer: parameter ", i, " is undefined");
    TANDEM_CHECK(is_floating(p.dtype()), Value, "Optimizer: parameter ", i, " is ",
                 dtype_name(p.dtype()), ", parameters must be floating");
    TANDEM_CHECK(p.is_leaf(), Value, "Optimizer: parameter ", i, " ", p.str(),
                 " is not a leaf tensor");
    for (size_t j = 0; j < i; ++j) {
      TANDEM_CHECK(!params_[j].same(p), Value, "Optimizer: parameter ", i, " repeats parameter ",
                   j);
    }
  }
  set_lr(lr);
  // Made now rather than at the first step, so a step captured without warm-up finds them.
  if (capturable_)
    for (const Tensor& p : params_) lr_tensor(p.device());
}

void Optimizer::set_lr(double lr) {
  TANDEM_CHECK(lr >= 0, Value, "Optimizer: learning rate must be >= 0, got ", lr);
  lr_ = lr;
  // Note [capturable optimizer steps]: enqueued on each device's current stream, after the
  // steps already enqueued and before the next (a replay included) -- no host sync.
  for (const auto& [device, t] : lr_tensors_) t.fill_(lr);
}

Tensor Optimizer::lr_tensor(Device device) {
  for (const auto& [d, t] : lr_tensors_)
    if (d == device) return t;
  Tensor t = full({}, lr_, kFloat64, device);
  lr_tensors_.emplace_back(device, t);
  return t;
}

void Optimizer::set_weight_copy(const Tensor& copy) {
  if (copy.defined()) check_weight_copy(copy, contiguous_span(params_), "Optimizer::set_weight_copy");
  weight_copy_ = copy;
}

void Optimizer::check_weight_copy(const Tensor& copy, const Tensor& span, const char* op) const {
  TANDEM_CHECK(span.defined(), Value, op, ": the ", params_.size(),
               " parameters do not lie back to back in one buffer (coalesce them first: "
               "parallel::coalesce)");
  TANDEM_CHECK(copy.numel() == span.numel(), Value, op, ": the weight copy has ", copy.numel(),
               " elements, the parameters ", span.numel());
  TANDEM_CHECK(copy.is_contiguous(), Value, op, ": the weight copy ", shape_str(copy.shape()),
               " must be contiguous");
  TANDEM_CHECK(is_floating(copy.dtype()) && copy.dtype() != span.dtype(), DType, op,
               ": the weight copy must be of a floating dtype other than the parameters' ",
               dtype_name(span.dtype()), ", got ", dtype_name(copy.dtype()));
  TANDEM_CHECK(copy.device() == span.device(), Device, op, ": the weight copy is on ",
               copy.device().str(), ", the parameters on ", span.device().str());
}

void Optimizer::step() {
  NoGradGuard no_grad;
  // The parameters' span, once for both uses. The copy is checked against it before anything
  // changes: the parameters may have moved since set_weight_copy.
  const Tensor flat_params = contiguous_span(params_);
  const bool copy = weight_copy_.defined();
  if (copy) check_weight_copy(weight_copy_, flat_params, "Optimizer::step");
  if (flat_params.defined() && step_flat(flat_params)) {
    // Note [the weight copy written by the update]: the flat kernel wrote it, or a cast does.
    if (copy && !update_flat_writes_weight_copy()) refresh_weight_copy(flat_params);
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    Tensor g = p.grad();
    if (!g.defined()) continue;
    TANDEM_CHECK(g.shape() == p.shape(), Shape, "Optimizer: parameter ", i, " ",
                 shape_str(p.shape()), " has a gradient of shape ", shape_str(g.shape()));
    update(i, p, g);  // the kernels lay g out as p (kernels::sgd_step, adam_step)
  }
  if (copy) refresh_weight_copy(flat_params);
}

void Optimizer::refresh_weight_copy(const Tensor& span) const {
  // One cast kernel, the one AutocastWeights::refresh enqueues; a view of the copy, no memory.
  weight_copy_.reshape({span.numel()}).copy_(span);
}

bool Optimizer::step_flat(const Tensor& flat_params) {
  std::vector<Tensor> grads;
  grads.reserve(params_.size());
  for (const Tensor& p : params_) {
    Tensor g = p.grad();
    if (!g.defined() || !same_layout(g, p)) return false;  // spans pair elements by memory
    grads.push_back(std::move(g));
  }
  const Tensor flat_grads = contiguous_span(grads);
  if (!flat_grads.defined() || flat_grads.numel() != flat_params.numel() ||
      flat_grads.device() != flat_params.device() || flat_grads.dtype() != flat_params.dtype()) {
    return false;
  }
  return update_flat(flat_params, flat_grads);
}

Tensor Optimizer::flat_state(std::vector<Tensor>& slots, const Tensor& flat) const {
  bool none = true;
  for (const Tensor& s : slots) none = none && !s.defined();
  if (none) {
    Tensor state = zeros(flat.shape(), flat.dtype(), flat.device());
    slots = split_views(state, params_);
    return state;
  }
  Tensor span = contiguous_span(slots);
  if (!span.defined() || span.numel() != flat.numel() || span.device() != flat.device()) return Tensor();
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!same_layout(slots[i], params_[i])) return Tensor();
  }
  return span;
}

void Optimizer::zero_grad(bool set_to_none) {
  for (const auto& p : params_) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      g.zero_();
    }
  }
}

const Tensor& Optimizer::state_like(Tensor& slot, const Tensor& param) {
  if (!slot.defined()) {
    slot = zeros_like(param);  // in the parameter's memory format (the kernels run over raw memory)
  } else if (slot.device() != param.device()) {
    slot = slot.to(param.device());
  }
  return slot;
}

StateDict Optimizer::state_dict() const {
  auto* self = const_cast<Optimizer*>(this);  // state_slots is non-const only to allow loading
  const std::vector<StateKind> kinds = state_kinds();
  StateDict out;
  const StateKind* first_kind = nullptr;
  for (const StateKind& k : kinds)
    if (k.like_param && first_kind == nullptr) first_kind = &k;
  if (first_kind == nullptr) return out;
  const std::vector<Tensor>& first = *self->state_slots(first_kind->name);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!first[i].defined()) continue;
    const std::string prefix = "state." + std::to_string(i) + ".";
    for (const StateKind& k : kinds) {
      if (k.like_param) {
        out.insert(prefix + k.name, (*self->state_slots(k.name))[i]);
      } else if (Tensor live = scalar_state_tensor(i, k.name); live.defined()) {
        out.insert(prefix + k.name, live);
      } else {
        Tensor v = zeros({}, kFloat32);
        v.fill_(scalar_state(i, k.name));
        out.insert(prefix + k.name, v);
      }
    }
  }
  return out;
}

void Optimizer::load_state_dict(const StateDict& state) {
  const std::vector<StateKind> kinds = state_kinds();
  // entries[i][kind] -> the file's tensor, validated before anything changes.
  std::vector<std::map<std::string, Tensor>> entries(params_.size());
  for (const auto& [name, t] : state) {
    const std::string bad = "Optimizer::load_state_dict: '" + name + "'";
    size_t dot = std::string::npos;
    size_t index = 0;
    bool ok = name.rfind("state.", 0) == 0;
    if (ok) {
      dot = name.find('.', 6);
      const std::string digits = name.substr(6, dot == std::string::npos ? std::string::npos : dot - 6);
      ok = dot != std::string::npos && !digits.empty() && digits.size() < 10 &&
           digits.find_first_not_of("0123456789") == std::string::npos;
      if (ok) index = std::stoul(digits);
    }
    TANDEM_CHECK(ok, Value, bad, " is not a state name (expected state.<i>.<name>)");
    TANDEM_CHECK(index < params_.size(), Value, bad, ": parameter ", index,
                 " does not exist (the optimizer has ", params_.size(), ")");
    const std::string kind = name.substr(dot + 1);
    const StateKind* k = nullptr;
    for (const StateKind& c : kinds)
      if (c.name == kind) k = &c;
    std::string known;
    for (const StateKind& c : kinds) known += (known.empty() ? "" : ", ") + c.name;
    TANDEM_CHECK(k != nullptr, Value, bad, ": '", kind, "' is not a state of this optimizer (",
                 known.empty() ? std::string("it keeps none") : "it keeps " + known, ")");
    TANDEM_CHECK(t.defined(), Value, bad, " is undefined");
    const Tensor& p = params_[index];
    if (k->like_param) {
      TANDEM_CHECK(t.shape() == p.shape(), Shape, bad, " has shape ", shape_str(t.shape()),
                   " but parameter ", index, " is ", shape_str(p.shape()));
      TANDEM_CHECK(t.dtype() == p.dtype(), DType, bad, " is ", dtype_name(t.dtype()),
                   " but parameter ", index, " is ", dtype_name(p.dtype()));
    } else {
      TANDEM_CHECK(t.numel() == 1, Shape, bad, " has shape ", shape_str(t.shape()),
                   ", not one value");
      const double v = t.to(kCPU).to(kFloat64).item();
      TANDEM_CHECK(v >= 0 && std::floor(v) == v, Value, bad, " is ", v,
                   ", not a non-negative integer");
    }
    entries[index][kind] = t;
  }
  bool all = true;  // every parameter has state: the flat layout is possible
  for (size_t i = 0; i < params_.size(); ++i) {
    if (entries[i].empty()) {
      all = false;
      continue;
    }
    for (const StateKind& k : kinds)
      TANDEM_CHECK(entries[i].count(k.name), Value, "Optimizer::load_state_dict: parameter ", i,
                   " has state but no 'state.", i, ".", k.name, "'");
  }

  NoGradGuard no_grad;
  const Tensor flat_params = all ? contiguous_span(params_) : Tensor();
  for (const StateKind& k : kinds) {
    if (!k.like_param) {
      for (size_t i = 0; i < params_.size(); ++i)
        set_scalar_state(i, k.name, entries[i].empty() ? 0.0 : entries[i][k.name].to(kCPU).to(kFloat64).item());
      continue;
    }
    std::vector<Tensor>& slots = *state_slots(k.name);
    if (flat_params.defined()) {
      // Note [flat optimizer step]: views of one buffer, as a first flat step would make them.
      slots = split_views(zeros(flat_params.shape(), flat_params.dtype(), flat_params.device()), params_);
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (entries[i].empty()) {
        slots[i] = Tensor();
        continue;
      }
      if (!flat_params.defined()) slots[i] = zeros(params_[i].shape(), params_[i].dtype(), params_[i].device());
      slots[i].copy_(entries[i][k.name]);
    }
  }
  state_loaded();
}

}  // namespace tandem::nn::optim
