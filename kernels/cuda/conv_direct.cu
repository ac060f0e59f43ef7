// tandem's own kernels for convolutions of few input channels: the forward of a first layer
// and the weight gradient, deterministic, in the plain FMA of the element type (float32 or
// float64; never TF32).
//
// Note [direct convolution]: LeNet's two convolutions (1->6 and 6->16 channels, 5x5) do 30 M
// and 61 M multiply-adds per pass at batch 256 -- a few microseconds of an H200's arithmetic --
// yet in a replayed LeNet step (kernel timeline, bench/timeline.sh) cuDNN took 25 us for the
// first layer's forward (heuristic and timed engines alike) and 32-35 us for each weight
// gradient, through layout conversions or an FFT: its implicit GEMMs are tiled for thousands
// of channels, and here the reduction of one forward output is 25 terms. So:
//
// - Forward, y[n, k, p, q] = sum over c, r, s of x[n, c, p + r - ph, q + s - pw] * w[k, c, r, s]
//   + bias[k], for at most kMaxForwardTaps taps per output (C * R * S: a first layer). One
//   block per image and group of kKTile output channels copies its image, zero-padded, and
//   its channels' filters into shared memory; each thread then computes rows pi and pi + 1
//   of one column for kKTile channels: per tap two input values (neighbouring threads read
//   neighbouring columns) and kKTile weights (one address for the warp: a broadcast, two
//   16-byte loads in float32), 2 * kKTile FMAs; the bias is added after the sum. Measured on
//   an H200, LeNet's first layer: 7 us against cuDNN's 25. For LeNet's second layer (150
//   taps) the same kernel took 18-27 us against cuDNN's 16, as did an input gradient of this
//   form against cuDNN's: those stay with cuDNN.
// - Weight gradient, dw[k, c, r, s] = sum over n, p, q of dy[n, k, p, q] * x[n, c, p + r - ph,
//   q + s - pw], and the bias gradient (the sum of dy) as one more tap whose input is 1: one
//   block per chunk of images and group of kKTile channels, with an image's padded input and
//   the group's dy in shared memory. Thread (tap o, lane l) sums tap o's terms over the rows
//   l, l + lanes, ... for its kKTile channels; the lanes are added in a fixed tree and a
//   second kernel adds the chunks in order, in double, a warp per weight. LeNet: 21 and 23 us
//   for both layers' weight and bias gradients, against 32-39 us through cuDNN.
// - Staging: both kernels copy their tiles with cp.async (copy_async), so a warp's copies are
//   all in flight at once; copied one load and one store at a time, a warp of the first
//   layer's weight gradient waited for 30-odd trips to memory in a row (the whole kernel: 16.5
//   against 20 us; the second layer's gained nothing measurable, 21.6 against 22.8: its time is
//   in the products). A block of the weight gradient takes one image (about kWgradBlocks blocks
//   in all) or, for larger batches, several, with two stage buffers where they fit in shared
//   memory, so that the next image loads while this one is multiplied; two images per block
//   were measured slower for LeNet (26 against 21.6 us for the second layer, 18.5 against 16.5
//   for the first: fewer blocks in flight, and the first layer's two buffers do not fit).
//
// Every output is a sum in a fixed order: the same bits on every run (Note [deterministic
// reductions]), on a CUDA graph replay as eagerly. Used for stride 1, packed NCHW, float32
// and float64, at most kMaxInChannels input channels and kMaxOutChannels output channels,
// taps up to 7x7, and tiles that fit in 48 KB of shared memory, in every mode (benchmark
// mode included: cuDNN's timed engines were the slower ones above); everything else (and
// channels-last, bfloat16, or direct_conv() off: TANDEM_DIRECT_CONV=0) goes to cuDNN.
#include <algorithm>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/conv_direct.h"

namespace tandem::gpu {

namespace {

constexpr int kKTile = 8;  // output channels per thread
constexpr int64_t kMaxInChannels = 8;
constexpr int64_t kMaxForwardTaps = 32;  // C * R * S of the forward (see the Note)
constexpr int64_t kMaxOutChannels = 64;
constexpr int64_t kMaxTaps = 7;
constexpr int64_t kMaxSharedBytes = 48 * 1024;
constexpr int kMaxConvThreads = 512;
constexpr int kMaxWgradThreads = 1024;
constexpr int kWgradTargetThreads = 256;
constexpr int64_t kWgradBlocks = 512;

// The sizes of one pass, in 32-bit ints (direct_conv_applies keeps tensors below 2^31
// elements): x [N, C, H, W] and y [N, K, P, Q].
struct DirectShape {
  int n;        // images
  int c, h, w;  // input channels and size
  int k, p, q;  // output channels and size
  int r, s;     // taps
  int ph, pw;   // zero padding of the input
  int hp, wp;   // the padded input: p + r - 1 rows of q + s - 1 (stride 1)
  // The tile in shared memory: per channel hp + 1 rows (one more zero row, read by the second
  // output row of a thread when p is odd) of `pitch` elements, an odd number so that the same
  // column of neighbouring rows falls in different banks; `tile` elements in all, rounded up
  // to a multiple of 4 so that what follows is 16-byte aligned.
  int pitch, tile;
};

DirectShape make_shape(int64_t n, int64_t c, int64_t h, int64_t w, int64_t k, int64_t p, int64_t q, int64_t r,
                       int64_t s, int64_t ph, int64_t pw) {
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  DirectShape g{};
  g.n = i32(n), g.c = i32(c), g.h = i32(h), g.w = i32(w);
  g.k = i32(k), g.p = i32(p), g.q = i32(q), g.r = i32(r), g.s = i32(s);
  g.ph = i32(ph), g.pw = i32(pw);
  g.hp = g.p + g.r - 1, g.wp = g.q + g.s - 1;
  g.pitch = g.wp | 1;
  g.tile = i32(ceil_div(c * (g.hp + 1) * g.pitch, 4) * 4);
  return g;
}

// The forward pass of x [N, C, H, W], w [K, C, R, S] -> y [N, K, P, Q].
DirectShape forward_shape(const Shape& xs, const Shape& ws, const Shape& ys, const Conv2dParams& p) {
  return make_shape(xs[0], xs[1], xs[2], xs[3], ws[0], ys[2], ys[3], ws[2], ws[3], p.pad_h, p.pad_w);
}
int64_t k_groups(int64_t k) { return ceil_div(k, kKTile); }

// A forward-kernel launch: threads per channel split (a multiple of 32), the splits of the
// input channels (Note [direct convolution]) and the channels of each.
struct ConvLayout {
  int item_threads, splits, split_channels;
  int64_t shared_elems;  // the input tile, the filter of one channel group, the split sums
};

ConvLayout conv_layout(const DirectShape& g) {
  ConvLayout l{};
  const int64_t items = int64_t{(g.p + 1) / 2} * g.q;
  l.item_threads = static_cast<int>(std::min<int64_t>(kMaxConvThreads, ceil_div(items, 32) * 32));
  const int want = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(g.c, kMaxConvThreads / l.item_threads)));
  l.split_channels = static_cast<int>(ceil_div(g.c, want));
  l.splits = static_cast<int>(ceil_div(g.c, l.split_channels));
  l.shared_elems = g.tile + int64_t{g.c} * g.r * g.s * kKTile + int64_t{l.splits - 1} * l.item_threads * 2 * kKTile;
  return l;
}

// The weight gradient's layout: a slot per tap (and one for the bias), lanes per slot, images
// per block, and one stage buffer (an image's padded input and its dy for the block's channel
// group), or two when a block takes several images: the next image then loads while this one
// is multiplied.
struct WgradLayout {
  int slots, lanes, chunk, chunks, buffers;
  int64_t stage;  // elements of one stage buffer: the input tile, then dy as [P * Q][kKTile]
  int64_t shared_elems;
};

WgradLayout wgrad_layout(const DirectShape& g, bool with_bias, int64_t elem) {
  WgradLayout l{};
  l.slots = g.c * g.r * g.s + (with_bias ? 1 : 0);
  // As many lanes per slot as fit in the target (a power of two, for the tree), no more than
  // there are output rows.
  const DirectWgradShape shape = direct_wgrad_shape();  // {0, 0} unless set (kernels/backend.h)
  const int target = shape.threads > 0 ? shape.threads : kWgradTargetThreads;
  l.lanes = 1;
  while (l.slots * l.lanes * 2 <= target && l.lanes * 2 <= g.p) l.lanes *= 2;
  // About kWgradBlocks blocks, a few per multiprocessor; a function of the shapes alone, so
  // the order of every sum is too (Note [deterministic reductions]).
  const int64_t chunk = shape.images_per_block > 0 ? shape.images_per_block
                                                         : ceil_div(int64_t{g.n} * k_groups(g.k), kWgradBlocks);
  l.chunk = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunk, g.n)));
  l.chunks = static_cast<int>(ceil_div(g.n, l.chunk));
  l.stage = g.tile + int64_t{g.p} * g.q * kKTile;
  l.buffers = l.chunk > 1 && 2 * l.stage * elem <= kMaxSharedBytes ? 2 : 1;
  l.shared_elems = std::max<int64_t>(l.buffers * l.stage, int64_t{l.lanes} * l.slots * kKTile);
  return l;
}

// kKTile consecutive values from shared memory; two 16-byte loads for float32 (the address is
// a multiple of kKTile elements from a 16-byte aligned base).
template <typename T>
__device__ inline void load_group(const T* src, T (&v)[kKTile]) {
#pragma unroll
  for (int i = 0; i < kKTile; ++i) v[i] = src[i];
}
template <>
__device__ inline void load_group<float>(const float* src, float (&v)[kKTile]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Copies one image's input [C, H, W] into shared memory as the zero-padded tile (see
// DirectShape): a warp per row, a thread per column, so one division per row. The copies are
// asynchronous (copy_async): every thread issues all of its copies before any has arrived, so
// staging costs about one trip to memory instead of one per row a warp copies (18-32 of them
// one after the other in LeNet's weight gradients, most of those kernels' time). The caller
// waits with copy_wait_all() before its barrier.
template <typename T>
__device__ void stage_input(const T* __restrict__ src, T* __restrict__ tile, const DirectShape& g) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int rows = g.hp + 1;
  for (int row = warp; row < g.c * rows; row += warps) {
    const int ci = row / rows;
    const int hh = row - ci * rows - g.ph;
    const bool inside = hh >= 0 && hh < g.h;
    const T* srow = src + (static_cast<int64_t>(ci) * g.h + hh) * g.w;
    for (int col = lane; col < g.pitch; col += 32) {
      const int ww = col - g.pw;
      if (inside && ww >= 0 && ww < g.w) {
        copy_async(tile + row * g.pitch + col, srow + ww);
      } else {
        tile[row * g.pitch + col] = T(0);
      }
    }
  }
}

// Block (image n, channel group): out[n, k0 .. k0 + kKTile) = the correlation of the padded
// input with the filter (+ bias). Each thread computes two outputs, rows pi and pi + 1 of one
// column, with every filter value it loads, over the input channels of its channel split:
// with few output positions per image, `splits` threads share one output, each summing a
// slice of the channels, and the slices are added in order through shared memory -- so a
// block has enough warps to hide the latency of its loads. R, S: the taps when known at
// compile time (the loops unroll), else 0 and g.r, g.s.
template <typename T, int R, int S>
__global__ void __launch_bounds__(kMaxConvThreads)
    direct_conv_kernel(const T* __restrict__ in, const T* __restrict__ w, const T* __restrict__ bias,
                       T* __restrict__ out, DirectShape g, ConvLayout l) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  extern __shared__ __align__(16) unsigned char direct_smem[];
  T* tile = reinterpret_cast<T*>(direct_smem);
  T* filt = tile + g.tile;                   // [C][R][S][kKTile]
  T* red = filt + g.c * g.r * g.s * kKTile;  // [splits - 1][item_threads][2 * kKTile]
  const int r = R > 0 ? R : g.r, s = S > 0 ? S : g.s;
  const int n = blockIdx.x;
  const int k0 = blockIdx.y * kKTile;
  stage_input(in + static_cast<int64_t>(n) * g.c * g.h * g.w, tile, g);
  const int rs = r * s;
  for (int i = threadIdx.x; i < g.c * rs * kKTile; i += blockDim.x) {
    const int o = i / kKTile, ko = k0 + i % kKTile;
    const int ci = o / rs, rem = o - ci * rs;
    const int rr = rem / s, ss = rem - rr * s;
    if (ko < g.k) {
      copy_async(filt + i, w + ((ko * g.c + ci) * r + rr) * s + ss);
    } else {
      filt[i] = T(0);
    }
  }
  copy_wait_all();
  __syncthreads();
  const int pq = g.p * g.q;
  const int rows = g.hp + 1;
  const int items = (g.p + 1) / 2 * g.q;
  const int split = threadIdx.x / l.item_threads, it = threadIdx.x % l.item_threads;
  const int c0 = split * l.split_channels, c1 = min(g.c, c0 + l.split_channels);
  // Every thread runs the same number of rounds: the slices meet at barriers.
  for (int base = 0; base < items; base += l.item_threads) {
    const int item = base + it;
    const bool valid = item < items;
    const int pi = valid ? 2 * (item / g.q) : 0, qi = valid ? item % g.q : 0;
    T acc0[kKTile] = {}, acc1[kKTile] = {};
    for (int ci = valid ? c0 : c1; ci < c1; ++ci) {
      const T* x0 = tile + (ci * rows + pi) * g.pitch + qi;
      const T* wt = filt + ci * rs * kKTile;
#pragma unroll
      for (int rr = 0; rr < r; ++rr) {
#pragma unroll
        for (int ss = 0; ss < s; ++ss) {
          const T a = x0[rr * g.pitch + ss], b = x0[(rr + 1) * g.pitch + ss];
          T wv[kKTile];
          load_group(wt + (rr * s + ss) * kKTile, wv);
#pragma unroll
          for (int kk = 0; kk < kKTile; ++kk) {
            acc0[kk] = fma(wv[kk], a, acc0[kk]);
            acc1[kk] = fma(wv[kk], b, acc1[kk]);
          }
        }
      }
    }
    if (l.splits > 1) {
      if (split > 0) {
        T* mine = red + ((split - 1) * l.item_threads + it) * 2 * kKTile;
#pragma unroll
        for (int kk = 0; kk < kKTile; ++kk) mine[kk] = acc0[kk], mine[kKTile + kk] = acc1[kk];
      }
      __syncthreads();
      if (split == 0) {
        for (int sp = 1; sp < l.splits; ++sp) {
          const T* theirs = red + ((sp - 1) * l.item_threads + it) * 2 * kKTile;
#pragma unroll
          for (int kk = 0; kk < kKTile; ++kk) acc0[kk] += theirs[kk], acc1[kk] += theirs[kKTile + kk];
        }
      }
      __syncthreads();
    }
    if (split != 0 || !valid) continue;
    T* o = out + (static_cast<int64_t>(n) * g.k + k0) * pq + pi * g.q + qi;
    const bool second = pi + 1 < g.p;
#pragma unroll
    for (int kk = 0; kk < kKTile; ++kk) {
      if (k0 + kk >= g.k) break;
      const T b = bias != nullptr ? bias[k0 + kk] : T(0);
      o[kk * pq] = bias != nullptr ? acc0[kk] + b : acc0[kk];
      if (second) o[kk * pq + g.q] = bias != nullptr ? acc1[kk] + b : acc1[kk];
    }
  }
}

// Stages image n for the weight gradient into `buf`: its padded input tile (stage_input), then
// its dy for channels k0 .. k0 + kKTile as [P * Q][kKTile] (zeros past the last channel), all
// with asynchronous copies; the caller waits for them.
template <typename T>
__device__ void stage_wgrad_image(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ buf,
                                  const DirectShape& g, int n, int k0) {
  stage_input(x + static_cast<int64_t>(n) * g.c * g.h * g.w, buf, g);
  T* dys = buf + g.tile;
  const int pq = g.p * g.q;
  const T* dyn = dy + (static_cast<int64_t>(n) * g.k + k0) * pq;
  for (int kk = 0; kk < kKTile; ++kk) {
    for (int pos = threadIdx.x; pos < pq; pos += blockDim.x) {
      if (k0 + kk < g.k) {
        copy_async(dys + pos * kKTile + kk, dyn + kk * pq + pos);
      } else {
        dys[pos * kKTile + kk] = T(0);
      }
    }
  }
}

// Block (chunk j of images, channel group): partial[j, k0 + kk, o] for every slot o (a tap, or
// the bias). Thread t is slot t % slots in lane t / slots: a warp's threads are neighbouring
// taps at the same output position, reading one dy value (a broadcast) and neighbouring inputs.
// With two buffers, image n + 1 is copied in while image n is multiplied.
template <typename T>
__global__ void __launch_bounds__(kMaxWgradThreads)
    direct_wgrad_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ partial, DirectShape g,
                        WgradLayout l) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  extern __shared__ __align__(16) unsigned char direct_smem[];
  T* const smem = reinterpret_cast<T*>(direct_smem);
  const int j = blockIdx.x;
  const int k0 = blockIdx.y * kKTile;
  const int n0 = j * l.chunk, n1 = min(g.n, n0 + l.chunk);
  // Image n's buffer (buffers == 2: they alternate).
  const auto buffer = [&](int n) { return smem + (l.buffers > 1 ? ((n - n0) & 1) * l.stage : 0); };
  const int t = threadIdx.x;
  const int o = t % l.slots, lane = t / l.slots;
  const bool active = lane < l.lanes;
  const int rs = g.r * g.s, taps = g.c * rs;
  const bool is_bias = o == taps;
  // The tile offset of tap o at output position (0, 0).
  const int off = is_bias ? 0 : ((o / rs) * (g.hp + 1) + (o % rs) / g.s) * g.pitch + o % g.s;
  T acc[kKTile] = {};
  if (l.buffers > 1) {
    stage_wgrad_image(x, dy, smem, g, n0, k0);
    copy_commit();
  }
  for (int n = n0; n < n1; ++n) {
    __syncthreads();  // the buffer staged next was last read for the previous image
    T* const cur = buffer(n);
    if (l.buffers == 1) {
      stage_wgrad_image(x, dy, cur, g, n, k0);
      copy_wait_all();
    } else if (n + 1 < n1) {
      stage_wgrad_image(x, dy, buffer(n + 1), g, n + 1, k0);
      copy_commit();
      copy_wait_group<1>();  // image n has arrived; n + 1 may still be on its way
    } else {
      copy_wait_group<0>();
    }
    __syncthreads();
    if (active) {
      // Lane l takes the output rows l, l + lanes, ...: a plain loop over the row's columns,
      // which the compiler unrolls and whose loads it issues ahead.
      const T* const dys = cur + g.tile;
      for (int pi = lane; pi < g.p; pi += l.lanes) {
        const T* xrow = cur + off + pi * g.pitch;
        const T* drow = dys + pi * g.q * kKTile;
#pragma unroll 4
        for (int qi = 0; qi < g.q; ++qi) {
          const T xv = is_bias ? T(1) : xrow[qi];
          T dv[kKTile];
          load_group(drow + qi * kKTile, dv);
#pragma unroll
          for (int kk = 0; kk < kKTile; ++kk) acc[kk] = fma(dv[kk], xv, acc[kk]);
        }
      }
    }
  }
  // Add the lanes of each slot pairwise in a fixed tree, in the shared memory of the tiles.
  __syncthreads();
  T* red = smem;  // [lanes][slots][kKTile]
  if (active) {
#pragma unroll
    for (int kk = 0; kk < kKTile; ++kk) red[(lane * l.slots + o) * kKTile + kk] = acc[kk];
  }
  __syncthreads();
  for (int stride = 1; stride < l.lanes; stride *= 2) {
    if (active && lane % (2 * stride) == 0 && lane + stride < l.lanes) {
#pragma unroll
      for (int kk = 0; kk < kKTile; ++kk)
        red[(lane * l.slots + o) * kKTile + kk] += red[((lane + stride) * l.slots + o) * kKTile + kk];
    }
    __syncthreads();
  }
  if (t < l.slots) {
    for (int kk = 0; kk < kKTile && k0 + kk < g.k; ++kk)
      partial[(static_cast<int64_t>(j) * g.k + k0 + kk) * l.slots + t] = red[t * kKTile + kk];
  }
}

// dw[k, o] (and db[k]) = the chunks' partial sums in double: a warp per output, lane i adding
// chunks i, i + 32, ..., then the lanes in a fixed tree -- the same order on every run.
template <typename T>
__global__ void direct_wgrad_finish(const T* __restrict__ partial, T* __restrict__ dw, T* __restrict__ db, int k,
                                    int slots, int taps, int chunks) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (i >= k * slots) return;  // a whole warp leaves together
  double sum = 0;
  for (int j = lane; j < chunks; j += 32) sum += static_cast<double>(partial[static_cast<int64_t>(j) * k * slots + i]);
  for (int d = 16; d > 0; d /= 2) sum += __shfl_down_sync(0xffffffffu, sum, d);
  if (lane != 0) return;
  const int ko = i / slots, o = i % slots;
  if (o < taps) {
    dw[ko * taps + o] = static_cast<T>(sum);
  } else {
    db[ko] = static_cast<T>(sum);
  }
}

template <typename T>
void launch_conv(const T* in, const T* w, const T* bias, T* out, const DirectShape& g, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.n), static_cast<unsigned>(k_groups(g.k)));
  const ConvLayout l = conv_layout(g);
  const int threads = l.item_threads * l.splits;
  const size_t shared = static_cast<size_t>(l.shared_elems) * sizeof(T);
  if (g.r == 5 && g.s == 5) {
    launch_after_previous_shared(direct_conv_kernel<T, 5, 5>, grid, threads, shared, stream, in, w, bias, out, g, l);
  } else if (g.r == 3 && g.s == 3) {
    launch_after_previous_shared(direct_conv_kernel<T, 3, 3>, grid, threads, shared, stream, in, w, bias, out, g, l);
  } else {
    launch_after_previous_shared(direct_conv_kernel<T, 0, 0>, grid, threads, shared, stream, in, w, bias, out, g, l);
  }
}

}  // namespace

bool own_conv_kernels_take(const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  constexpr int64_t kMax32 = int64_t{1} << 31;
  if (!direct_conv()) return false;
  if (x.dtype() != kFloat32 && x.dtype() != kFloat64) return false;
  if (x.dim() != 4 || w.dim() != 4 || y.dim() != 4) return false;
  if (p.stride_h != 1 || p.stride_w != 1) return false;
  if (!x.is_contiguous() || !w.is_contiguous() || !y.is_contiguous()) return false;
  return x.numel() < kMax32 && y.numel() < kMax32;
}

bool direct_conv_applies(DirectPass pass, const Tensor& x, const Tensor& w, const Tensor& y, const Conv2dParams& p) {
  if (!own_conv_kernels_take(x, w, y, p) || x.size(0) > (int64_t{1} << 30)) return false;
  const Shape &xs = x.shape(), &ws = w.shape(), &ys = y.shape();
  if (ws[1] > kMaxInChannels || ws[0] > kMaxOutChannels || ws[2] > kMaxTaps || ws[3] > kMaxTaps) return false;
  const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
  switch (pass) {
    case DirectPass::Forward:
      if (ws[1] * ws[2] * ws[3] > kMaxForwardTaps) return false;
      [[fallthrough]];
    case DirectPass::ForwardAnyTaps:
      return conv_layout(forward_shape(xs, ws, ys, p)).shared_elems * elem <= kMaxSharedBytes;
    case DirectPass::BackwardWeight: {
      const WgradLayout l = wgrad_layout(forward_shape(xs, ws, ys, p), /*with_bias=*/true, elem);
      return l.slots <= kMaxWgradThreads && l.shared_elems * elem <= kMaxSharedBytes;
    }
  }
  return false;
}

void direct_conv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                         const Tensor& y, cudaStream_t stream) {
  const DirectShape g = forward_shape(x.shape(), w.shape(), y.shape(), p);
  dispatch_floating(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_conv<T>(cptr<T>(x), cptr<T>(w), bias.defined() ? cptr<T>(bias) : nullptr, ptr<T>(y), g, stream);
  });
}

void direct_conv_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p, const Tensor& dw,
                                 const Tensor& db, cudaStream_t stream) {
  const bool with_bias = db.defined();
  const DirectShape g = forward_shape(x.shape(), dw.shape(), dy.shape(), p);
  const WgradLayout l = wgrad_layout(g, with_bias, static_cast<int64_t>(dtype_size(dw.dtype())));
  const int taps = g.c * g.r * g.s;
  dispatch_floating(dw.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Tensor partial = empty({int64_t{l.chunks} * g.k * l.slots}, dw.dtype(), dw.device());
    const dim3 grid(static_cast<unsigned>(l.chunks), static_cast<unsigned>(k_groups(g.k)));
    const int threads = static_cast<int>(ceil_div(int64_t{l.slots} * l.lanes, 32) * 32);
    launch_after_previous_shared(direct_wgrad_kernel<T>, grid, threads,
                                 static_cast<size_t>(l.shared_elems) * sizeof(T), stream, cptr<T>(x), cptr<T>(dy),
                                 ptr<T>(partial), g, l);
    constexpr int kFinishWarps = 8;
    launch_after_previous(direct_wgrad_finish<T>, static_cast<unsigned>(ceil_div(int64_t{g.k} * l.slots, kFinishWarps)),
                          kFinishWarps * 32, stream, cptr<T>(partial), ptr<T>(dw), with_bias ? ptr<T>(db) : nullptr,
                          g.k, l.slots, taps, l.chunks);
  });
}

}  // namespace tandem::gpu
