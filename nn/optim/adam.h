#pragma once
// Adam and AdamW, following torch.optim.Adam / AdamW (amsgrad off):
//   Adam:  g = grad + weight_decay * p          AdamW: p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// t counts each parameter's own steps (a parameter skipped for lack of a gradient does not
// advance), as in PyTorch.
// Two ways to construct, as in libtorch: an options struct,
//   Adam(params, AdamOptions(1e-3).weight_decay(1e-4))      AdamW(params, AdamWOptions(1e-3))
// or positional arguments in torch.optim.Adam's / AdamW's order (lr, betas, eps, weight_decay).
// amsgrad is not supported, so a ported call that passes it does not compile.
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

// Adam's hyperparameters with chainable setters: AdamOptions(1e-3).betas({0.9, 0.98}).eps(1e-6).
struct AdamOptions {
  explicit AdamOptions(double lr = 1e-3) : lr_(lr) {}

  AdamOptions& lr(double v) {
    lr_ = v;
    return *this;
  }
  AdamOptions& betas(std::pair<double, double> v) {
    betas_ = v;
    return *this;
  }
  AdamOptions& eps(double v) {
    eps_ = v;
    return *this;
  }
  AdamOptions& weight_decay(double v) {
    weight_decay_ = v;
    return *this;
  }

  double lr() const { return lr_; }
  std::pair<double, double> betas() const { return betas_; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }

 private:
  double lr_;
  std::pair<double, double> betas_{0.9, 0.999};
  double eps_ = 1e-8, weight_decay_ = 0.0;
};

// AdamW's hyperparameters: AdamOptions's, with PyTorch's default decay 1e-2.
struct AdamWOptions {
  explicit AdamWOptions(double lr = 1e-3) : lr_(lr) {}

  AdamWOptions& lr(double v) {
    lr_ = v;
    return *this;
  }
  AdamWOptions& betas(std::pair<double, double> v) {
    betas_ = v;
    return *this;
  }
  AdamWOptions& eps(double v) {
    eps_ = v;
    return *this;
  }
  AdamWOptions& weight_decay(double v) {
    weight_decay_ = v;
    return *this;
  }

  double lr() const { return lr_; }
  std::pair<double, double> betas() const { return betas_; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }

 private:
  double lr_;
  std::pair<double, double> betas_{0.9, 0.999};
  double eps_ = 1e-8, weight_decay_ = 1e-2;
};

class Adam : public Optimizer {
 public:
  // ValueError for betas outside [0, 1), a negative eps or weight decay.
  Adam(std::vector<Tensor> params, const AdamOptions& options)
      : Adam(std::move(params), options, false) {}
  // torch.optim.Adam's positional order.
  Adam(std::vector<Tensor> params, double lr = 1e-3, std::pair<double, double> betas = {0.9, 0.999},
       double eps = 1e-8, double weight_decay = 0.0)
      : Adam(std::move(params), AdamOptions(lr).betas(betas).eps(eps).weight_decay(weight_decay)) {}

  std::pair<double, double> betas() const { return {beta1_, beta2_}; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }
  bool decoupled_weight_decay() const { return decoupled_; }
  // Steps taken by parameter i so far.
  int64_t step_count(size_t i) const { return steps_.at(i); }

 protected:
  // decoupled_weight_decay: AdamW's decay instead of Adam's.
  Adam(std::vector<Tensor> params, const AdamOptions& options, bool decoupled_weight_decay);

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
  AdamW(std::vector<Tensor> params, const AdamWOptions& options)
      : Adam(std::move(params),
             AdamOptions(options.lr())
                 .betas(options.betas())
                 .eps(options.eps())
                 .weight_decay(options.weight_decay()),
             true) {}
  // torch.optim.AdamW's positional order.
  AdamW(std::vector<Tensor> params, double lr = 1e-3,
        std::pair<double, double> betas = {0.9, 0.999}, double eps = 1e-8,
        double weight_decay = 1e-2)
      : AdamW(std::move(params),
              AdamWOptions(lr).betas(betas).eps(eps).weight_decay(weight_decay)) {}
};

}  // namespace tandem::nn::optim
