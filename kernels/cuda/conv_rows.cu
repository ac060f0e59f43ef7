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
// - Weight gradient (conv_rows_wgrad.cu): dw[k, c, r, s] = sum over n, p, q of dy[n, k, p, q] * x[n, c, p + r - ph,
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

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_direct.h"
#include "kernels/cuda/conv_rows.cuh"

namespace tandem::gpu {

namespace row_detail {

bool shapes_fit(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  if (!own_conv_kernels_take(x, w, y, p)) return false;
  // Padding no wider than the filter: the input gradient's own padding, R - 1 - pad, is >= 0.
  return p.pad_h < w.size(2) && p.pad_w < w.size(3);
}

}  // namespace row_detail

namespace {

using namespace row_detail;

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
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
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
    launch_after_previous_shared(row_conv_kernel<T, S, QC, 4>, l.grid, l.block, l.shared, stream, in, w, bias, out, l.g);
  } else {
    launch_after_previous_shared(row_conv_kernel<T, S, QC, 2>, l.grid, l.block, l.shared, stream, in, w, bias, out, l.g);
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

// Whether row_conv_passes() names the pass (kernels/backend.h).
bool pass_enabled(RowPass pass) {
  return row_conv_pass_on(pass == RowPass::Forward ? 'f' : pass == RowPass::BackwardInput ? 'd' : 'w');
}

}  // namespace

bool row_conv_applies(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  return pass_enabled(pass) && row_conv_fits(pass, x, w, y, p);
}

bool row_conv_fits(RowPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  if (!row_detail::shapes_fit(x, w, y, p)) return false;
  const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
  switch (pass) {
    case RowPass::Forward: return forward_launch(x.shape(), w.shape(), y.shape(), p, elem).ok;
    case RowPass::BackwardInput: return input_launch(x.shape(), w.shape(), y.shape(), p, elem).ok;
    case RowPass::BackwardWeight: return wgrad_fits(x.shape(), w.shape(), y.shape(), p, true, elem);
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

}  // namespace tandem::gpu
