#pragma once
// tandem's own kernels for convolutions of one input channel: the forward and the weight
// gradient of a first layer on grey images, in bfloat16, float32 or float64, writing or reading
// the output in either memory format; deterministic, accumulating in float32 (float64 for
// float64), never TF32.
//
// Note [one-input-channel convolution]: ResNet-18's stem on Fashion-MNIST is Conv2d(1, 64, 3,
// padding 1) on 28x28 images; at batch 256 under bfloat16 autocast with channels-last
// activations its output is [256, 64, 28, 28], 25.7 MB, against an input of 0.4 MB and 116 M
// multiply-adds (about 3.5 us of an H200's float32 FMA). In a replayed training step on one
// H200 (2026-12-06) cuDNN took
//   forward:         a 3.2 MB memset 1.7 us, nchwToNhwcKernel 9.6 us (the input's one channel
//                    padded to eight), another 1.6 us (the filter), the implicit GEMM (cutlass
//                    bf16 s16816fprop) 30.4 us: about 43 us;
//   weight gradient: memset 3.2 MB, nchwToNhwc 10.1 us, memset 2.2 MB, an implicit-GEMM wgrad
//                    22.3 us, a split-K reduction 10.9 us, nhwcToNchw 1.7 us: about 50 us;
// where one pass over the output's 25.7 MB is 6-8 us. Its engines are made for many input
// channels; with one, the reduction of an output is R * S terms. So tandem computes both passes
// itself, each one pass over the large tensor:
//
// - Forward, y[n, k, p, q] = sum over r, s of x[n, 0, p * sh + r - ph, q * sw + s - pw] *
//   w[k, 0, r, s] (+ bias[k], added to the sum and rounded once with it). A thread computes CPT
//   output channels (channels_per_thread: 8 for a 3x3 filter, fewer for larger ones) of one
//   output pixel at a time, and always the same channels: their R * S * CPT weights live in its
//   registers for the whole block. A block of 256 threads holds `gb` channel groups (a group:
//   CPT channels) times `slots` pixels; it stages the input rows under its range of output
//   pixels, zero-padded and widened to the accumulator type, in shared memory, so a tap is one
//   shared load (a broadcast among the gb threads of a pixel) and CPT FMAs. Channels-last, the
//   gb threads of a pixel are neighbouring lanes: a warp writes whole pixels' channels, 16-byte
//   vectors of eight bfloat16 (K = 64: four pixels, 512 contiguous bytes per store). NCHW, a
//   warp is 32 neighbouring pixels of one group and writes 32 neighbouring values of each
//   channel plane.
// - Weight gradient, dw[k, 0, r, s] = sum over n, p, q of dy[n, k, p, q] * x[n, 0, p * sh + r -
//   ph, q * sw + s - pw], and the bias gradient (the sum of dy) when asked: the same blocks,
//   staging and thread layout, with the R * S * CPT sums in registers instead of the weights; a
//   thread loads its pixels' CPT values of dy (one 16-byte vector channels-last) a few pixels
//   ahead. The block's threads of a group are then added in a fixed order -- a shuffle tree
//   within each warp, then the warps one after the other through shared memory -- into one
//   partial sum per block, and a second kernel adds the blocks' partial sums in order, in
//   double, a warp per weight, rounding once to dw's dtype: bfloat16, or float32 for the float32
//   .grad of an autocast weight (conv2d_backward_weight's dw_into), which it then writes without
//   a bfloat16 copy and a cast.
//
// For the stem at batch 256, bfloat16 channels-last: the forward is 1024 blocks (an image in
// four chunks of seven rounds of 32 pixels x 8 groups), the weight gradient 256 blocks (an image
// each) and a finish of 72 blocks; each reads or writes the 25.7 MB once, and does the 116 M
// FMAs at about 100 instructions per thread and pixel. bench_conv_small --layer stem times both
// against cuDNN's, with the weight gradient into a bfloat16 dw and cast, as cuDNN's path
// does, and into the float32 .grad directly.
//
// Every output is a sum in a fixed order, set by the shapes alone (the number of blocks is not
// the GPU's): the same bits on every run and under graph capture (Note [deterministic
// reductions]). No allocation but the partial sums (empty(), stream-ordered), no host
// synchronization. Unlike cuDNN's bfloat16 path (the sum rounded, then the bias added in
// bfloat16), the forward rounds once, as the CPU does (Note [bfloat16 on the CPU] in
// kernels/cpu/conv.cpp), so a layer whose batch norm adds its bias (Note [conv bias in batch
// norm]) differs from the unfused one by a rounding; and the bias gradient is summed here, not
// in conv2d_backward_bias's order, as with the direct kernels (Note [direct convolution]).
//
// conv.cu asks these kernels after the direct and row kernels (LeNet's packed NCHW float32
// layers stay theirs) and before cuDNN; one_channel_conv() off (TANDEM_ONE_CHANNEL_CONV=0) sends
// these layers back to cuDNN.
//
// This header holds what the two passes share: the shape of a pass and its launch, the filter's
// tap bounds, the staging of the input in shared memory, the output's placement and the walk
// over the taps. The forward is in conv_one_channel.cu, the weight gradient in
// conv_one_channel_wgrad.cu.
#include <algorithm>
#include <type_traits>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_one_channel.h"
#include "kernels/cuda/map.cuh"

namespace tandem::gpu::one_channel {

constexpr int kThreads = 256;          // per block, both passes
constexpr int64_t kMaxTaps = 7;        // R, S
constexpr int64_t kMaxStride = 2;
constexpr int kWeightRegisters = 80;   // 32-bit registers a thread gives its weights or sums
constexpr int64_t kForwardBlocks = 1024;  // about: several per multiprocessor, each ~7 rounds
constexpr int64_t kWgradBlocks = 256;     // about: fewer partial sums to add (ResNet's stem: a block per image)
constexpr int kAheadRegisters = 16;    // 32-bit registers a weight-gradient thread gives the dy it loads ahead
constexpr int64_t kMaxSharedBytes = 48 * 1024;

// Output channels per thread for filters up to rm x sm taps and an accumulator of acc_bytes:
// eight, unless its weights (sums) would take more than kWeightRegisters registers.
constexpr int channels_per_thread(int rm, int sm, int acc_bytes) {
  int c = 8;
  while (c > 1 && c * rm * sm * (acc_bytes / 4) > kWeightRegisters) c /= 2;
  return c;
}

// The tap bounds a kernel is compiled for: 3x3 exactly (no guard in the loops), or the
// smallest of 3x3, 5x5 and 7x7 that holds R x S, the taps past R or S skipped by a guard.
template <int RM, int SM, bool Exact>
struct Taps {
  static constexpr int rm = RM, sm = SM;
  static constexpr bool exact = Exact;
};

inline int tap_bound(int64_t r, int64_t s) {
  const int64_t m = std::max(r, s);
  return m <= 3 ? 3 : m <= 5 ? 5 : 7;
}

template <typename F>
inline void with_taps(int64_t r, int64_t s, F&& f) {
  if (r == 3 && s == 3) return f(Taps<3, 3, true>{});
  switch (tap_bound(r, s)) {
    case 3: return f(Taps<3, 3, false>{});
    case 5: return f(Taps<5, 5, false>{});
    default: return f(Taps<7, 7, false>{});
  }
}

// The sizes of a pass (32-bit: the predicate keeps x and y below 2^31 elements) and its launch.
struct OneShape {
  int n, h, w;         // x [N, 1, H, W]
  int k, p, q;         // y [N, K, P, Q]
  int r, s;            // taps
  int sh, sw, ph, pw;  // stride and zero padding
  int cpt;             // output channels per thread (channels_per_thread)
  int gb;              // channel groups of cpt channels per block (a power of two)
  int slots;           // output pixels a block computes at once: kThreads / gb
  int group_blocks;    // blocks across the channel groups (grid.y)
  int chunk, chunks;   // output pixels per block (a multiple of slots; an image's last block may
                       // have fewer) and blocks per image (grid.x = N * chunks)
  int tile_rows, tile_cols, pitch;  // the staged input: at most tile_rows rows of tile_cols, pitch apart
  int tile_elems;      // tile_rows * pitch rounded up to 16 bytes of double
};

inline OneShape make_shape(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, bool last,
                    int acc_bytes, int64_t target_blocks) {
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  OneShape g{};
  g.n = i32(xs[0]), g.h = i32(xs[2]), g.w = i32(xs[3]);
  g.k = i32(ws[0]), g.p = i32(ys[2]), g.q = i32(ys[3]);
  g.r = i32(ws[2]), g.s = i32(ws[3]);
  g.sh = i32(p.stride_h), g.sw = i32(p.stride_w), g.ph = i32(p.pad_h), g.pw = i32(p.pad_w);
  const int bound = tap_bound(ws[2], ws[3]);
  g.cpt = channels_per_thread(bound, bound, acc_bytes);
  const int64_t groups = std::max<int64_t>(1, ws[0] / g.cpt);
  // Channels-last, the gb threads of a pixel are neighbouring lanes (at most a warp); NCHW, a
  // warp is one group's pixels, so a block has at most 8 groups of 32 or more pixels.
  const int64_t cap = std::min<int64_t>(groups, last ? 32 : 8);
  g.gb = 1;
  while (g.gb * 2 <= cap) g.gb *= 2;
  g.slots = kThreads / g.gb;
  g.group_blocks = i32(ceil_div(groups, g.gb));
  const int64_t pq = ys[2] * ys[3];
  const int64_t rounds = ceil_div(pq, g.slots);
  const int64_t want = std::clamp<int64_t>(ceil_div(target_blocks, ys[0] * g.group_blocks), 1, rounds);
  g.chunk = i32(ceil_div(rounds, want) * g.slots);
  g.chunks = i32(ceil_div(pq, g.chunk));
  // chunk consecutive pixels span at most this many output rows.
  const int64_t rows = std::min<int64_t>(ys[2], (g.chunk + ys[3] - 2) / ys[3] + 1);
  g.tile_rows = i32((rows - 1) * p.stride_h + ws[2]);
  g.tile_cols = i32((ys[3] - 1) * p.stride_w + ws[3]);
  g.pitch = g.tile_cols | 1;  // odd: the same column of neighbouring rows in different banks
  g.tile_elems = i32(ceil_div(int64_t{g.tile_rows} * g.pitch, 4) * 4);
  return g;
}

inline OneShape shape_of(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p, OneChannelPass pass) {
  const bool last = !y.is_contiguous();
  const int acc_bytes = x.dtype() == kFloat64 ? 8 : 4;
  return make_shape(x.shape(), w.shape(), y.shape(), p, last, acc_bytes,
                    pass == OneChannelPass::Forward ? kForwardBlocks : kWgradBlocks);
}

// Shared memory of a block, in accumulator elements: the tile, then the forward's filters
// [R * S][gb * cpt] or the weight gradient's sums [gb][(R * S + 1) * cpt].
inline int64_t shared_elems(const OneShape& g, OneChannelPass pass) {
  const int64_t per_group = pass == OneChannelPass::Forward ? int64_t{g.r} * g.s : int64_t{g.r} * g.s + 1;
  return g.tile_elems + per_group * g.gb * g.cpt;
}

// ---- device helpers ---------------------------------------------------------------------------

// One rounding to T (bfloat16: the hardware's round-to-nearest-even, the rounding of BFloat16's
// constructor).
template <typename T>
__device__ __forceinline__ T round_to(opmath_t<T> v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ BFloat16 round_to<BFloat16>(float v) {
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  return BFloat16::from_bits(b);
}
// lo in the low half, hi in the high half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Stores CPT consecutive channels of one pixel (channels-last), rounded once: a vector store
// (16 bytes: eight bfloat16, four float32, two float64) at an address aligned to it.
template <int CPT>
__device__ __forceinline__ void store_group(BFloat16* dst, const float (&v)[CPT]) {
  if constexpr (CPT == 1) {
    dst[0] = round_to<BFloat16>(v[0]);
  } else {
    uint32_t u[CPT / 2];
#pragma unroll
    for (int i = 0; i < CPT / 2; ++i) u[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
    if constexpr (CPT == 8) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(u[0], u[1], u[2], u[3]);
    } else if constexpr (CPT == 4) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(u[0], u[1]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = u[0];
    }
  }
}
template <int CPT>
__device__ __forceinline__ void store_group(float* dst, const float (&v)[CPT]) {
  if constexpr (CPT >= 4) {
#pragma unroll
    for (int i = 0; i < CPT / 4; ++i)
      reinterpret_cast<float4*>(dst)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else if constexpr (CPT == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
  } else {
    dst[0] = v[0];
  }
}
template <int CPT>
__device__ __forceinline__ void store_group(double* dst, const double (&v)[CPT]) {
  if constexpr (CPT >= 2) {
#pragma unroll
    for (int i = 0; i < CPT / 2; ++i) reinterpret_cast<double2*>(dst)[i] = make_double2(v[2 * i], v[2 * i + 1]);
  } else {
    dst[0] = v[0];
  }
}

// CPT consecutive values from shared memory, in 16-byte loads where CPT fills them (src is a
// multiple of CPT elements from a 16-byte aligned base).
template <int CPT, typename A>
__device__ __forceinline__ void load_channels(const A* src, A (&v)[CPT]) {
  if constexpr (std::is_same_v<A, float> && CPT % 4 == 0) {
#pragma unroll
    for (int i = 0; i < CPT / 4; ++i) {
      const float4 f = reinterpret_cast<const float4*>(src)[i];
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
  } else if constexpr (std::is_same_v<A, double> && CPT % 2 == 0) {
#pragma unroll
    for (int i = 0; i < CPT / 2; ++i) {
      const double2 d = reinterpret_cast<const double2*>(src)[i];
      v[2 * i] = d.x, v[2 * i + 1] = d.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < CPT; ++c) v[c] = src[c];
  }
}

// CPT values widened to the accumulator type.
template <int CPT, typename T>
__device__ __forceinline__ void widen(const Vec<T, CPT>& raw, opmath_t<T> (&v)[CPT]) {
#pragma unroll
  for (int c = 0; c < CPT; ++c) v[c] = static_cast<opmath_t<T>>(raw.v[c]);
}

// Copies the padded input rows under output rows row0 .. row1 of image x [H, W] into the tile,
// widened to the accumulator type, zeros where the window reaches past the image.
template <typename T>
__device__ void stage_tile(const T* __restrict__ x, opmath_t<T>* __restrict__ tile, const OneShape& g, int row0,
                           int row1) {
  using A = opmath_t<T>;
  const int rows = (row1 - row0) * g.sh + g.r, cols = g.tile_cols;
  for (int i = threadIdx.x; i < rows * cols; i += kThreads) {
    const int tr = i / cols, tc = i - tr * cols;
    const int hh = row0 * g.sh + tr - g.ph, ww = tc - g.pw;
    tile[tr * g.pitch + tc] = hh >= 0 && hh < g.h && ww >= 0 && ww < g.w ? static_cast<A>(x[hh * g.w + ww]) : A(0);
  }
}

// A block's place: image, output pixels [pix0, pix1), the first channel of its groups; and a
// thread's: its group (CPT channels from k0) and its pixel slot. Channels-last the gb groups of
// a pixel are neighbouring threads; NCHW a group's slots are.
struct Place {
  int img, pix0, pix1, row0, row1, k_first, group, slot, k0;
};

template <bool kLast>
__device__ __forceinline__ Place place_of(const OneShape& g) {
  Place pl;
  pl.img = blockIdx.x / g.chunks;
  const int chunk = blockIdx.x - pl.img * g.chunks;
  pl.pix0 = chunk * g.chunk;
  pl.pix1 = min(g.p * g.q, pl.pix0 + g.chunk);
  pl.row0 = pl.pix0 / g.q;
  pl.row1 = (pl.pix1 - 1) / g.q;
  pl.k_first = blockIdx.y * g.gb * g.cpt;
  pl.group = kLast ? threadIdx.x % g.gb : threadIdx.x / g.slots;
  pl.slot = kLast ? threadIdx.x / g.gb : threadIdx.x % g.slots;
  pl.k0 = pl.k_first + pl.group * g.cpt;
  return pl;
}

// f(rr, ss, v) for each tap (rr, ss) of the filter -- all RM x SM when the filter fills them,
// else those within r x s -- with v the staged input under that tap for output pixel pix.
template <int RM, int SM, bool kExact, typename A, typename F>
__device__ __forceinline__ void for_each_tap(const A* tile, const OneShape& g, const Place& pl, int pix, int r, int s,
                                             F&& f) {
  const int pr = pix / g.q, qc = pix - pr * g.q;
  const A* in = tile + (pr - pl.row0) * g.sh * g.pitch + qc * g.sw;
#pragma unroll
  for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
    for (int ss = 0; ss < SM; ++ss) {
      if (kExact || (rr < r && ss < s)) f(rr, ss, in[rr * g.pitch + ss]);
    }
  }
}

// Calls f(TapsT{}, std::bool_constant<channels-last>{}) for the kernel that takes g.
template <typename F>
inline void with_kernel(const OneShape& g, bool last, F&& f) {
  with_taps(g.r, g.s, [&](auto taps) {
    if (last) {
      f(taps, std::true_type{});
    } else {
      f(taps, std::false_type{});
    }
  });
}

}  // namespace tandem::gpu::one_channel
