#pragma once
// Stochastic gradient descent with momentum, dampening, weight decay and Nesterov momentum,
// following torch.optim.SGD exactly:
//   g = grad + weight_decay * p
//   buf = g on the first step, else momentum * buf + (1 - dampening) * g   (momentum != 0)
//   g = nesterov ? g + momentum * buf : buf                                 (momentum != 0)
//   p -= lr * g
// Two ways to construct, as in libtorch: an options struct,
//   SGD(params, SGDOptions(0.1).momentum(0.9).weight_decay(1e-4))
// or positional arguments in torch.optim.SGD's order (lr, momentum, dampening, weight_decay,
// nesterov), so a call ported from Python keeps its meaning.
// SGDOptions(lr).capturable(true): the learning rate lives in device memory, so a step
// replayed from a CUDA graph uses the current one (Note [capturable optimizer steps]). PyTorch's
// SGD has no such flag -- it is graph-safe when given a tensor lr -- but tandem keeps one name
// for SGD and Adam; the result is the same bits as without it.
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

// SGD's hyperparameters with chainable setters: SGDOptions(lr).momentum(0.9).nesterov(true).
struct SGDOptions {
  explicit SGDOptions(double lr) : lr_(lr) {}

  SGDOptions& lr(double v) { lr_ = v; return *this; }
  SGDOptions& momentum(double v) { momentum_ = v; return *this; }
  SGDOptions& dampening(double v) { dampening_ = v; return *this; }
  SGDOptions& weight_decay(double v) { weight_decay_ = v; return *this; }
  SGDOptions& nesterov(bool v) { nesterov_ = v; return *this; }
  SGDOptions& capturable(bool v) { capturable_ = v; return *this; }

  double lr() const { return lr_; }
  double momentum() const { return momentum_; }
  double dampening() const { return dampening_; }
  double weight_decay() const { return weight_decay_; }
  bool nesterov() const { return nesterov_; }
  bool capturable() const { return capturable_; }

 private:
  double lr_, momentum_ = 0.0, dampening_ = 0.0, weight_decay_ = 0.0;
  bool nesterov_ = false, capturable_ = false;
};

class SGD : public Optimizer {
 public:
  // ValueError for negative hyperparameters, or nesterov without momentum or with dampening.
  SGD(std::vector<Tensor> params, const SGDOptions& options);
  // torch.optim.SGD's positional order.
  SGD(std::vector<Tensor> params, double lr, double momentum = 0.0, double dampening = 0.0,
      double weight_decay = 0.0, bool nesterov = false)
      : SGD(std::move(params), SGDOptions(lr)
                                   .momentum(momentum)
                                   .dampening(dampening)
                                   .weight_decay(weight_decay)
                                   .nesterov(nesterov)) {}

  double momentum() const { return momentum_; }
  double dampening() const { return dampening_; }
  double weight_decay() const { return weight_decay_; }
  bool nesterov() const { return nesterov_; }
  // The momentum buffer of parameter i (undefined before its first step or without momentum).
  const Tensor& momentum_buffer(size_t i) const { return buffers_.at(i); }

 protected:
  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  bool update_flat(const Tensor& params, const Tensor& grads) override;
  bool update_flat_writes_weight_copy() const override { return true; }
  // Note [optimizer state names]: "momentum_buffer".
  std::vector<StateKind> state_kinds() const override { return {{"momentum_buffer", true}}; }
  std::vector<Tensor>* state_slots(const std::string&) override { return &buffers_; }

 private:
  // The kernel's arguments for a parameter on `device` (capturable: its lr tensor).
  SgdParams kernel_params(Device device);

  double momentum_, weight_decay_, dampening_;
  bool nesterov_;
  std::vector<Tensor> buffers_;  // one per parameter, like the parameter
};

}  // namespace tandem::nn::optim
