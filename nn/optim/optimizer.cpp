#include "nn/optim/optimizer.h"

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tandem::nn::optim {

Optimizer::Optimizer(std::vector<Tensor> params, double lr) : params_(std::move(params)) {
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
}

void Optimizer::set_lr(double lr) {
  TANDEM_CHECK(lr >= 0, Value, "Optimizer: learning rate must be >= 0, got ", lr);
  lr_ = lr;
}

void Optimizer::step() {
  NoGradGuard no_grad;
  if (step_flat()) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    Tensor g = p.grad();
    if (!g.defined()) continue;
    TANDEM_CHECK(g.shape() == p.shape(), Shape, "Optimizer: parameter ", i, " ",
                 shape_str(p.shape()), " has a gradient of shape ", shape_str(g.shape()));
    update(i, p, g.is_contiguous() ? g : g.contiguous());
  }
}

bool Optimizer::step_flat() {
  std::vector<Tensor> grads;
  grads.reserve(params_.size());
  for (const Tensor& p : params_) {
    Tensor g = p.grad();
    if (!g.defined() || g.shape() != p.shape()) return false;
    grads.push_back(std::move(g));
  }
  const Tensor flat_params = contiguous_span(params_);
  if (!flat_params.defined()) return false;
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
    slot = zeros(param.shape(), param.dtype(), param.device());
  } else if (slot.device() != param.device()) {
    slot = slot.to(param.device());
  }
  return slot;
}

}  // namespace tandem::nn::optim
