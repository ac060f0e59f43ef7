#include "nn/optim/sgd.h"

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::nn::optim {

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options)
    : Optimizer(std::move(params), options.lr(), options.capturable()),
      momentum_(options.momentum()),
      weight_decay_(options.weight_decay()),
      dampening_(options.dampening()),
      nesterov_(options.nesterov()),
      buffers_(this->params().size()) {
  TANDEM_CHECK(momentum_ >= 0, Value, "SGD: momentum must be >= 0, got ", momentum_);
  TANDEM_CHECK(weight_decay_ >= 0, Value, "SGD: weight_decay must be >= 0, got ", weight_decay_);
  TANDEM_CHECK(!nesterov_ || (momentum_ > 0 && dampening_ == 0), Value,
               "SGD: nesterov needs momentum > 0 and dampening 0, got momentum=", momentum_,
               " dampening=", dampening_);
}

SgdParams SGD::kernel_params(Device device) {
  SgdParams p;
  p.lr = lr();
  if (capturable()) p.lr_tensor = lr_tensor(device);
  p.momentum = momentum_;
  p.dampening = dampening_;
  p.weight_decay = weight_decay_;
  p.nesterov = nesterov_;
  return p;
}

bool SGD::update_flat(const Tensor& params, const Tensor& grads) {
  SgdParams p = kernel_params(params.device());
  Tensor buf;
  if (momentum_ != 0) {
    p.first_step = !buffers_[0].defined();
    buf = flat_state(buffers_, params);
    if (!buf.defined()) return false;
  }
  p.copy_into = weight_copy();  // Note [the weight copy written by the update]
  kernels::sgd_step(params, grads, buf, p);
  return true;
}

void SGD::update(size_t index, const Tensor& param, const Tensor& grad) {
  SgdParams p = kernel_params(param.device());
  Tensor buf;
  if (momentum_ != 0) {
    p.first_step = !buffers_[index].defined();
    buf = state_like(buffers_[index], param);
  }
  kernels::sgd_step(param, grad, buf, p);
}

}  // namespace tandem::nn::optim
