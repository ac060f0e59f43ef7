#pragma once
// tandem's row-window kernels for small convolutions (Note [row convolution] in conv_rows.cu):
// the forward, input-gradient and weight-gradient passes of stride-1 layers with 3- or 5-wide
// filters and few channels (LeNet's second layer, a first layer), where cuDNN's engines are
// made for far more work than there is.
#include <cuda_runtime.h>

#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem::gpu {

enum class RowPass { Forward, BackwardInput, BackwardWeight };

// Whether the row kernels take this pass of a convolution of x [N, C, H, W] with w [K, C, R, S]
// into y [N, K, P, Q]: stride 1, S of 3 or 5, packed NCHW float32 or float64, few channels, and
// tiles that fit in shared memory. The weight gradient asks with the bias gradient wanted.
// Only the passes row_conv_passes() names (kernels/backend.h).
bool row_conv_applies(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p);
// Whether the kernels can take the pass at all, chosen or not (for benchmarks and tests).
bool row_conv_fits(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p);

// y = conv2d(x, w) + bias (bias may be undefined). Overwrites y.
void row_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                      const Tensor& y, cudaStream_t stream);
// dx = the gradient of conv2d(x, w) with respect to x, from dy. Overwrites dx.
void row_conv_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p, const Tensor& dx,
                             cudaStream_t stream);
// dw (and db when defined) = the gradients with respect to w and the bias. Overwrites them.
void row_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                              const Tensor& db, cudaStream_t stream);

}  // namespace tandem::gpu
