#pragma once
// Stochastic gradient descent with momentum, dampening, weight decay and Nesterov momentum,
// following torch.optim.SGD exactly:
//   g = grad + weight_decay * p
//   buf = g on the first step, else momentum * buf + (1 - dampening) * g   (momentum != 0)
//   g = nesterov ? g + momentum * buf : buf                                 (momentum != 0)
//   p -= lr * g
#include <vector>

#include "kernels/backend.h"
#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

class SGD : public Optimizer {
 public:
  // ValueError for negative hyperparameters, or nesterov without momentum or with dampening.
  SGD(std::vector<Tensor> params, double lr, double momentum = 0.0, double weight_decay = 0.0,
      double dampening = 0.0, bool nesterov = false);

  double momentum() const { return momentum_; }
  double weight_decay() const { return weight_decay_; }
  // The momentum buffer of parameter i (undefined before its first step or without momentum).
  const Tensor& momentum_buffer(size_t i) const { return buffers_.at(i); }

 protected:
  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  bool update_flat(const Tensor& params, const Tensor& grads) override;

 private:
  SgdParams kernel_params() const;

  double momentum_, weight_decay_, dampening_;
  bool nesterov_;
  std::vector<Tensor> buffers_;  // one per parameter, like the parameter
};

}  // namespace tandem::nn::optim
