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
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    Tensor g = p.grad();
    if (!g.defined()) continue;
    TANDEM_CHECK(g.shape() == p.shape(), Shape, "Optimizer: parameter ", i, " ",
                 shape_str(p.shape()), " has a gradient of shape ", shape_str(g.shape()));
    update(i, p, g.is_contiguous() ? g : g.contiguous());
  }
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
