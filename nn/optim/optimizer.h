#pragma once
// Optimizer: the base of SGD and Adam.
//
// An optimizer holds parameter handles (the same TensorImpls the module holds, so a later
// Module::to() is followed). step() is non-virtual: it turns autograd recording off and calls
// the virtual update() for every parameter that has a gradient; parameters without one are
// skipped (see Note [zero_grad sets to none] in nn/module.h). Updates are fused in-place
// kernels (kernels::sgd_step, kernels::adam_step) enqueued on the parameter's device: step()
// never synchronizes the host. Per-parameter state (momentum, Adam moments) is allocated
// lazily on the parameter's device at its first update.
#include <vector>

#include "core/tensor.h"

namespace tandem::nn::optim {

class Optimizer {
 public:
  // Throws ValueError for an undefined, non-floating, non-leaf or repeated parameter, or a
  // negative learning rate.
  Optimizer(std::vector<Tensor> params, double lr);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  void step();
  // Clears the gradients of the parameters: undefined (default) or filled with zeros.
  void zero_grad(bool set_to_none = true);

  double lr() const { return lr_; }
  void set_lr(double lr);
  const std::vector<Tensor>& params() const { return params_; }

 protected:
  // Updates params()[index] in place from grad (same shape; defined).
  virtual void update(size_t index, const Tensor& param, const Tensor& grad) = 0;
  // The state tensor in `slot`, created as zeros like `param` when undefined, or moved to
  // param's device when the parameter has moved since.
  static const Tensor& state_like(Tensor& slot, const Tensor& param);

 private:
  std::vector<Tensor> params_;
  double lr_;
};

}  // namespace tandem::nn::optim
