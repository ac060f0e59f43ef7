#pragma once
// Pooling: AvgPool2d, MaxPool2d (square windows) and GlobalAvgPool2d.
#include "kernels/backend.h"
#include "nn/module.h"

namespace tandem::nn {

// stride 0 means stride = kernel_size (PyTorch's default). Average pooling divides by the
// full window, padding included (PyTorch's count_include_pad=True).
class AvgPool2d : public Cloneable<AvgPool2d> {
 public:
  explicit AvgPool2d(int64_t kernel_size, int64_t stride = 0, int64_t padding = 0);
  Pool2dParams params() const { return p_; }
  // forward(act(z)) as one op (autograd's activation_pool2d): the same values and gradients.
  // What a Sequential runs for a ReLU or a Sigmoid followed by this module when
  // fuse_activation_pool() is on (kernels/backend.h). conv_bias, where defined, is the bias of
  // the Conv2d before the activation, which left it out (Conv2d::forward_bias_deferred): act(z
  // + conv_bias[c]).
  Tensor forward_activation(const Tensor& z, Activation act, const Tensor& conv_bias = Tensor());
  std::string name() const override { return "AvgPool2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  Pool2dParams p_;
};

class MaxPool2d : public Cloneable<MaxPool2d> {
 public:
  explicit MaxPool2d(int64_t kernel_size, int64_t stride = 0, int64_t padding = 0);
  Pool2dParams params() const { return p_; }
  // forward(act(z)) as one op (autograd's activation_pool2d): the same values and gradients.
  // What a Sequential runs for a ReLU or a Sigmoid followed by this module when
  // fuse_activation_pool() is on (kernels/backend.h). conv_bias, where defined, is the bias of
  // the Conv2d before the activation, which left it out (Conv2d::forward_bias_deferred): act(z
  // + conv_bias[c]).
  Tensor forward_activation(const Tensor& z, Activation act, const Tensor& conv_bias = Tensor());
  std::string name() const override { return "MaxPool2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  Pool2dParams p_;
};

// Mean over H and W: [N, C, H, W] -> [N, C].
class GlobalAvgPool2d : public Cloneable<GlobalAvgPool2d> {
 public:
  GlobalAvgPool2d() = default;
  std::string name() const override { return "GlobalAvgPool2d"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;
};

}  // namespace tandem::nn
