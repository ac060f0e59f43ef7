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
// AdamOptions(lr).capturable(true) is PyTorch's capturable=True (keyword-only there, after
// amsgrad, so here an option only): the step count and the learning rate live on the device
// and a step replayed from a CUDA graph advances (Note [capturable optimizer steps]).
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

// Adam's and AdamW's hyperparameters with chainable setters (Self: the options type the
// setters return, so AdamWOptions(1e-3).eps(1e-6) stays an AdamWOptions).
template <typename Self>
struct AdamOptionsBase {
  Self& lr(double v) { return set(lr_, v); }
  Self& betas(std::pair<double, double> v) { return set(betas_, v); }
  Self& eps(double v) { return set(eps_, v); }
  Self& weight_decay(double v) { return set(weight_decay_, v); }
  Self& capturable(bool v) { return set(capturable_, v); }

  double lr() const { return lr_; }
  std::pair<double, double> betas() const { return betas_; }
  double eps() const { return eps_; }
  double weight_decay() const { return weight_decay_; }
  bool capturable() const { return capturable_; }

 protected:
  AdamOptionsBase(double lr, double weight_decay) : lr_(lr), weight_decay_(weight_decay) {}

 private:
  template <typename T>
  Self& set(T& field, T v) {
    field = v;
    return static_cast<Self&>(*this);
  }
  double lr_;
  std::pair<double, double> betas_{0.9, 0.999};
  double eps_ = 1e-8, weight_decay_;
  bool capturable_ = false;
};

// AdamOptions(1e-3).betas({0.9, 0.98}).eps(1e-6): torch.optim.Adam's defaults.
struct AdamOptions : AdamOptionsBase<AdamOptions> {
  explicit AdamOptions(double lr = 1e-3) : AdamOptionsBase(lr, 0.0) {}
};

// AdamW's: the same, with PyTorch's default decay 1e-2.
struct AdamWOptions : AdamOptionsBase<AdamWOptions> {
  explicit AdamWOptions(double lr = 1e-3) : AdamOptionsBase(lr, 1e-2) {}
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
  // Steps taken by parameter i so far. Capturable: read from the device, so it synchronizes
  // the host and must not be called inside a capture.
  int64_t step_count(size_t i) const;

 protected:
  // decoupled_weight_decay: AdamW's decay instead of Adam's.
  Adam(std::vector<Tensor> params, const AdamOptions& options, bool decoupled_weight_decay);

  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  bool update_flat(const Tensor& params, const Tensor& grads) override;
  bool update_flat_writes_weight_copy() const override { return true; }
  // Note [optimizer state names]: "step", "exp_avg", "exp_avg_sq".
  std::vector<StateKind> state_kinds() const override {
    return {{"step", false}, {"exp_avg", true}, {"exp_avg_sq", true}};
  }
  std::vector<Tensor>* state_slots(const std::string& name) override {
    return name == "exp_avg" ? &m_ : &v_;
  }
  double scalar_state(size_t index, const std::string&) const override {
    return static_cast<double>(steps_.at(index));
  }
  // Capturable: the host count is only where load_state_dict puts the values it reads;
  // state_loaded() then makes the device counts from them.
  void set_scalar_state(size_t index, const std::string&, double value) override {
    steps_.at(index) = static_cast<int64_t>(value);
  }
  Tensor scalar_state_tensor(size_t index, const std::string&) const override {
    return capturable() ? step_tensors_.at(index) : Tensor();
  }
  void state_loaded() override;

 private:
  AdamParams kernel_params() const;
  // Capturable: the device count and constants of parameter `index` alone, on its device.
  void own_step_state(size_t index, const Tensor& param);

  double beta1_, beta2_, eps_, weight_decay_;
  bool decoupled_;
  std::vector<Tensor> m_, v_;  // first and second moments, like each parameter
  std::vector<int64_t> steps_;  // the host counts (not capturable)
  // Capturable (Note [capturable optimizer steps]): per parameter its count (float32 [],
  // undefined before its first step) and the constants derived from it (float64 [3]). After
  // the flat path every entry is the same pair of tensors and shared_steps_ is true.
  std::vector<Tensor> step_tensors_, consts_;
  bool shared_steps_ = false;
};

// Adam with decoupled weight decay (Loshchilov & Hutter); PyTorch's default decay 1e-2.
class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> params, const AdamWOptions& options)
      : Adam(std::move(params),
             AdamOptions(options.lr())
                 .betas(options.betas())
                 .eps(options.eps())
                 .weight_decay(options.weight_decay())
                 .capturable(options.capturable()),
             true) {}
  // torch.optim.AdamW's positional order.
  AdamW(std::vector<Tensor> params, double lr = 1e-3,
        std::pair<double, double> betas = {0.9, 0.999}, double eps = 1e-8,
        double weight_decay = 1e-2)
      : AdamW(std::move(params),
              AdamWOptions(lr).betas(betas).eps(eps).weight_decay(weight_decay)) {}
};

}  // namespace tandem::nn::optim
