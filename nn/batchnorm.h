#pragma once
// BatchNorm2d (also accepts [N, C] input, as BatchNorm1d would).
#include "nn/module.h"

namespace tandem::nn {

class Conv2d;

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
  // forward(z + conv_bias), or forward_relu of it, for z the output of a Conv2d run without its
  // bias (Conv2d::forward_no_bias) and conv_bias [C] that bias, without storing z + conv_bias
  // (autograd's batch_norm_bias): the same values, gradients (conv_bias's too) and statistics.
  // What conv_batch_norm calls when fuse_conv_bias() is on (kernels/backend.h).
  Tensor forward_biased(const Tensor& z, const Tensor& conv_bias, bool relu = false);
  // relu(forward(x) + residual), the join at the end of a ResNet block, in the batch norm's
  // apply pass (autograd's batch_norm_add_relu); with conv_bias, of x + conv_bias as
  // forward_biased. The same values, gradients and statistics. What Residual calls for its
  // second batch norm when fuse_bn_add_relu() is on (kernels/backend.h).
  Tensor forward_add_relu(const Tensor& x, const Tensor& residual, const Tensor& conv_bias = Tensor());

  std::string name() const override { return "BatchNorm2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;
  // Every forward (plain, relu, biased, joined) ends here: SyncBatchNorm (nn/sync_batchnorm.h)
  // overrides it, so Residual and Sequential, which call the fused forms, use it unchanged.
  // residual (defined only with relu): relu(batch norm + residual).
  virtual Tensor run(const Tensor& x, bool relu, const Tensor& conv_bias, const Tensor& residual);

 private:

  int64_t c_;
  double eps_, momentum_;
};

// bn(conv(x)), or with relu bn.forward_relu(conv(x)); when fuse_conv_bias() is on and conv has
// a bias, conv runs without it and bn adds it in its passes (forward_biased): the same values
// and gradients (Note [conv bias in batch norm] in kernels/cuda/batchnorm.cuh). For a conv whose
// output goes to nothing but bn, as in Residual and a Sequential's Conv2d -> BatchNorm2d.
// With a residual (relu then implied): relu(bn(conv(x)) + residual), the batch norm's
// forward_add_relu, the conv's bias fused in the same way.
Tensor conv_batch_norm(Conv2d& conv, BatchNorm2d& bn, const Tensor& x, bool relu,
                       const Tensor& residual = Tensor());

}  // namespace tandem::nn
