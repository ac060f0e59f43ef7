#pragma once
// Conv2d.
#include "core/generator.h"
#include "kernels/backend.h"
#include "nn/module.h"

namespace tandem::nn {

// 2-D cross-correlation with a square kernel. x [N, in, H, W], weight [out, in, k, k],
// bias [out]; y [N, out, P, Q] with P = (H + 2 * padding - k) / stride + 1 (Q likewise).
// Initialized like PyTorch (init::default_layer_init_), drawing from `gen`.
class Conv2d : public Cloneable<Conv2d> {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1,
         int64_t padding = 0, bool bias = true, Generator& gen = default_generator());

  const Tensor& weight() const { return parameter("weight"); }  // [out, in, k, k]
  Tensor bias() const { return find_parameter("bias"); }        // [out] or undefined
  int64_t in_channels() const { return in_; }
  int64_t out_channels() const { return out_; }
  int64_t kernel_size() const { return kernel_; }
  Conv2dParams params() const { return {stride_, stride_, padding_, padding_}; }
  // Redraws weight and bias with PyTorch's default initialization.
  void reset_parameters(Generator& gen = default_generator());
  // forward(x) without adding the bias (forward's checks), for a batch norm after this layer
  // that adds the bias in its own passes (BatchNorm2d::forward_biased, nn::conv_batch_norm).
  Tensor forward_no_bias(const Tensor& x);
  // forward(x) with the bias left for the op after it to add, its gradient still computed here
  // (autograd's conv2d with add_bias false; Note [conv bias in activation + pooling] in
  // kernels/ops.h): what a Sequential runs for this layer followed by an activation and a
  // pooling module (AvgPool2d / MaxPool2d::forward_activation with bias()).
  Tensor forward_bias_deferred(const Tensor& x);

  std::string name() const override { return "Conv2d"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  void check_input_shape(const Tensor& x) const;

  int64_t in_, out_, kernel_, stride_, padding_;
};

}  // namespace tandem::nn
