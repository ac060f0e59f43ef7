#include "nn/optim/adam.h"

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::nn::optim {

Adam::Adam(std::vector<Tensor> params, const AdamOptions& options, bool decoupled_weight_decay)
    : Optimizer(std::move(params), options.lr()),
      beta1_(options.betas().first),
      beta2_(options.betas().second),
      eps_(options.eps()),
      weight_decay_(options.weight_decay()),
      decoupled_(decoupled_weight_decay),
      m_(this->params().size()),
      v_(this->params().size()),
      steps_(this->params().size(), 0) {
  TANDEM_CHECK(beta1_ >= 0 && beta1_ < 1 && beta2_ >= 0 && beta2_ < 1, Value,
               "Adam: betas must be in [0, 1), got (", beta1_, ", ", beta2_, ")");
  TANDEM_CHECK(eps_ >= 0, Value, "Adam: eps must be >= 0, got ", eps_);
  TANDEM_CHECK(weight_decay_ >= 0, Value, "Adam: weight_decay must be >= 0, got ", weight_decay_);
}

AdamParams Adam::kernel_params() const {
  AdamParams p;
  p.lr = lr();
  p.beta1 = beta1_;
  p.beta2 = beta2_;
  p.eps = eps_;
  p.weight_decay = weight_decay_;
  p.decoupled_weight_decay = decoupled_;
  return p;
}

bool Adam::update_flat(const Tensor& params, const Tensor& grads) {
  for (int64_t s : steps_) {
    if (s != steps_[0]) return false;  // the bias correction differs per parameter
  }
  Tensor m = flat_state(m_, params);
  if (!m.defined()) return false;
  Tensor v = flat_state(v_, params);
  if (!v.defined()) return false;
  AdamParams p = kernel_params();
  p.step = steps_[0] + 1;
  for (int64_t& s : steps_) s = p.step;
  kernels::adam_step(params, grads, m, v, p);
  return true;
}

void Adam::update(size_t index, const Tensor& param, const Tensor& grad) {
  AdamParams p = kernel_params();
  p.step = ++steps_[index];
  kernels::adam_step(param, grad, state_like(m_[index], param), state_like(v_[index], param), p);
}

}  // namespace tandem::nn::optim
