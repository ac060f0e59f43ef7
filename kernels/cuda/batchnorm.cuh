#pragma once
// Batch normalization over [N, C, H*W] (H*W = 1 for [N, C] inputs), or over a channels-last
// [N * H * W, C] (Note [channels-last channel reductions]), per channel, with own
// kernels that follow kernels/cpu/batchnorm.cpp: statistics in double (Note [a thread's sums in
// float] for a 16-bit channels-last tensor), the biased variance for
// normalizing, the unbiased one for running_var.
//
// Each pass is three launches (Note [split channel reductions] in channel_reduce.cuh):
// partial sums of every (channel, image group) block, a per-channel finish that turns them
// into the channel's coefficients, and an elementwise pass that applies them. The variance is
// computed from sums of d = x - K and d^2 with K a sample of the channel (the shifted-data
// algorithm): one pass over x, in double, without the cancellation of E[x^2] - E[x]^2.
//
// This header holds what the forward (batchnorm.cu) and the backward (batchnorm_backward.cu)
// share: the rounded multiply-add, the fused conv bias, and the per-channel coefficients of
// the maps.
//
// Note [conv bias in batch norm]: in a ResNet, every convolution but the 1x1 shortcuts is
// followed by a batch norm. As two ops, the convolution's bias is one more pass over each
// activation forward (AddBias in conv.cu: read y, write y + b) and one backward (the bias
// gradient: read dy, the batch norm's dx, once more to sum it per channel) -- ~290 us of a
// 4.6 ms ResNet-18 step on an H200 (fused: 62.9k -> 64.6k images/s channels-last bf16, 31.5k ->
// 32.5k float32; on by default, fuse_conv_bias() in kernels/backend.h). Fused (a `bias` given to these kernels), the convolution
// writes z without its bias and every kernel here that reads x reads z instead and forms
// x = z + b[c] in registers with AddBias's own add (add_conv_bias: in the activation type T,
// so a bfloat16 sum is rounded once as there): the statistics and their shift K = x[c, first],
// the running statistics, the apply pass (with the ReLU or without), and in the backward the
// gradient partials and the dx pass. The saved tensor is z (and b), never z + b. The dx pass,
// which writes dx anyway, also sums it: db, the bias gradient, is channel_map_sum_any
// (channel_any.cuh), which walks the elements with the split, vector width and order of
// the convolution's bias reduction (channel_sum_any) and adds each rounded T value it stores,
// in double -- so db is bit for bit what the convolution computes from dx, and the outputs,
// statistics and every other gradient are those of the two ops. Mathematically a bias before
// a training-mode batch norm cancels (the mean absorbs it, and the sum of dx is zero up to
// rounding); but dropping it would change the bits, the running mean and eval mode, so the
// fusion keeps the arithmetic and only drops the memory passes. One exception: the layers
// of Note [direct convolution] (few input channels, packed NCHW float32/float64, e.g. a
// ResNet's stem) sum their bias gradient as one more tap of their weight-gradient kernel, in
// T; there the fused db (summed in double) differs from theirs in the last bits. The CPU, the
// reference, adds the bias in a pass of its own and sums db with the convolution's routine.
#include <type_traits>

#include "core/tensor.h"
#include "kernels/cuda/common.cuh"

namespace tandem::gpu {

// a * b + c rounded once. The maps and the partial sums of both passes spell out their fused
// multiply-adds: left to the compiler, the contraction of the same expression can differ
// between two kernels that inline it (a ReLU mask around it, say, or a conv's bias), and the
// fused batch norm + ReLU and the fused conv bias must give the unfused ops' bits (Note [batch
// norm + ReLU] in kernels/backend.h, Note [conv bias in batch norm]).
template <typename P>
__device__ __forceinline__ P fma_p(P a, P b, P c) {
  if constexpr (std::is_same_v<P, double>) {
    return __fma_rn(a, b, c);
  } else {
    return __fmaf_rn(a, b, c);
  }
}

// x = z + b in T: the add of AddBias in conv.cu (Note [conv bias in batch norm]).
template <typename T>
__device__ __forceinline__ T add_conv_bias(T z, T b) {
  return z + b;
}

// The partial kernels' x from what they read: z + b of channel c when a conv's bias is fused
// in (bias not null), else z itself.
template <typename T>
struct ChannelBias {
  bool on;
  T b;
  __device__ T operator()(T z) const { return on ? add_conv_bias(z, b) : z; }
};
template <typename T>
__device__ __forceinline__ ChannelBias<T> channel_bias(const T* bias, int64_t c) {
  return bias != nullptr ? ChannelBias<T>{true, bias[c]} : ChannelBias<T>{false, T(0)};
}

// Per-channel coefficients of a map: coef[c * N .. c * N + N), loaded at once (Note
// [per-channel maps] in channel_reduce.cuh).
template <typename P, int N>
struct ChannelCoef {
  P v[N];
};
template <int N, typename P>
__device__ __forceinline__ ChannelCoef<P, N> load_coef(const P* coef, int64_t c) {
  ChannelCoef<P, N> k;
#pragma unroll
  for (int j = 0; j < N; ++j) k.v[j] = coef[c * N + j];
  return k;
}

// A map's coefficients and, when the map is Biased, the channel's conv bias b: its x is then
// add_conv_bias(z, b) of the z it reads (Note [conv bias in batch norm]).
template <typename P, int N, typename T>
struct BnCoef {
  ChannelCoef<P, N> k;
  T b;
};
template <bool Biased, int N, typename P, typename T>
__device__ __forceinline__ BnCoef<P, N, T> load_bn_coef(const P* coef, const T* bias, int64_t c) {
  return {load_coef<N>(coef, c), Biased ? bias[c] : T(0)};
}
template <bool Biased, typename T>
__device__ __forceinline__ T bn_input(T z, T b) {
  if constexpr (Biased) {
    return add_conv_bias(z, b);
  } else {
    return z;
  }
}

// Calls f(std::bool_constant<on>) with on = bias.defined(): a kernel templated on whether a
// conv's bias is fused in.
template <typename F>
void with_bias(const Tensor& bias, F f) {
  if (bias.defined()) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace tandem::gpu
