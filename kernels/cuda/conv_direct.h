#pragma once
// tandem's own kernels for small convolutions (Note [direct convolution] in conv_direct.cu):
// the forward and weight-gradient passes of layers with few input channels, where cuDNN's
// engines are made for far more work than there is.
#include <cuda_runtime.h>

#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem::gpu {

// ForwardAnyTaps: the forward kernel without its limit on taps per output, which leaves layers
// like LeNet's second to cuDNN; for bench_conv_small, which measures it there. conv.cu asks
// for Forward.
enum class DirectPass { Forward, BackwardWeight, ForwardAnyTaps };

// What every convolution kernel of tandem's own asks of a layer (the direct kernels here, the
// row-window kernels of conv_rows.h): direct_conv() on (kernels/backend.h), float32 or float64,
// packed 4-d NCHW tensors, stride 1, fewer than 2^31 elements in x and y.
bool own_conv_kernels_take(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p);

// Whether the direct kernels take a convolution of x [N, C, H, W] with w [K, C, R, S] into
// y [N, K, P, Q] for this pass: stride 1, float32 or float64, packed NCHW, few input
// channels (the forward: few taps per output), and tiles that fit in shared memory.
bool direct_conv_applies(DirectPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p);

// y = conv2d(x, w) + bias (bias may be undefined). Overwrites y.
void direct_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                         const Tensor& y, cudaStream_t stream);
// dw (and db when defined) = the gradients with respect to w and the bias. Overwrites them.
void direct_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                                 const Tensor& db, cudaStream_t stream);

}  // namespace tandem::gpu
