#pragma once
// Per-channel reductions over a contiguous [N, C, HW] tensor, split across many blocks.
//
// Note [split channel reductions]: one block per channel leaves most of the GPU idle when C is
// small (64 channels on 132 multiprocessors) and makes each block stream megabytes alone. So a
// channel's N images are cut into `splits` groups; block (c, s) reduces group s of channel c
// into partial[c * splits + s], and a second small kernel adds the partials of each channel in
// index order. The order of every addition depends only on the shapes: deterministic, no
// atomics (Note [deterministic reductions]). Elementwise passes over the same layout run one
// block row per (image, channel) plane, so the channel of an element is known per block
// instead of being divided out per element.
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace tandem::gpu {

constexpr int kSplitBlock = 256;  // threads of a partial-reduction block

struct ChannelSplit {
  int64_t n = 0, c = 0, hw = 0;
  int64_t splits = 1;  // groups of images per channel
  int64_t per = 0;     // images per group (the last may have fewer)
};

// About four blocks per multiprocessor in all, at least ~4K elements per block.
inline ChannelSplit channel_split(int64_t n, int64_t c, int64_t hw) {
  ChannelSplit g{n, c, hw, 1, n};
  if (n == 0 || c == 0) return g;
  const int64_t target_blocks = 4 * 132;
  const int64_t by_blocks = (target_blocks + c - 1) / c;
  const int64_t by_work = std::max<int64_t>(1, n * hw / 4096);
  g.splits = std::max<int64_t>(1, std::min({by_blocks, by_work, n}));
  g.per = (n + g.splits - 1) / g.splits;
  g.splits = (n + g.per - 1) / g.per;  // no empty group
  return g;
}

// Calls f(offset) for this thread's elements of channel c in image group s.
template <typename F>
__device__ __forceinline__ void for_channel_group(const ChannelSplit& g, int64_t c, int64_t s, F f) {
  const int64_t n0 = s * g.per;
  const int64_t n1 = n0 + g.per < g.n ? n0 + g.per : g.n;
  const int64_t count = (n1 - n0) * g.hw;
  const int64_t block = blockDim.x;
  const int64_t step_img = block / g.hw, step_pos = block - step_img * g.hw;
  int64_t img = n0 + threadIdx.x / g.hw, pos = threadIdx.x % g.hw;
  for (int64_t i = threadIdx.x; i < count; i += block) {
    f((img * g.c + c) * g.hw + pos);
    img += step_img;
    pos += step_pos;
    if (pos >= g.hw) {
      pos -= g.hw;
      ++img;
    }
  }
}

// Calls f(offset, channel) for every element, planes (image, channel) spread over blockIdx.y
// (grid-stride) and positions over blockIdx.x / threadIdx.x. Launch with plane_grid().
template <typename F>
__device__ __forceinline__ void for_planes(int64_t planes, int64_t channels, int64_t hw, F f) {
  for (int64_t p = blockIdx.y; p < planes; p += gridDim.y) {
    const int64_t c = p % channels;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < hw;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      f(p * hw + i, c);
    }
  }
}

inline dim3 plane_grid(int64_t planes, int64_t hw, int block = kBlock) {
  const int64_t x = std::min<int64_t>((hw + block - 1) / block, 64);
  const int64_t y = std::min<int64_t>(planes, 65535);
  return dim3(static_cast<unsigned>(std::max<int64_t>(x, 1)), static_cast<unsigned>(std::max<int64_t>(y, 1)));
}

// partial[c * splits + s] = sum of x over channel c, image group s (in double).
template <typename T>
__global__ void channel_sum_partials(const T* x, double* partial, ChannelSplit g) {
  const int64_t c = blockIdx.x, s = blockIdx.y;
  double acc = 0;
  for_channel_group(g, c, s, [&](int64_t off) { acc += static_cast<double>(x[off]); });
  acc = block_reduce(acc, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[c * g.splits + s] = acc;
}

// out[c] = sum of partial[c * splits .. + splits) in index order; one thread per channel.
template <typename T>
__global__ void channel_sum_finish(const double* partial, T* out, ChannelSplit g) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= g.c) return;
  double acc = 0;
  for (int64_t s = 0; s < g.splits; ++s) acc += partial[c * g.splits + s];
  out[c] = static_cast<T>(acc);
}

inline dim3 split_grid(const ChannelSplit& g) {
  return dim3(static_cast<unsigned>(g.c), static_cast<unsigned>(g.splits));
}

}  // namespace tandem::gpu
