#pragma once
// The direct weight gradient of small convolutions (Note [direct weight gradient] in
// conv_wgrad.cu): tandem's own deterministic kernels where cuDNN is slow.
#include <cuda_runtime.h>

#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem::gpu {

// Filters of at most kMaxChannels input channels and kMaxWeights weights per output channel
// (C*R*S, +1 for the bias).
constexpr int64_t kMaxChannels = 8;
constexpr int64_t kMaxWeights = 256;

// Whether direct_wgrad takes x, dy and a filter of shape ws [K, C, R, S] (with a bias
// gradient or not).
bool direct_wgrad_applies(const Tensor& x, const Tensor& dy, const Shape& ws, bool with_bias);

// dw [K, C, R, S] (and db [K] when defined) = the gradients of conv2d(x, w) given dy; x and dy
// packed NCHW, all of one floating dtype, on stream's device. Overwrites dw and db.
void direct_wgrad(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw, const Tensor& db,
                  cudaStream_t stream);

}  // namespace tandem::gpu
