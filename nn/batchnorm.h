#pragma once
// BatchNorm2d (also accepts [N, C] input, as BatchNorm1d would).
#include "nn/module.h"

namespace tandem::nn {

// Per-channel normalization over every dim but 1. Parameters weight [C] (ones) and bias [C]
// (zeros); buffers running_mean [C] (zeros), running_var [C] (ones) and num_batches_tracked
// (int64 [], 0), in PyTorch's state_dict order and names.
// Training: normalizes with the batch mean and biased variance, and updates the running
// statistics in place: running = (1 - momentum) * running + momentum * batch, with the
// unbiased batch variance (PyTorch's rule), and adds 1 to num_batches_tracked (on the device:
// no host read). Eval: normalizes with the running statistics and counts nothing.
class BatchNorm2d : public Cloneable<BatchNorm2d> {
 public:
  explicit BatchNorm2d(int64_t num_features, double eps = 1e-5, double momentum = 0.1);

  const Tensor& weight() const { return parameter("weight"); }
  const Tensor& bias() const { return parameter("bias"); }
  const Tensor& running_mean() const { return buffer("running_mean"); }
  const Tensor& running_var() const { return buffer("running_var"); }
  const Tensor& num_batches_tracked() const { return buffer("num_batches_tracked"); }
  int64_t num_features() const { return c_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  // Running statistics back to mean 0, variance 1, and num_batches_tracked to 0.
  void reset_running_stats();
  // relu(forward(x)) with the ReLU fused into the batch norm's passes (autograd's
  // batch_norm_relu): the same values, gradients and statistics. What Residual calls for its
  // first batch norm when fuse_bn_relu() is on (kernels/backend.h).
  Tensor forward_relu(const Tensor& x);

  std::string name() const override { return "BatchNorm2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  Tensor run(const Tensor& x, bool relu);

  int64_t c_;
  double eps_, momentum_;
  Tensor one_;  // int64 [] 1 on the buffers' device: what each training forward adds
};

}  // namespace tandem::nn
