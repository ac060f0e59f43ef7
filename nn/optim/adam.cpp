#include "nn/optim/adam.h"

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::nn::optim {

Adam::Adam(std::vector<Tensor> params, const AdamOptions& options, bool decoupled_weight_decay)
    : Optimizer(std::move(params), options.lr(), options.capturable()),
      beta1_(options.betas().first),
      beta2_(options.betas().second),
      eps_(options.eps()),
      weight_decay_(options.weight_decay()),
      decoupled_(decoupled_weight_decay),
      m_(this->params().size()),
      v_(this->params().size()),
      steps_(this->params().size(), 0),
      step_tensors_(this->params().size()),
      consts_(this->params().size()) {
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

int64_t Adam::step_count(size_t i) const {
  if (!capturable()) return steps_.at(i);
  const Tensor& t = step_tensors_.at(i);
  return t.defined() ? static_cast<int64_t>(t.item()) : 0;  // item() waits for the device
}

bool Adam::update_flat(const Tensor& params, const Tensor& grads) {
  bool fresh = false;  // capturable: no parameter has a count yet
  if (capturable()) {
    // One count for the whole span (Note [capturable optimizer steps]): equal counts are known
    // without reading the device only when they are one tensor.
    fresh = true;
    for (const Tensor& s : step_tensors_) fresh = fresh && !s.defined();
    if (!fresh && !(shared_steps_ && step_tensors_[0].device() == params.device())) return false;
  } else {
    for (int64_t s : steps_) {
      if (s != steps_[0]) return false;  // the bias correction differs per parameter
    }
  }
  Tensor m = flat_state(m_, params);
  if (!m.defined()) return false;
  Tensor v = flat_state(v_, params);
  if (!v.defined()) return false;
  AdamParams p = kernel_params();
  if (capturable()) {
    if (fresh) {
      const Tensor step = zeros({}, kFloat32, params.device());
      const Tensor consts = zeros({3}, kFloat64, params.device());
      for (size_t i = 0; i < step_tensors_.size(); ++i) {
        step_tensors_[i] = step;
        consts_[i] = consts;
      }
      shared_steps_ = true;
    }
    kernels::adam_advance_step(step_tensors_[0], lr_tensor(params.device()), consts_[0], p);
    p.consts = consts_[0];
  } else {
    p.step = steps_[0] + 1;
    for (int64_t& s : steps_) s = p.step;
  }
  p.copy_into = weight_copy();  // Note [the weight copy written by the update]
  kernels::adam_step(params, grads, m, v, p);
  return true;
}

void Adam::own_step_state(size_t index, const Tensor& param) {
  if (shared_steps_) {
    // The flat path's one count becomes one per parameter (device copies, stream-ordered),
    // so that each advances with its own parameter from now on.
    for (size_t i = 0; i < step_tensors_.size(); ++i) {
      if (!step_tensors_[i].defined()) continue;
      step_tensors_[i] = step_tensors_[i].clone();
      consts_[i] = zeros({3}, kFloat64, step_tensors_[i].device());
    }
    shared_steps_ = false;
  }
  Tensor& step = step_tensors_[index];
  if (step.defined() && step.device() == param.device()) return;
  step = step.defined() ? step.to(param.device()) : zeros({}, kFloat32, param.device());
  consts_[index] = zeros({3}, kFloat64, param.device());
}

void Adam::update(size_t index, const Tensor& param, const Tensor& grad) {
  AdamParams p = kernel_params();
  const Tensor& m = state_like(m_[index], param);
  const Tensor& v = state_like(v_[index], param);
  if (capturable()) {
    own_step_state(index, param);
    kernels::adam_advance_step(step_tensors_[index], lr_tensor(param.device()), consts_[index], p);
    p.consts = consts_[index];
  } else {
    p.step = ++steps_[index];
  }
  kernels::adam_step(param, grad, m, v, p);
}

void Adam::state_loaded() {
  if (!capturable()) return;
  // Note [capturable optimizer steps]: the counts just read go onto the devices -- as one
  // shared count when the moments were loaded flat and every count is equal, which is what
  // the flat path keeps; else one per parameter that has state.
  shared_steps_ = false;
  bool equal = !m_.empty();
  for (size_t i = 0; i < m_.size(); ++i) equal = equal && m_[i].defined() && steps_[i] == steps_[0];
  const Tensor span = equal ? contiguous_span(m_) : Tensor();
  for (size_t i = 0; i < m_.size(); ++i) {
    if (!m_[i].defined()) {
      step_tensors_[i] = consts_[i] = Tensor();
    } else if (span.defined() && i > 0) {
      step_tensors_[i] = step_tensors_[0];
      consts_[i] = consts_[0];
    } else {
      step_tensors_[i] = full({}, static_cast<double>(steps_[i]), kFloat32, m_[i].device());
      consts_[i] = zeros({3}, kFloat64, m_[i].device());
    }
  }
  shared_steps_ = span.defined();
}

}  // namespace tandem::nn::optim
