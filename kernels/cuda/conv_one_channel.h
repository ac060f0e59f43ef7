#pragma once
// tandem's own kernels for convolutions of one input channel (Note [one-input-channel
// convolution] in conv_one_channel.cuh): the forward and weight-gradient passes of a first layer
// on grey images (ResNet-18's stem on Fashion-MNIST), in bfloat16, float32 or float64, with the
// output in either memory format, where cuDNN pads the channel to eight and converts layouts.
#include <cuda_runtime.h>

#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem::gpu {

enum class OneChannelPass { Forward, BackwardWeight };

// Whether the kernels take this pass of a convolution of x [N, 1, H, W] with w [K, 1, R, S] into
// y [N, K, P, Q] (the weight gradient: w is dw, y is dy): one_channel_conv() on
// (kernels/backend.h), x and y of one dtype among bfloat16, float32 and float64 (w of that dtype
// too, or float32 for a bfloat16 weight gradient), stride 1 or 2, filters up to 7x7, x and w
// packed (with one channel both memory formats are the same bytes), y packed NCHW or
// channels-last, K a multiple of the channels a thread computes (8 for 3x3 filters in bfloat16
// and float32), fewer than 2^31 elements in x and y.
bool one_channel_conv_applies(OneChannelPass pass, const Tensor& x, const Tensor& w, const Tensor& y,
                              const Conv2dParams& p);

// y = conv2d(x, w) + bias (bias may be undefined), y in its own memory format. Overwrites y.
void one_channel_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                              const Tensor& y, cudaStream_t stream);
// dw (and db when defined) = the gradients with respect to w and the bias, from dy in its own
// memory format. dw and db are of x's dtype, or both float32 for bfloat16 x and dy (the sums
// are then rounded once, to float32). Overwrites them.
void one_channel_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                                      const Tensor& db, cudaStream_t stream);

}  // namespace tandem::gpu
