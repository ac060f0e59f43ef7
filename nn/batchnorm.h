#pragma once
// BatchNorm2d (also accepts [N, C] input, as BatchNorm1d would).
#include "nn/module.h"

namespace tandem::nn {

// Per-channel normalization over every dim but 1. Parameters weight [C] (ones) and bias [C]
// (zeros); buffers running_mean [C] (zeros) and running_var [C] (ones).
// Training: normalizes with the batch mean and biased variance, and updates the running
// statistics in place: running = (1 - momentum) * running + momentum * batch, with the
// unbiased batch variance (PyTorch's rule). Eval: normalizes with the running statistics.
class BatchNorm2d : public Cloneable<BatchNorm2d> {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1);

  const Tensor& weight() const { return parameter("weight"); }
  const Tensor& bias() const { return parameter("bias"); }
  const Tensor& running_mean() const { return buffer("running_mean"); }
  const Tensor& running_var() const { return buffer("running_var"); }
  int64_t num_features() const { return c_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  // Running statistics back to mean 0, variance 1.
  void reset_running_stats();

  std::string name() const override { return "BatchNorm2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  int64_t c_;
  double eps_, momentum_;
};

}  // namespace tandem::nn
