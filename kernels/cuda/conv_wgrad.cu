// The weight (and bias) gradient of a convolution with few weights per output channel, in two
// deterministic passes of tandem's own, instead of cuDNN.
//
// Note [direct weight gradient]: dW[k, c, r, s] = sum over n, p, q of
// dy[n, k, p, q] * x[n, c, p * stride_h + r - pad_h, q * stride_w + s - pad_w]: C*R*S weights per
// output channel, each a sum over N*P*Q terms. For LeNet's first layer (C*R*S = 25, N*P*Q =
// 200,704) cuDNN's deterministic engines take ~200 us on an H200 -- most of the whole step's GPU
// time -- for 30 M multiply-adds. Here one block owns one output channel k and a chunk of the
// batch; its threads are laid out as (weight o, lane l): thread (o, l) sums the terms of weight o
// at the positions l, l + lanes, ... of the chunk in double, the lanes are then added in a fixed
// tree in shared memory, and a second kernel adds the chunks in order. The bias gradient
// (sum of dy) rides along as weight C*R*S. Fixed orders throughout: the result is the same bit
// for bit on every run (Note [deterministic reductions]). Every block reads its images' whole
// input, so this pays only for few input channels: used when C <= kMaxChannels and
// C*R*S + 1 <= kMaxWeights (the first layer of a network, where cuDNN is at its worst); deeper
// layers (ResNet's 3x3 and 1x1 over 64+ channels) have the work per weight that cuDNN's
// implicit GEMMs are made for. In benchmark mode (cudnn_benchmark()) cuDNN's timed choice is
// used instead: measured on an H200, a LeNet epoch took 0.106 s through a CUDA graph with this
// kernel and cuDNN's heuristics for the rest, 0.080 s with every pass timed among cuDNN's
// deterministic engines, and 0.168 s with the heuristics' choice everywhere.
#include <algorithm>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_wgrad.h"

namespace tandem::gpu {

namespace {

constexpr int kWgradBlock = 256;

// 32-bit sizes: direct_wgrad_applies keeps the tensors below 2^31 elements.
struct WgradShape {
  int n, c, h, w;      // x [N, C, H, W]
  int k, r, s;         // dw [K, C, R, S]
  int p, q;            // dy [N, K, P, Q]
  int sh, sw, ph, pw;  // stride, padding
  int weights;         // C*R*S (+1 with the bias)
  int lanes;           // threads per weight
  int chunk;           // images per block
  int chunks;          // blocks per output channel
};

// Block (k, chunk j): partial[j][k][o] for every weight o of channel k. Thread t is weight
// o = t % weights in lane l = t / weights, so a warp's threads are neighbouring weights at the
// same output position: one dy value for all of them, neighbouring x values. Lane l takes the
// output rows l, l + lanes, ... of every image of the chunk.
template <typename T>
__global__ void wgrad_partials(const T* __restrict__ x, const T* __restrict__ dy, double* __restrict__ partial,
                               WgradShape g, bool with_bias) {
  extern __shared__ double lane_sums[];  // [lanes][weights]
  const int k = blockIdx.x;
  const int j = blockIdx.y;
  const int t = threadIdx.x;
  const int used = g.weights * g.lanes;
  const int o = t % g.weights;
  const int l = t / g.weights;
  const int crs = g.c * g.r * g.s;
  double acc = 0;
  if (t < used) {
    const bool bias = with_bias && o == crs;
    const int c = bias ? 0 : o / (g.r * g.s);
    const int r = bias ? 0 : (o / g.s) % g.r;
    const int s = bias ? 0 : o % g.s;
    // The output columns whose input column q * sw + s - pw lies inside the image.
    const int lo_num = g.pw - s, hi_num = g.w - 1 + g.pw - s;
    const int q_lo = lo_num > 0 ? (lo_num + g.sw - 1) / g.sw : 0;
    const int q_hi = hi_num >= 0 ? min(g.q, hi_num / g.sw + 1) : 0;
    const int n1 = min(g.n, (j + 1) * g.chunk);
    for (int n = j * g.chunk; n < n1; ++n) {
      const T* dyk = dy + (static_cast<int64_t>(n) * g.k + k) * g.p * g.q;
      const T* xc = x + (static_cast<int64_t>(n) * g.c + c) * g.h * g.w;
      for (int pi = l; pi < g.p; pi += g.lanes) {
        const T* dyrow = dyk + pi * g.q;
        if (bias) {
          for (int qi = 0; qi < g.q; ++qi) acc += static_cast<double>(dyrow[qi]);
          continue;
        }
        const int hi = pi * g.sh + r - g.ph;
        if (hi < 0 || hi >= g.h) continue;  // a padding row
        const T* xrow = xc + hi * g.w;
        for (int qi = q_lo; qi < q_hi; ++qi) {
          acc += static_cast<double>(dyrow[qi]) * static_cast<double>(xrow[qi * g.sw + s - g.pw]);
        }
      }
    }
    lane_sums[t] = acc;
  }
  __syncthreads();
  // Add the lanes of each weight pairwise in a fixed tree.
  for (int stride = 1; stride < g.lanes; stride *= 2) {
    if (t < used && l % (2 * stride) == 0 && l + stride < g.lanes) lane_sums[t] += lane_sums[t + stride * g.weights];
    __syncthreads();
  }
  if (t < g.weights) partial[(static_cast<int64_t>(j) * g.k + k) * g.weights + t] = lane_sums[t];
}

// dw[k][o] (and db[k]) = sum over the chunks in order.
template <typename T>
__global__ void wgrad_finish(const double* __restrict__ partial, T* __restrict__ dw, T* __restrict__ db,
                             WgradShape g) {
  const int crs = g.c * g.r * g.s;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= g.k * g.weights) return;
  const int k = i / g.weights;
  const int o = i % g.weights;
  double sum = 0;
  for (int j = 0; j < g.chunks; ++j) sum += partial[(static_cast<int64_t>(j) * g.k + k) * g.weights + o];
  if (o < crs) {
    dw[k * crs + o] = static_cast<T>(sum);
  } else {
    db[k] = static_cast<T>(sum);
  }
}

}  // namespace

bool direct_wgrad_applies(const Tensor& x, const Tensor& dy, const Shape& ws, bool with_bias) {
  constexpr int64_t kMax32 = int64_t{1} << 31;
  return x.dtype() != kBFloat16 && ws.size() == 4 && ws[1] <= kMaxChannels && ws[1] * ws[2] * ws[3] + (with_bias ? 1 : 0) <= kMaxWeights &&
         x.numel() < kMax32 && dy.numel() < kMax32 && x.is_contiguous() && dy.is_contiguous();
}

void direct_wgrad(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw, const Tensor& db,
                  cudaStream_t stream) {
  const bool with_bias = db.defined();
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  WgradShape g{};
  g.n = i32(x.size(0)), g.c = i32(x.size(1)), g.h = i32(x.size(2)), g.w = i32(x.size(3));
  g.k = i32(dw.size(0)), g.r = i32(dw.size(2)), g.s = i32(dw.size(3));
  g.p = i32(dy.size(2)), g.q = i32(dy.size(3));
  g.sh = i32(p.stride_h), g.sw = i32(p.stride_w), g.ph = i32(p.pad_h), g.pw = i32(p.pad_w);
  g.weights = g.c * g.r * g.s + (with_bias ? 1 : 0);
  // As many lanes per weight as fit in a block (a power of two, for the tree), no more than
  // there are output rows.
  g.lanes = 1;
  while (g.weights * g.lanes * 2 <= kWgradBlock && g.lanes < g.p) g.lanes *= 2;
  // About 1024 blocks in all: enough to fill the GPU, with a long loop per thread.
  g.chunk = std::max(1, (g.n * g.k + 1023) / 1024);
  g.chunks = (g.n + g.chunk - 1) / g.chunk;
  Tensor partial = empty({int64_t{g.chunks} * g.k * g.weights}, kFloat64, dw.device());
  const dim3 grid(static_cast<unsigned>(g.k), static_cast<unsigned>(g.chunks));
  const size_t shared = static_cast<size_t>(g.weights) * g.lanes * sizeof(double);
  dispatch_floating(dw.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    wgrad_partials<T><<<grid, kWgradBlock, shared, stream>>>(cptr<T>(x), cptr<T>(dy), ptr<double>(partial), g,
                                                           with_bias);
    TANDEM_CUDA_CHECK_LAUNCH();
    wgrad_finish<T><<<grid_for(g.k * g.weights), kBlock, 0, stream>>>(
        cptr<double>(partial), ptr<T>(dw), with_bias ? ptr<T>(db) : nullptr, g);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem::gpu
