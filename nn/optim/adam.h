#pragma once
// Adam and AdamW, following torch.optim.Adam / AdamW (amsgrad off):
//   Adam:  g = grad + weight_decay * p          AdamW: p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// t counts each parameter's own steps (a parameter skipped for lack of a gradient does not
// advance), as in PyTorch.
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

class Adam : public Optimizer {
 public:
  // ValueError for betas outside [0, 1), a negative eps or weight decay.
  Adam(std::vector<Tensor> params, double lr = 1e-3, std::pair<double, double> betas = {0.9, 0.999},
       double eps = 1e-8, double weight_decay = 0.0, bool decoupled_weight_decay = false);

  std::pair<double, double> betas() const { return {beta1_, beta2_}; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }
  bool decoupled_weight_decay() const { return decoupled_; }
  // Steps taken by parameter i so far.
  int64_t step_count(size_t i) const { return steps_.at(i); }

 protected:
  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  bool update_flat(const Tensor& params, const Tensor& grads) override;

 private:
  AdamParams kernel_params() const;

  double beta1_, beta2_, eps_, weight_decay_;
  bool decoupled_;
  std::vector<Tensor> m_, v_;  // first and second moments, like each parameter
  std::vector<int64_t> steps_;
};

// Adam with decoupled weight decay (Loshchilov & Hutter); PyTorch's default decay 1e-2.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, double lr = 1e-3,
        std::pair<double, double> betas = {0.9, 0.999}, double eps = 1e-8,
        double weight_decay = 1e-2)
      : Adam(std::move(params), lr, betas, eps, weight_decay, true) {}
};

}  // namespace tandem::nn::optim
