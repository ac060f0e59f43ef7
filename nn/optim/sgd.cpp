#include "nn/optim/sgd.h"

#include "core/error.h"
#include "kernels/ops.h"

namespace tandem::nn::optim {

SGD::SGD(std::vector<Tensor> params, double lr, double momentum, double weight_decay,
         double dampening, bool nesterov)
    : Optimizer(std::move(params), lr),
      momentum_(momentum),
      weight_decay_(weight_decay),
      dampening_(dampening),
      nesterov_(nesterov),
      buffers_(this->params().size()) {
  TANDEM_CHECK(momentum >= 0, Value, "SGD: momentum must be >= 0, got ", momentum);
  TANDEM_CHECK(weight_decay >= 0, Value, "SGD: weight_decay must be >= 0, got ", weight_decay);
  TANDEM_CHECK(!nesterov || (momentum > 0 && dampening == 0), Value,
               "SGD: nesterov needs momentum > 0 and dampening 0, got momentum=", momentum,
               " dampening=", dampening);
}

SgdParams SGD::kernel_params() const {
  SgdParams p;
  p.lr = lr();
  p.momentum = momentum_;
  p.dampening = dampening_;
  p.weight_decay = weight_decay_;
  p.nesterov = nesterov_;
  return p;
}

bool SGD::update_flat(const Tensor& params, const Tensor& grads) {
  SgdParams p = kernel_params();
  Tensor buf;
  if (momentum_ != 0) {
    p.first_step = !buffers_[0].defined();
    buf = flat_state(buffers_, params);
    if (!buf.defined()) return false;
  }
  kernels::sgd_step(params, grads, buf, p);
  return true;
}

void SGD::update(size_t index, const Tensor& param, const Tensor& grad) {
  SgdParams p = kernel_params();
  Tensor buf;
  if (momentum_ != 0) {
    p.first_step = !buffers_[index].defined();
    buf = state_like(buffers_[index], param);
  }
  kernels::sgd_step(param, grad, buf, p);
}

}  // namespace tandem::nn::optim
