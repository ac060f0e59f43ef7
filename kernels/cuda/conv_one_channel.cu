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
#include <algorithm>
#include <type_traits>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_one_channel.h"
#include "kernels/cuda/map.cuh"

namespace tandem::gpu {

namespace {

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

int tap_bound(int64_t r, int64_t s) {
  const int64_t m = std::max(r, s);
  return m <= 3 ? 3 : m <= 5 ? 5 : 7;
}

template <typename F>
void with_taps(int64_t r, int64_t s, F&& f) {
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

OneShape make_shape(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, bool last,
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

OneShape shape_of(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p, OneChannelPass pass) {
  const bool last = !y.is_contiguous();
  const int acc_bytes = x.dtype() == kFloat64 ? 8 : 4;
  return make_shape(x.shape(), w.shape(), y.shape(), p, last, acc_bytes,
                    pass == OneChannelPass::Forward ? kForwardBlocks : kWgradBlocks);
}

// Shared memory of a block, in accumulator elements: the tile, then the forward's filters
// [R * S][gb * cpt] or the weight gradient's sums [gb][(R * S + 1) * cpt].
int64_t shared_elems(const OneShape& g, OneChannelPass pass) {
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

// ---- forward ----------------------------------------------------------------------------------

template <typename T, typename TapsT, bool kLast>
__global__ void __launch_bounds__(kThreads, 2)
    one_channel_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                               T* __restrict__ y, OneShape g) {
  using A = opmath_t<T>;
  constexpr int RM = TapsT::rm, SM = TapsT::sm;
  constexpr bool kExact = TapsT::exact;
  constexpr int CPT = channels_per_thread(RM, SM, sizeof(A));
  extern __shared__ __align__(16) unsigned char one_channel_smem[];
  A* const tile = reinterpret_cast<A*>(one_channel_smem);
  A* const filt = tile + g.tile_elems;  // [R * S][gb * CPT]
  const Place pl = place_of<kLast>(g);
  const int r = kExact ? RM : g.r, s = kExact ? SM : g.s;
  const int rs = r * s, kb = g.gb * CPT;
  stage_tile(x + static_cast<int64_t>(pl.img) * g.h * g.w, tile, g, pl.row0, pl.row1);
  for (int i = threadIdx.x; i < rs * kb; i += kThreads) {
    const int kk = i / rs, tap = i - kk * rs;  // w read in its own order
    const int ko = pl.k_first + kk;
    filt[tap * kb + kk] = ko < g.k ? static_cast<A>(w[static_cast<int64_t>(ko) * rs + tap]) : A(0);
  }
  __syncthreads();
  if (pl.k0 >= g.k) return;  // a group past K (K is a multiple of CPT): no barrier follows
  A wr[RM][SM][CPT];
#pragma unroll
  for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
    for (int ss = 0; ss < SM; ++ss) {
      if (kExact || (rr < r && ss < s)) {
        load_channels(filt + (rr * s + ss) * kb + pl.group * CPT, wr[rr][ss]);
      } else {
#pragma unroll
        for (int c = 0; c < CPT; ++c) wr[rr][ss][c] = A(0);
      }
    }
  }
  A b[CPT];
#pragma unroll
  for (int c = 0; c < CPT; ++c) b[c] = bias != nullptr ? static_cast<A>(bias[pl.k0 + c]) : A(0);
  const int pq = g.p * g.q;
  for (int pix = pl.pix0 + pl.slot; pix < pl.pix1; pix += g.slots) {
    A acc[CPT];
#pragma unroll
    for (int c = 0; c < CPT; ++c) acc[c] = A(0);
    for_each_tap<RM, SM, kExact>(tile, g, pl, pix, r, s, [&](int rr, int ss, A v) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[c] = fma(wr[rr][ss][c], v, acc[c]);
    });
    if (bias != nullptr) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[c] += b[c];
    }
    if constexpr (kLast) {
      store_group<CPT>(y + (static_cast<int64_t>(pl.img) * pq + pix) * g.k + pl.k0, acc);
    } else {
      T* o = y + (static_cast<int64_t>(pl.img) * g.k + pl.k0) * pq + pix;
#pragma unroll
      for (int c = 0; c < CPT; ++c) o[static_cast<int64_t>(c) * pq] = round_to<T>(acc[c]);
    }
  }
}

// ---- weight gradient --------------------------------------------------------------------------

// Block (image, pixel chunk; channel groups): partial[blockIdx.x][k][o] for its channels k and
// every slot o: tap r * S + s, then the bias when with_bias.
template <typename T, typename TapsT, bool kLast>
__global__ void __launch_bounds__(kThreads, 2)
    one_channel_wgrad_kernel(const T* __restrict__ x, const T* __restrict__ dy, opmath_t<T>* __restrict__ partial,
                             OneShape g, bool with_bias) {
  using A = opmath_t<T>;
  constexpr int RM = TapsT::rm, SM = TapsT::sm;
  constexpr bool kExact = TapsT::exact;
  constexpr int CPT = channels_per_thread(RM, SM, sizeof(A));
  extern __shared__ __align__(16) unsigned char one_channel_smem[];
  A* const tile = reinterpret_cast<A*>(one_channel_smem);
  A* const red = tile + g.tile_elems;  // [gb][(R * S + 1) * CPT]: slot-major, then channel
  const Place pl = place_of<kLast>(g);
  const int r = kExact ? RM : g.r, s = kExact ? SM : g.s;
  const int rs = r * s;
  stage_tile(x + static_cast<int64_t>(pl.img) * g.h * g.w, tile, g, pl.row0, pl.row1);
  __syncthreads();
  A acc[RM][SM][CPT], bsum[CPT];
#pragma unroll
  for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
    for (int ss = 0; ss < SM; ++ss) {
#pragma unroll
      for (int c = 0; c < CPT; ++c) acc[rr][ss][c] = A(0);
    }
  }
#pragma unroll
  for (int c = 0; c < CPT; ++c) bsum[c] = A(0);
  // Pixels whose dy a thread loads before it multiplies the first: up to four, in
  // kAheadRegisters (a vector of CPT channels takes CPT * sizeof(T) / 4 registers channels-last;
  // CPT loads of one element take CPT registers or more NCHW); one for 7x7 filters, whose
  // unrolled taps spilled registers with more.
  constexpr int kPixelRegisters = kLast ? (CPT * static_cast<int>(sizeof(T)) + 3) / 4
                                        : CPT * ((static_cast<int>(sizeof(T)) + 3) / 4);
  constexpr int kUnroll = RM > 5 ? 1 : std::clamp(kAheadRegisters / kPixelRegisters, 1, 4);
  const int pq = g.p * g.q;
  const int step = g.slots;
  if (pl.k0 < g.k) {
    // dy of pixel pix, channels k0 .. k0 + CPT: one vector channels-last, CPT planes NCHW.
    const auto load = [&](int pix) {
      Vec<T, CPT> d;
      if constexpr (kLast) {
        d = *reinterpret_cast<const Vec<T, CPT>*>(dy + (static_cast<int64_t>(pl.img) * pq + pix) * g.k + pl.k0);
      } else {
        const T* src = dy + (static_cast<int64_t>(pl.img) * g.k + pl.k0) * pq + pix;
#pragma unroll
        for (int c = 0; c < CPT; ++c) d.v[c] = src[static_cast<int64_t>(c) * pq];
      }
      return d;
    };
    for (int base = pl.pix0 + pl.slot; base < pl.pix1; base += kUnroll * step) {
      Vec<T, CPT> raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * step < pl.pix1) raw[u] = load(base + u * step);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int pix = base + u * step;
        if (pix >= pl.pix1) break;
        A d[CPT];
        widen(raw[u], d);
        for_each_tap<RM, SM, kExact>(tile, g, pl, pix, r, s, [&](int rr, int ss, A v) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) acc[rr][ss][c] = fma(d[c], v, acc[rr][ss][c]);
        });
        if (with_bias) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) bsum[c] += d[c];
        }
      }
    }
  }
  // The threads of a group, in a fixed order: a shuffle tree over the lanes of a warp that hold
  // the group (channels-last lanes gb apart; NCHW the whole warp), then the warps in turn.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int mask = kLast ? g.gb : 1; mask < 32; mask *= 2) {
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
      for (int ss = 0; ss < SM; ++ss) {
        if (kExact || (rr < r && ss < s)) {
#pragma unroll
          for (int c = 0; c < CPT; ++c) acc[rr][ss][c] += __shfl_xor_sync(0xffffffffu, acc[rr][ss][c], mask);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < CPT; ++c) bsum[c] += __shfl_xor_sync(0xffffffffu, bsum[c], mask);
  }
  const int warps_per_group = kLast ? kThreads / 32 : g.slots / 32;
  const int turn = kLast ? warp : warp % warps_per_group;
  const bool holder = kLast ? lane < g.gb : lane == 0;
  const int per_group = (rs + 1) * CPT;
  A* const mine = red + pl.group * per_group;
  for (int t = 0; t < warps_per_group; ++t) {
    if (holder && turn == t) {
#pragma unroll
      for (int rr = 0; rr < RM; ++rr) {
#pragma unroll
        for (int ss = 0; ss < SM; ++ss) {
          if (kExact || (rr < r && ss < s)) {
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
              A& slot = mine[(rr * s + ss) * CPT + c];
              slot = t == 0 ? acc[rr][ss][c] : slot + acc[rr][ss][c];
            }
          }
        }
      }
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        A& slot = mine[rs * CPT + c];
        slot = t == 0 ? bsum[c] : slot + bsum[c];
      }
    }
    __syncthreads();
  }
  const int slots_out = rs + (with_bias ? 1 : 0);
  const int kb = g.gb * CPT;
  for (int i = threadIdx.x; i < kb * slots_out; i += kThreads) {
    const int kk = i / slots_out, o = i - kk * slots_out;
    const int ko = pl.k_first + kk;
    if (ko < g.k) {
      partial[(static_cast<int64_t>(blockIdx.x) * g.k + ko) * slots_out + o] =
          red[(kk / CPT) * per_group + o * CPT + kk % CPT];
    }
  }
}

// dw[k, o] (and db[k]) = the blocks' partial sums in double, rounded once to Out: a warp per
// output, lane i adding blocks i, i + 32, ..., then the lanes in a fixed tree.
template <typename A, typename Out>
__global__ void one_channel_wgrad_finish(const A* __restrict__ partial, Out* __restrict__ dw, Out* __restrict__ db,
                                         int k, int slots, int taps, int blocks) {
  const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (i >= k * slots) return;  // a whole warp leaves together
  double sum = 0;
  for (int j = lane; j < blocks; j += 32) {
    sum += static_cast<double>(partial[static_cast<int64_t>(j) * k * slots + i]);
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_down_sync(0xffffffffu, sum, d);
  if (lane != 0) return;
  const int ko = i / slots, o = i - ko * slots;
  if (o < taps) {
    dw[ko * taps + o] = static_cast<Out>(sum);
  } else {
    db[ko] = static_cast<Out>(sum);
  }
}

// Calls f(TapsT{}, std::bool_constant<channels-last>{}) for the kernel that takes g.
template <typename F>
void with_kernel(const OneShape& g, bool last, F&& f) {
  with_taps(g.r, g.s, [&](auto taps) {
    if (last) {
      f(taps, std::true_type{});
    } else {
      f(taps, std::false_type{});
    }
  });
}

}  // namespace

bool one_channel_conv_applies(OneChannelPass pass, const Tensor& x, const Tensor& w, const Tensor& y,
                              const Conv2dParams& p) {
  constexpr int64_t kMax32 = int64_t{1} << 31;
  if (!one_channel_conv()) return false;
  if (x.dim() != 4 || w.dim() != 4 || y.dim() != 4) return false;
  const DType dt = x.dtype();
  if (dt != kBFloat16 && dt != kFloat32 && dt != kFloat64) return false;
  const bool wide_dw = pass == OneChannelPass::BackwardWeight && dt == kBFloat16 && w.dtype() == kFloat32;
  if (y.dtype() != dt || (w.dtype() != dt && !wide_dw)) return false;
  if (x.size(1) != 1 || w.size(1) != 1 || w.size(2) > kMaxTaps || w.size(3) > kMaxTaps) return false;
  if (p.stride_h < 1 || p.stride_h > kMaxStride || p.stride_w < 1 || p.stride_w > kMaxStride) return false;
  // One channel: x and w address their elements alike in both formats; y in either.
  if (!x.is_contiguous() || !w.is_contiguous()) return false;
  if (!y.is_contiguous() && !y.is_contiguous(MemoryFormat::ChannelsLast)) return false;
  if (x.numel() >= kMax32 || y.numel() >= kMax32) return false;
  const OneShape g = shape_of(x, w, y, p, pass);
  if (g.k % g.cpt != 0) return false;
  const size_t elem = dtype_size(dt);
  if (!y.is_contiguous() && reinterpret_cast<uintptr_t>(y.raw_data()) % (g.cpt * elem) != 0) return false;
  const int64_t acc = dt == kFloat64 ? 8 : 4;
  return shared_elems(g, pass) * acc <= kMaxSharedBytes;
}

void one_channel_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                              const Tensor& y, cudaStream_t stream) {
  const OneShape g = shape_of(x, w, y, p, OneChannelPass::Forward);
  const bool last = !y.is_contiguous();
  dispatch_floating_bf16(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = opmath_t<T>;
    const size_t shared = static_cast<size_t>(shared_elems(g, OneChannelPass::Forward)) * sizeof(A);
    const dim3 grid(static_cast<unsigned>(int64_t{g.n} * g.chunks), static_cast<unsigned>(g.group_blocks));
    with_kernel(g, last, [&](auto taps, auto cl) {
      using TapsT = decltype(taps);
      TANDEM_CHECK(g.cpt == channels_per_thread(TapsT::rm, TapsT::sm, sizeof(A)), Value,
                   "one_channel_conv_forward: channels per thread disagree");
      one_channel_forward_kernel<T, TapsT, decltype(cl)::value><<<grid, kThreads, shared, stream>>>(
          cptr<T>(x), cptr<T>(w), bias.defined() ? cptr<T>(bias) : nullptr, ptr<T>(y), g);
    });
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void one_channel_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                                      const Tensor& db, cudaStream_t stream) {
  const bool with_bias = db.defined();
  TANDEM_CHECK(!with_bias || db.dtype() == dw.dtype(), DType, "one_channel_conv_backward_weight: db is ",
               dtype_name(db.dtype()), ", dw ", dtype_name(dw.dtype()));
  const OneShape g = shape_of(x, dw, dy, p, OneChannelPass::BackwardWeight);
  const bool last = !dy.is_contiguous();
  const int taps = g.r * g.s, slots = taps + (with_bias ? 1 : 0);
  const int64_t blocks = int64_t{g.n} * g.chunks;
  dispatch_floating_bf16(x.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = opmath_t<T>;
    Tensor partial = empty({blocks * g.k * slots}, dtype_of<A>::value, dw.device());
    const size_t shared = static_cast<size_t>(shared_elems(g, OneChannelPass::BackwardWeight)) * sizeof(A);
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(g.group_blocks));
    with_kernel(g, last, [&](auto taps_t, auto cl) {
      using TapsT = decltype(taps_t);
      TANDEM_CHECK(g.cpt == channels_per_thread(TapsT::rm, TapsT::sm, sizeof(A)), Value,
                   "one_channel_conv_backward_weight: channels per thread disagree");
      one_channel_wgrad_kernel<T, TapsT, decltype(cl)::value><<<grid, kThreads, shared, stream>>>(
          cptr<T>(x), cptr<T>(dy), ptr<A>(partial), g, with_bias);
    });
    TANDEM_CUDA_CHECK_LAUNCH();
    constexpr int kFinishWarps = 8;
    const unsigned finish_blocks = static_cast<unsigned>(ceil_div(int64_t{g.k} * slots, kFinishWarps));
    const auto finish = [&](auto out_tag) {
      using Out = typename decltype(out_tag)::type;
      one_channel_wgrad_finish<A, Out><<<finish_blocks, kFinishWarps * 32, 0, stream>>>(
          cptr<A>(partial), ptr<Out>(dw), with_bias ? ptr<Out>(db) : nullptr, g.k, slots, taps,
          static_cast<int>(blocks));
      TANDEM_CUDA_CHECK_LAUNCH();
    };
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (dw.dtype() == kFloat32) {
        finish(TypeTag<float>{});
        return;
      }
    }
    finish(TypeTag<T>{});
  });
}

}  // namespace tandem::gpu
