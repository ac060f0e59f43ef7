// tandem's row-window kernel for the weight gradient of small convolutions, and its finishing
// kernel (Note [row convolution] in conv_rows.cu).
#include <algorithm>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_rows.cuh"

namespace tandem::gpu {

namespace {

using namespace row_detail;

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

}  // namespace

namespace row_detail {

bool wgrad_fits(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p, bool with_bias,
                int64_t elem) {
  return wgrad_launch(xs, ws, ys, p, with_bias, elem).ok;
}

}  // namespace row_detail

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
