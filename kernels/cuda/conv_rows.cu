// tandem's row-window kernels for small convolutions, deterministic, in the plain FMA of the
// element type (float32 or float64; never TF32).
//
// Note [row convolution]: LeNet's second layer (6 -> 16 channels, 5x5, 14x14 -> 10x10) does 61 M
// multiply-adds per pass at batch 256, a few microseconds of an H200's arithmetic, yet in a
// replayed LeNet step cuDNN took 16 us for its forward and 21-59 us for its input gradient
// (timed and heuristic engines), and the per-tap direct kernels of conv_direct.cu 19 us for
// each weight gradient. Both kinds of kernel stage their data and then do a few multiply-adds
// per value loaded from shared memory. These kernels keep a window of one input row in
// registers instead, so that every value loaded serves S taps:
//
// - Forward and input gradient, one kernel: out[n, o, p, q] = sum over i, r, s of
//   in[n, i, p + r - ph, q + s - pw] * tap(o, i, r, s). A forward is in = x, tap = w[o, i, r, s];
//   an input gradient is the same correlation of in = dy, padded by R - 1 - pad, with the
//   flipped, transposed filter, tap(o, i, r, s) = w[i, o, R - 1 - r, S - 1 - s] (o an input
//   channel of the convolution, i an output channel). A thread owns QC neighbouring outputs of
//   one row for OT output channels; for each input channel and filter row it loads the
//   QC + S - 1 input values under them into registers, then per tap s one vector of OT weights
//   (the same address for the whole warp: a broadcast) and does QC * OT FMAs: for LeNet's
//   layers 16-17 loads per 100-140 FMAs, where a per-tap kernel does 2 or 3 per 16. A block is
//   G images and one group of OT output channels; its images' rows are copied into shared
//   memory (padded in width, not in height: a row above or below the image is skipped) with
//   asynchronous copies, so the whole tile is in flight at once rather than a load at a time.
// - Weight gradient: dw[k, c, r, s] = sum over n, p, q of dy[n, k, p, q] * x[n, c, p + r - ph,
//   q + s - pw]. A thread owns one filter row (c, r) for KT output channels, S * KT sums, and
//   walks a row segment of one image: per output column one new input value enters the
//   window and KT values of dy are loaded (two 16-byte loads in float32, the same for every
//   thread of a row segment), for S * KT FMAs. The threads of a block split the rows of its
//   images; their sums are added in a fixed tree through shared memory, and a second kernel
//   adds the blocks' partial sums in order, in double. The bias gradient (the sum of dy) is one
//   warp of the block that adds the staged dy while the others multiply.
//
// Measured on one H200 (2026-12-03, bench/bench_conv_small: us per call inside a replayed
// graph, batch 256, float32; cuDNN heuristics | timed engines | direct kernels | row kernels):
//
//   conv1 1->6 28x28   forward         27.9 |  27.9 |  6.6 |  7.7
//                      input gradient 103.1 |  23.5 |   -  | 11.6
//                      weight grad.   410.1 |  25.7 | 19.9 | 18.3
//   conv2 6->16 14x14  forward         17.3 |  17.3 |   -  | 22.6
//                      input gradient  58.9 |  31.0 |   -  | 23.3
//                      weight grad.    33.4 |  33.5 | 22.8 | 26.4
//
// So by default (row_conv_passes() "dw", kernels/backend.h) the row kernels take the input
// gradient, and the weight gradient of the layers the direct kernel does not take; the
// forward stays with the direct kernel (first layers) and cuDNN. The kernels are far from the
// arithmetic (61 M FMAs are ~2 us). Nsight Compute on conv2's weight gradient: 10.5 M warp
// instructions issued for 1.9 M warp FMAs (staging, index arithmetic and the tree cost more
// than the products), 6.4 cycles per issue with 11 warps per SM, and half of the 365 k global
// sectors excess (partial-sector accesses). More work per thread between barriers and copies
// wider than one element are the next step.
//
// Every output is a sum in a fixed order: the same bits on every run (Note [deterministic
// reductions]), on a CUDA graph replay as eagerly. Layers outside these limits go to the
// kernels of conv_direct.cu or to cuDNN (conv.cu decides); direct_conv() off
// (TANDEM_DIRECT_CONV=0) sends every layer to cuDNN.
#include <algorithm>
#include <string>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_direct.h"
#include "kernels/cuda/conv_rows.h"

namespace tandem::gpu {

namespace {

constexpr int kMaxRowThreads = 256;     // threads of a forward / input-gradient block
constexpr int kMaxWgradTapThreads = 384;  // tap threads of a weight-gradient block
constexpr int kWgradKTile = 8;          // output channels per weight-gradient thread (KT)
constexpr int64_t kMaxRowTaps = 512;    // input channels * R * S of one output
constexpr int64_t kMaxRowFilterRows = 7;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
constexpr int kColumnTiles[] = {8, 7, 5, 4};  // the QC instantiated, preferred first on ties

// ---- device helpers ---------------------------------------------------------------------

// An asynchronous copy of one element from global to shared memory (cp.async, sm_80 on); the
// block waits for all of its copies with copy_wait_all() before a barrier.
template <typename T>
__device__ __forceinline__ void copy_async(T* dst_shared, const T* src_global) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src_global), "n"(sizeof(T)));
}
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// N consecutive elements of shared memory into registers, in 16-byte (or 8-byte) loads; the
// address is a multiple of N elements from a 16-byte aligned base.
template <int N, typename T>
__device__ __forceinline__ void load_vec(const T* src, T (&v)[N]) {
  if constexpr (std::is_same_v<T, float> && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 a = reinterpret_cast<const float4*>(src)[i / 4];
      v[i] = a.x, v[i + 1] = a.y, v[i + 2] = a.z, v[i + 3] = a.w;
    }
  } else if constexpr (std::is_same_v<T, float> && N == 2) {
    const float2 a = reinterpret_cast<const float2*>(src)[0];
    v[0] = a.x, v[1] = a.y;
  } else if constexpr (std::is_same_v<T, double> && N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const double2 a = reinterpret_cast<const double2*>(src)[i / 2];
      v[i] = a.x, v[i + 1] = a.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = src[i];
  }
}

int round4(int64_t v) { return static_cast<int>(ceil_div(v, 4) * 4); }

// ---- forward and input gradient ---------------------------------------------------------

// One row-window pass in 32-bit ints (row_conv_applies keeps tensors below 2^31 elements).
struct RowShape {
  int n;           // images
  int ci, hi, wi;  // input channels and size (x for a forward, dy for an input gradient)
  int co, ho, wo;  // output channels and size
  int r;           // filter rows (S is a template argument)
  int ph, pw;      // zero padding of the input
  int flip;        // 1: an input gradient, tap(o, i, r, s) = w[i, o, R - 1 - r, S - 1 - s]
  int chunks;      // column segments (of QC) per output row
  int units;       // threads per image: ho * chunks
  int g;           // images per block
  int pitch;       // shared row pitch: chunks * QC + S - 1, odd (neighbouring rows, other banks)
  int tile;        // shared elements of the rows: g * ci * hi * pitch, rounded up to 4
  int nu;          // threads of one channel slice: g * units, rounded up to a warp
  int splits;      // slices of the input channels (a block has splits * nu threads)
  int per_split;   // input channels per slice
};

struct RowLaunch {
  RowShape g{};
  int s = 0, qc = 0, ot = 0;
  dim3 grid, block;
  size_t shared = 0;  // bytes
  bool ok = false;
};

// Copies the block's rows of `in` (g images from n0, every channel, every row) into the tile,
// zero-padded by pw on the left and to the pitch on the right; rows of images past the batch
// are zeros. A warp per row: the rows of consecutive images are consecutive in memory.
template <typename T>
__device__ void stage_rows(const T* __restrict__ in, T* __restrict__ tile, const RowShape& g, int n0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int rows = g.g * g.ci * g.hi;
  const int64_t first = static_cast<int64_t>(n0) * g.ci * g.hi;
  const int64_t last = static_cast<int64_t>(g.n) * g.ci * g.hi;
  for (int fr = warp; fr < rows; fr += warps) {
    const bool inside = first + fr < last;
    const T* src = in + (first + fr) * g.wi;
    T* dst = tile + fr * g.pitch;
    for (int col = lane; col < g.pitch; col += 32) {
      const int ww = col - g.pw;
      if (inside && ww >= 0 && ww < g.wi) {
        copy_async(dst + col, src + ww);
      } else {
        dst[col] = T(0);
      }
    }
  }
}

// Block (images n0 .. n0 + g, output channels o0 .. o0 + OT). Thread t is in channel slice
// t / nu and unit u = t % nu: image u / units, row (u % units) / chunks, columns from
// QC * (u % chunks). The slices' sums are added in order through shared memory, and the block's
// outputs leave through shared memory too, so that a warp writes consecutive addresses. See
// Note [row convolution].
template <typename T, int S, int QC, int OT>
__global__ void __launch_bounds__(kMaxRowThreads)
    row_conv_kernel(const T* __restrict__ in, const T* __restrict__ w, const T* __restrict__ bias,
                    T* __restrict__ out, RowShape g) {
  constexpr int kSums = QC * OT;
  extern __shared__ __align__(16) unsigned char row_smem[];
  T* tile = reinterpret_cast<T*>(row_smem);
  T* wsm = tile + g.tile;  // [ci][r][S][OT]
  const int n0 = blockIdx.x * g.g;
  const int o0 = blockIdx.y * OT;
  stage_rows(in, tile, g, n0);
  const int rs = g.r * S;
  for (int i = threadIdx.x; i < g.ci * rs * OT; i += blockDim.x) {
    const int ot = i % OT, tap = i / OT;
    const int ci = tap / rs, rem = tap - ci * rs;
    const int rr = rem / S, ss = rem - rr * S;
    const int o = o0 + ot;
    if (o < g.co) {
      copy_async(wsm + i, g.flip ? w + ((ci * g.co + o) * g.r + (g.r - 1 - rr)) * S + (S - 1 - ss)
                                 : w + ((o * g.ci + ci) * g.r + rr) * S + ss);
    } else {
      wsm[i] = T(0);
    }
  }
  copy_wait_all();
  __syncthreads();
  const int sp = threadIdx.x / g.nu, u = threadIdx.x - sp * g.nu;
  const int b = u / g.units, rem = u - b * g.units;
  const int p = rem / g.chunks, q0 = (rem - p * g.chunks) * QC;
  const bool valid = b < g.g && n0 + b < g.n;
  T acc[QC][OT] = {};
  const int c_end = valid ? min(g.ci, (sp + 1) * g.per_split) : 0;
  for (int ci = sp * g.per_split; ci < c_end; ++ci) {
    const T* plane = tile + (b * g.ci + ci) * g.hi * g.pitch + q0;
    const T* wc = wsm + ci * rs * OT;
    for (int rr = 0; rr < g.r; ++rr) {
      const int hh = p + rr - g.ph;
      if (hh < 0 || hh >= g.hi) continue;  // a zero row of the padding
      const T* row = plane + hh * g.pitch;
      T xv[QC + S - 1];
#pragma unroll
      for (int j = 0; j < QC + S - 1; ++j) xv[j] = row[j];
#pragma unroll
      for (int ss = 0; ss < S; ++ss) {
        T wv[OT];
        load_vec<OT>(wc + (rr * S + ss) * OT, wv);
#pragma unroll
        for (int q = 0; q < QC; ++q) {
#pragma unroll
          for (int ot = 0; ot < OT; ++ot) acc[q][ot] = fma(xv[q + ss], wv[ot], acc[q][ot]);
        }
      }
    }
  }
  // The tile is read no more: its memory holds the slices' sums [splits - 1][kSums][nu], then
  // the block's outputs [g][OT][ho * wo].
  __syncthreads();
  T* red = tile;
  T* otile = red + (g.splits - 1) * kSums * g.nu;
  if (sp > 0) {
#pragma unroll
    for (int q = 0; q < QC; ++q) {
#pragma unroll
      for (int ot = 0; ot < OT; ++ot) red[((sp - 1) * kSums + q * OT + ot) * g.nu + u] = acc[q][ot];
    }
  }
  __syncthreads();
  const int plane = g.ho * g.wo;
  if (sp == 0 && valid) {
    for (int k = 1; k < g.splits; ++k) {
#pragma unroll
      for (int q = 0; q < QC; ++q) {
#pragma unroll
        for (int ot = 0; ot < OT; ++ot) acc[q][ot] += red[((k - 1) * kSums + q * OT + ot) * g.nu + u];
      }
    }
#pragma unroll
    for (int ot = 0; ot < OT; ++ot) {
      T* orow = otile + (b * OT + ot) * plane + p * g.wo + q0;
#pragma unroll
      for (int q = 0; q < QC; ++q) {
        if (q0 + q < g.wo) orow[q] = acc[q][ot];
      }
    }
  }
  __syncthreads();
  // Plane by plane (image, channel), each a run of consecutive addresses.
  const int images = min(g.g, g.n - n0);
  for (int bo = 0; bo < images * OT; ++bo) {
    const int bb = bo / OT, o = o0 + bo % OT;
    if (o >= g.co) continue;
    const T bv = bias != nullptr ? bias[o] : T(0);
    const T* src = otile + bo * plane;
    T* dst = out + (static_cast<int64_t>(n0 + bb) * g.co + o) * plane;
    for (int pos = threadIdx.x; pos < plane; pos += blockDim.x) dst[pos] = bias != nullptr ? src[pos] + bv : src[pos];
  }
}

// The launch of an output [n, co, ho, wo] from an input [n, ci, hi, wi], filter rows r and
// width s, padding ph, pw: QC the tile of least waste, OT 4 (2 where co is not a multiple of
// 4), and G images per block, the most threads busy among G that leave about two blocks per
// multiprocessor. ok false where the kernels cannot take it.
RowLaunch row_launch(int64_t n, int64_t ci, int64_t hi, int64_t wi, int64_t co, int64_t ho, int64_t wo, int64_t r,
                     int64_t s, int64_t ph, int64_t pw, bool flip, int64_t elem) {
  RowLaunch l{};
  if (s != 3 && s != 5) return l;
  if (r > kMaxRowFilterRows || ci * r * s > kMaxRowTaps) return l;
  int qc = 0;
  int64_t best = -1;
  for (int c : kColumnTiles) {
    const int64_t waste = ceil_div(wo, c) * c - wo;
    if (best < 0 || waste < best) best = waste, qc = c;
  }
  const int64_t chunks = ceil_div(wo, qc), units = ho * chunks;
  if (units > kMaxRowThreads) return l;
  const int ot = co % 4 == 0 ? 4 : 2;
  const int64_t groups = ceil_div(co, ot);
  const int64_t pitch = (chunks * qc + s - 1) | 1;
  const int64_t want_blocks = one_wave_blocks() / 4;  // two per multiprocessor
  int64_t g_best = 0;
  double eff_best = -1;
  for (int64_t g = 1; g <= 8; ++g) {
    const int64_t threads = ceil_div(g * units, 32) * 32;
    const int64_t shared = (round4(g * ci * hi * pitch) + ci * r * s * ot) * elem;
    if (threads > kMaxRowThreads || shared > kMaxSharedBytes) break;
    if (g > 1 && ceil_div(n, g) * groups < want_blocks) break;
    const double eff = static_cast<double>(g * units) / static_cast<double>(threads);
    if (eff > eff_best + 1e-9) eff_best = eff, g_best = g;
  }
  if (g_best == 0) return l;
  // Slices of the input channels, so that a block has enough warps to hide the latency of its
  // loads: up to kMaxRowThreads threads, within shared memory.
  const int64_t nu = ceil_div(g_best * units, 32) * 32;
  const int64_t stage = round4(g_best * ci * hi * pitch) + ci * r * s * ot;
  int64_t per = ceil_div(ci, std::max<int64_t>(1, std::min<int64_t>(ci, kMaxRowThreads / nu)));
  const auto epilogue = [&](int64_t splits) { return (splits - 1) * qc * ot * nu + g_best * ot * ho * wo; };
  while (std::max(stage, epilogue(ceil_div(ci, per))) * elem > kMaxSharedBytes && per < ci) ++per;
  const int64_t splits = ceil_div(ci, per);
  if (std::max(stage, epilogue(splits)) * elem > kMaxSharedBytes) return l;
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  RowShape& g = l.g;
  g.n = i32(n), g.ci = i32(ci), g.hi = i32(hi), g.wi = i32(wi);
  g.co = i32(co), g.ho = i32(ho), g.wo = i32(wo), g.r = i32(r), g.ph = i32(ph), g.pw = i32(pw);
  g.flip = flip ? 1 : 0;
  g.chunks = i32(chunks), g.units = i32(units), g.g = i32(g_best), g.pitch = i32(pitch);
  g.tile = round4(g_best * ci * hi * pitch);
  g.nu = i32(nu), g.splits = i32(splits), g.per_split = i32(per);
  l.s = i32(s), l.qc = qc, l.ot = ot;
  l.grid = dim3(static_cast<unsigned>(ceil_div(n, g_best)), static_cast<unsigned>(groups));
  l.block = dim3(static_cast<unsigned>(nu * splits));
  l.shared = static_cast<size_t>(std::max(stage, epilogue(splits)) * elem);
  l.ok = true;
  return l;
}

template <typename T, int S, int QC>
void launch_rows_qc(const RowLaunch& l, const T* in, const T* w, const T* bias, T* out, cudaStream_t stream) {
  if (l.ot == 4) {
    row_conv_kernel<T, S, QC, 4><<<l.grid, l.block, l.shared, stream>>>(in, w, bias, out, l.g);
  } else {
    row_conv_kernel<T, S, QC, 2><<<l.grid, l.block, l.shared, stream>>>(in, w, bias, out, l.g);
  }
}

template <typename T, int S>
void launch_rows_s(const RowLaunch& l, const T* in, const T* w, const T* bias, T* out, cudaStream_t stream) {
  switch (l.qc) {
    case 8: launch_rows_qc<T, S, 8>(l, in, w, bias, out, stream); break;
    case 7: launch_rows_qc<T, S, 7>(l, in, w, bias, out, stream); break;
    case 5: launch_rows_qc<T, S, 5>(l, in, w, bias, out, stream); break;
    default: launch_rows_qc<T, S, 4>(l, in, w, bias, out, stream); break;
  }
}

template <typename T>
void launch_rows(const RowLaunch& l, const T* in, const T* w, const T* bias, T* out, cudaStream_t stream) {
  if (l.s == 5) {
    launch_rows_s<T, 5>(l, in, w, bias, out, stream);
  } else {
    launch_rows_s<T, 3>(l, in, w, bias, out, stream);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

// The forward of x [N, C, H, W], w [K, C, R, S] -> y [N, K, P, Q].
RowLaunch forward_launch(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, int64_t elem) {
  return row_launch(xs[0], xs[1], xs[2], xs[3], ws[0], ys[2], ys[3], ws[2], ws[3], p.pad_h, p.pad_w, false, elem);
}
// The input gradient: dy [N, K, P, Q] -> dx [N, C, H, W], padding R - 1 - pad (pad < R, which
// row_conv_applies checks).
RowLaunch input_launch(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, int64_t elem) {
  return row_launch(ys[0], ys[1], ys[2], ys[3], xs[1], xs[2], xs[3], ws[2], ws[3], ws[2] - 1 - p.pad_h,
                    ws[3] - 1 - p.pad_w, true, elem);
}

// ---- weight gradient --------------------------------------------------------------------

struct WgradShape {
  int n;          // images
  int c, h, w;    // input channels and size
  int k, p, q;    // output channels and size
  int r;          // filter rows (S is a template argument)
  int ph, pw;     // zero padding
  int hp, pitch;  // the padded tile: p + r - 1 rows of pitch (>= q + S - 1, odd) elements
  int owners;     // tap threads per row segment: c * r
  int segs, segw; // column segments per output row and their width
  int imgs;       // images per round (staged together)
  int lanes;      // row segments per round: imgs * p * segs
  int chunk;      // images per block
  int chunks;     // blocks along x
  int tile;       // shared elements of the input tiles: imgs * c * hp * pitch, rounded up to 4
  int dys;        // shared elements of dy: imgs * p * q * KT
  int slots;      // partial sums per output channel: c * r * S (+ 1 for the bias)
  int bias;       // 1: the block has the bias warp
  int tap_threads;  // owners * lanes, rounded up to a warp (the bias warp follows)
};

struct WgradLaunch {
  WgradShape g{};
  int s = 0;
  dim3 grid, block;
  size_t shared = 0;
  bool ok = false;
};

// Block (chunk j of images, output channels k0 .. k0 + KT). Tap thread t < owners * lanes owns
// filter row (c, r) = (o / r, o % r), o = t % owners, and walks row segment t / owners of each
// round's images; the bias warp, when there is one, sums each round's dy. See
// Note [row convolution].
template <typename T, int S>
__global__ void __launch_bounds__(kMaxWgradTapThreads + 32)
    row_wgrad_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ partial, WgradShape g) {
  constexpr int KT = kWgradKTile;
  extern __shared__ __align__(16) unsigned char row_smem[];
  T* tile = reinterpret_cast<T*>(row_smem);
  T* dys = tile + g.tile;  // [imgs][p * q][KT]
  const int j = blockIdx.x;
  const int k0 = blockIdx.y * KT;
  const int t = threadIdx.x;
  const bool tap = t < g.owners * g.lanes;
  const bool bias_warp = g.bias && t >= g.tap_threads;
  const int owner = t % g.owners, lane = t / g.owners;
  const int ci = owner / g.r, rr = owner - ci * g.r;
  const int per_img = g.p * g.segs;
  const int b = lane / per_img, lrem = lane - b * per_img;
  const int pi = lrem / g.segs, q0 = (lrem - pi * g.segs) * g.segw;
  const int qn = min(g.segw, g.q - q0);
  const int pq = g.p * g.q;
  T acc[S][KT] = {};
  T accb = 0;  // the bias warp: channel (t & 31) % KT, positions in stripes of 32 / KT
  const int n_begin = j * g.chunk, n_end = min(g.n, n_begin + g.chunk);
  const int tile_rows = g.imgs * g.c * g.hp;
  const int warps = blockDim.x >> 5, wid = t >> 5, wl = t & 31;
  for (int n = n_begin; n < n_end; n += g.imgs) {
    __syncthreads();  // the previous round's tiles are read no more
    // The padded input rows: a warp per row.
    for (int fr = wid; fr < tile_rows; fr += warps) {
      const int bc = fr / g.hp, hh = fr - bc * g.hp - g.ph;
      const int bimg = bc / g.c;
      const bool inside = n + bimg < n_end && hh >= 0 && hh < g.h;
      const T* src = x + ((static_cast<int64_t>(n) * g.c + bc) * g.h + hh) * g.w;
      T* dst = tile + fr * g.pitch;
      for (int col = wl; col < g.pitch; col += 32) {
        const int ww = col - g.pw;
        if (inside && ww >= 0 && ww < g.w) {
          copy_async(dst + col, src + ww);
        } else {
          dst[col] = T(0);
        }
      }
    }
    // dy of the round's images for the block's channels, position-major; plane by plane.
    for (int bk = 0; bk < g.imgs * KT; ++bk) {
      const int bimg = bk / KT, kk = bk % KT;
      const bool inside = n + bimg < n_end && k0 + kk < g.k;
      const T* src = dy + (static_cast<int64_t>(n + bimg) * g.k + k0 + kk) * pq;
      T* dst = dys + bimg * pq * KT + kk;
      for (int pos = t; pos < pq; pos += blockDim.x) {
        if (inside) {
          copy_async(dst + pos * KT, src + pos);
        } else {
          dst[pos * KT] = T(0);
        }
      }
    }
    copy_wait_all();
    __syncthreads();
    if (tap && n + b < n_end && qn > 0) {
      const T* xrow = tile + ((b * g.c + ci) * g.hp + pi + rr) * g.pitch + q0;
      const T* drow = dys + (b * pq + pi * g.q + q0) * KT;
      T xw[S];
#pragma unroll
      for (int s = 0; s < S - 1; ++s) xw[s] = xrow[s];
      for (int qq = 0; qq < qn; ++qq) {
        xw[S - 1] = xrow[qq + S - 1];
        T dv[KT];
        load_vec<KT>(drow + qq * KT, dv);
#pragma unroll
        for (int s = 0; s < S; ++s) {
#pragma unroll
          for (int kk = 0; kk < KT; ++kk) acc[s][kk] = fma(dv[kk], xw[s], acc[s][kk]);
        }
#pragma unroll
        for (int s = 0; s < S - 1; ++s) xw[s] = xw[s + 1];
      }
    }
    if (bias_warp) {
      // Lane l adds channel l % KT at positions l / KT, l / KT + 32 / KT, ... of the round.
      // Four sums in flight, added in a fixed order.
      constexpr int kStripes = 32 / KT;
      const int kk = wl % KT, total = g.imgs * pq;
      T part[4] = {};
      int pos = wl / KT;
      for (; pos + 3 * kStripes < total; pos += 4 * kStripes) {
#pragma unroll
        for (int u = 0; u < 4; ++u) part[u] += dys[(pos + u * kStripes) * KT + kk];
      }
      for (int u = 0; pos < total; pos += kStripes, ++u) part[u] += dys[pos * KT + kk];
      accb += (part[0] + part[1]) + (part[2] + part[3]);
    }
  }
  // Add the row segments' sums pairwise in a fixed tree, in the shared memory of the tiles:
  // while m segments remain, the last floor(m / 2) hand theirs to the first floor(m / 2). A
  // thread's S * KT sums are consecutive (16-byte stores and loads), at a pitch 16 bytes
  // longer, so that the eight threads of a quarter-warp meet in different banks.
  T* red = tile;
  constexpr int kPitch = S * KT + 16 / static_cast<int>(sizeof(T));
  for (int m = g.lanes; m > 1;) {
    const int h = m / 2, keep = m - h;
    __syncthreads();
    if (tap && lane >= keep && lane < m) {
      T* dst = red + ((lane - keep) * g.owners + owner) * kPitch;
#pragma unroll
      for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) dst[s * KT + kk] = acc[s][kk];
      }
    }
    __syncthreads();
    if (tap && lane < h) {
      const T* src = red + (lane * g.owners + owner) * kPitch;
#pragma unroll
      for (int s = 0; s < S; ++s) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) acc[s][kk] += src[s * KT + kk];
      }
    }
    m = keep;
  }
  const int taps = g.c * g.r * S;
  if (tap && lane == 0) {
    for (int kk = 0; kk < KT && k0 + kk < g.k; ++kk) {
      T* dst = partial + (static_cast<int64_t>(j) * g.k + k0 + kk) * g.slots + (ci * g.r + rr) * S;
#pragma unroll
      for (int s = 0; s < S; ++s) dst[s] = acc[s][kk];
    }
  }
  if (bias_warp) {
    // The stripes of each channel, in lane order: lanes kk, kk + KT, ... hold channel kk.
#pragma unroll
    for (int d = 16; d >= KT; d /= 2) accb += __shfl_down_sync(0xffffffffu, accb, d);
    if (wl < KT && k0 + wl < g.k) partial[(static_cast<int64_t>(j) * g.k + k0 + wl) * g.slots + taps] = accb;
  }
}

// dw[k, o] (and db[k]) = the chunks' partial sums, in double: a block per 32 outputs, warp y of
// 8 adding chunks y, y + 8, ... (coalesced across the outputs), then the warps in order.
constexpr int kFinishSlices = 8;
template <typename T>
__global__ void __launch_bounds__(32 * kFinishSlices)
    row_wgrad_finish(const T* __restrict__ partial, T* __restrict__ dw, T* __restrict__ db, int outputs, int slots,
                     int taps, int chunks) {
  __shared__ double sums[kFinishSlices][32];
  const int x = threadIdx.x & 31, y = threadIdx.x >> 5;
  const int i = blockIdx.x * 32 + x;
  double sum = 0;
  if (i < outputs) {
    for (int jc = y; jc < chunks; jc += kFinishSlices) sum += static_cast<double>(partial[static_cast<int64_t>(jc) * outputs + i]);
  }
  sums[y][x] = sum;
  __syncthreads();
  if (y != 0 || i >= outputs) return;
  double total = 0;
#pragma unroll
  for (int k = 0; k < kFinishSlices; ++k) total += sums[k][x];
  const int ko = i / slots, o = i - ko * slots;
  if (o < taps) {
    dw[ko * taps + o] = static_cast<T>(total);
  } else {
    db[ko] = static_cast<T>(total);
  }
}

// The weight gradient's launch: row segments (images, rows, column segments) per round so that
// a block has up to kMaxWgradTapThreads tap threads, and chunks of images so that there are
// about two blocks per multiprocessor. ok false where it does not fit in shared memory.
WgradLaunch wgrad_launch(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, bool with_bias,
                         int64_t elem) {
  WgradLaunch l{};
  const int64_t n = xs[0], c = xs[1], k = ws[0], r = ws[2], s = ws[3], pp = ys[2], q = ys[3];
  if (s != 3 && s != 5) return l;
  if (r > kMaxRowFilterRows || c * r > kMaxWgradTapThreads) return l;
  const int64_t owners = c * r, hp = pp + r - 1;
  const int64_t pitch = (q + s - 1) | 1;
  const auto staged = [&](int64_t imgs) {
    return round4(imgs * c * hp * pitch) + imgs * pp * q * kWgradKTile;
  };
  int64_t imgs = 1, segs = 1;
  if (owners * pp > kMaxWgradTapThreads) return l;
  // More rows in flight while the block stays within its threads: a second image where its
  // tiles fit, else halves of the rows (each restarts its window: S - 1 more loads).
  while (owners * imgs * pp * segs * 2 <= kMaxWgradTapThreads) {
    if (staged(imgs * 2) * elem <= kMaxSharedBytes && imgs * 2 <= n) {
      imgs *= 2;
    } else if (ceil_div(q, segs * 2) >= 2 * s) {
      segs *= 2;
    } else {
      break;
    }
  }
  const int64_t segw = ceil_div(q, segs);
  const int64_t lanes = imgs * pp * segs;
  const int64_t red = lanes / 2 * owners * (s * kWgradKTile + 16 / elem);  // kPitch per thread
  if (std::max<int64_t>(staged(imgs), red) * elem > kMaxSharedBytes) return l;
  const int64_t groups = ceil_div(k, kWgradKTile);
  const int64_t want_chunks = std::max<int64_t>(1, one_wave_blocks() / 4 / groups);
  const int64_t chunk = ceil_div(ceil_div(n, want_chunks), imgs) * imgs;
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  WgradShape& g = l.g;
  g.n = i32(n), g.c = i32(c), g.h = i32(xs[2]), g.w = i32(xs[3]);
  g.k = i32(k), g.p = i32(pp), g.q = i32(q), g.r = i32(r), g.ph = i32(p.pad_h), g.pw = i32(p.pad_w);
  g.hp = i32(hp), g.pitch = i32(pitch), g.owners = i32(owners), g.segs = i32(segs), g.segw = i32(segw);
  g.imgs = i32(imgs), g.lanes = i32(lanes), g.chunk = i32(chunk), g.chunks = i32(ceil_div(n, chunk));
  g.tile = round4(imgs * c * hp * pitch), g.dys = i32(imgs * pp * q * kWgradKTile);
  g.slots = i32(c * r * s + (with_bias ? 1 : 0)), g.bias = with_bias ? 1 : 0;
  g.tap_threads = i32(ceil_div(owners * lanes, 32) * 32);
  l.s = i32(s);
  l.grid = dim3(static_cast<unsigned>(g.chunks), static_cast<unsigned>(groups));
  l.block = dim3(static_cast<unsigned>(g.tap_threads + (with_bias ? 32 : 0)));
  l.shared = static_cast<size_t>(std::max<int64_t>(staged(imgs), red) * elem);
  l.ok = true;
  return l;
}

bool shapes_fit(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  if (!own_conv_kernels_take(x, w, y, p)) return false;
  // Padding no wider than the filter: the input gradient's own padding, R - 1 - pad, is >= 0.
  return p.pad_h < w.size(2) && p.pad_w < w.size(3);
}

// Whether row_conv_passes() names the pass (kernels/backend.h).
bool pass_enabled(RowPass pass) {
  const std::string passes = row_conv_passes();
  const char letter = pass == RowPass::Forward ? 'f' : pass == RowPass::BackwardInput ? 'd' : 'w';
  return passes.find(letter) != std::string::npos;
}

}  // namespace

bool row_conv_applies(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  return pass_enabled(pass) && row_conv_fits(pass, x, w, y, p);
}

bool row_conv_fits(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  if (!shapes_fit(x, w, y, p)) return false;
  const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
  switch (pass) {
    case RowPass::Forward: return forward_launch(x.shape(), w.shape(), y.shape(), p, elem).ok;
    case RowPass::BackwardInput: return input_launch(x.shape(), w.shape(), y.shape(), p, elem).ok;
    case RowPass::BackwardWeight: return wgrad_launch(x.shape(), w.shape(), y.shape(), p, true, elem).ok;
  }
  return false;
}

void row_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p, const Tensor& y,
                      cudaStream_t stream) {
  const RowLaunch l = forward_launch(x.shape(), w.shape(), y.shape(), p, static_cast<int64_t>(dtype_size(x.dtype())));
  TANDEM_CHECK(l.ok, Value, "row_conv_forward: the row kernels do not take this convolution");
  dispatch_floating(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_rows<T>(l, cptr<T>(x), cptr<T>(w), bias.defined() ? cptr<T>(bias) : nullptr, ptr<T>(y), stream);
  });
}

void row_conv_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p, const Tensor& dx,
                             cudaStream_t stream) {
  const RowLaunch l =
      input_launch(dx.shape(), w.shape(), dy.shape(), p, static_cast<int64_t>(dtype_size(dx.dtype())));
  TANDEM_CHECK(l.ok, Value, "row_conv_backward_input: the row kernels do not take this convolution");
  dispatch_floating(dx.dtype(), "conv2d_backward_input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_rows<T>(l, cptr<T>(dy), cptr<T>(w), nullptr, ptr<T>(dx), stream);
  });
}

void row_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                              const Tensor& db, cudaStream_t stream) {
  const bool with_bias = db.defined();
  const WgradLaunch l =
      wgrad_launch(x.shape(), dw.shape(), dy.shape(), p, with_bias, static_cast<int64_t>(dtype_size(dw.dtype())));
  TANDEM_CHECK(l.ok, Value, "row_conv_backward_weight: the row kernels do not take this convolution");
  const WgradShape& g = l.g;
  const int taps = g.c * g.r * l.s, outputs = g.k * g.slots;
  dispatch_floating(dw.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tensor partial = empty({int64_t{g.chunks} * outputs}, dw.dtype(), dw.device());
    if (l.s == 5) {
      row_wgrad_kernel<T, 5><<<l.grid, l.block, l.shared, stream>>>(cptr<T>(x), cptr<T>(dy), ptr<T>(partial), g);
    } else {
      row_wgrad_kernel<T, 3><<<l.grid, l.block, l.shared, stream>>>(cptr<T>(x), cptr<T>(dy), ptr<T>(partial), g);
    }
    TANDEM_CUDA_CHECK_LAUNCH();
    row_wgrad_finish<T><<<static_cast<unsigned>(ceil_div(outputs, 32)), 32 * kFinishSlices, 0, stream>>>(
        cptr<T>(partial), ptr<T>(dw), with_bias ? ptr<T>(db) : nullptr, outputs, g.slots, taps, g.chunks);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem::gpu
