#pragma once
// Per-channel reductions over a contiguous [N, C, HW] tensor, split across many blocks, and
// their channels-last counterparts over [N * HW, C] (at the end).
//
// Note [split channel reductions]: one block per channel leaves most of the GPU idle when C is
// small (64 channels on 132 multiprocessors) and makes each block stream megabytes alone. So a
// channel's N images are cut into `splits` groups; block (c, s) reduces group s of channel c
// into partial[c * splits + s], and a second small kernel adds the partials of each channel in
// index order. The order of every addition depends only on the shapes: deterministic, no
// atomics (Note [deterministic reductions]). Both kinds of kernel read 16-byte vectors when
// HW allows (channel_vec): a warp then moves 512 bytes per load instead of 128.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/map.cuh"

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

// Elements per vector load for per-channel work over [N, C, HW]: 16 bytes of T when HW is a
// multiple of it and every pointer is aligned to it (a vector then never straddles two
// channels), else 1.
template <typename T, typename... P>
int channel_vec(int64_t hw, const P*... p) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  return hw % V == 0 && (vec_aligned<T, V>(p) && ...) ? V : 1;
}

// Calls f(std::integral_constant<int, VEC>) with VEC = channel_vec<T>(hw, p...): launches a
// kernel templated on the vector width.
template <typename T, typename F, typename... P>
void with_channel_vec(int64_t hw, F f, const P*... p) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  if (channel_vec<T>(hw, p...) == V) {
    f(std::integral_constant<int, V>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

template <int VEC, typename T>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p, int64_t off) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p + off);
}

// Calls f(offset) for this thread's vectors of VEC elements of channel c in image group s
// (VEC divides hw). Consecutive threads read consecutive vectors: coalesced.
template <int VEC, typename F>
__device__ __forceinline__ void for_channel_group(const ChannelSplit& g, int64_t c, int64_t s, F f) {
  const int64_t n0 = s * g.per;
  const int64_t n1 = n0 + g.per < g.n ? n0 + g.per : g.n;
  const int64_t hw = g.hw / VEC;  // vectors per plane
  const int64_t count = (n1 - n0) * hw;
  const int64_t block = blockDim.x;
  const int64_t step_img = block / hw, step_pos = block - step_img * hw;
  int64_t img = n0 + threadIdx.x / hw, pos = threadIdx.x % hw;
  for (int64_t i = threadIdx.x; i < count; i += block) {
    f(((img * g.c + c) * hw + pos) * VEC);
    img += step_img;
    pos += step_pos;
    if (pos >= hw) {
      pos -= hw;
      ++img;
    }
  }
}

// Note [per-channel maps]: the functor f of a per-channel map has two parts: f.coef_of(c) loads
// what channel c needs from memory (a bias, or a batch norm's scale and shift), and
// f(coef, x...) computes one element from it in registers. The kernels load a channel's
// coefficients once per vector (NCHW: a vector lies in one channel) or, channels-last, once
// per thread for the whole loop: there the VEC elements of a vector are VEC different
// channels, and loading the coefficients of each element in the loop made 32 scattered loads
// per 16-byte vector -- a warp touching eight cache lines for each -- which kept a batch norm
// backward at half the memory bandwidth.
//
// out[i] = f(f.coef_of(c), in[i]...) over contiguous [N, C, HW] tensors, c the channel of element
// i: a flat grid-stride loop over vectors of VEC elements (VEC divides HW, so one division per
// vector finds the channel; Index is 32-bit when the tensor allows it). Every thread has work
// whatever HW is (49 and 16 at the end of a ResNet), unlike a block per (image, channel) plane.
template <int VEC, typename Index, typename F, typename Out, typename... In>
__global__ void channel_map_kernel(Index vecs, Index hw_vecs, Index channels, F f, Out* out, const In*... in) {
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += step) {
    const auto coef = f.coef_of(static_cast<int64_t>((v / hw_vecs) % channels));
    Vec<Out, VEC> o;
    auto apply = [&](const Vec<In, VEC>&... x) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) o.v[k] = f(coef, x.v[k]...);
    };
    apply(reinterpret_cast<const Vec<In, VEC>*>(in)[v]...);
    reinterpret_cast<Vec<Out, VEC>*>(out)[v] = o;
  }
}

template <int VEC, typename Index, typename F, typename Out, typename... In>
void launch_channel_map(cudaStream_t stream, int64_t n, int64_t c, int64_t hw, const F& f, Out* out,
                        const In*... in) {
  const int64_t vecs = n / VEC;
  channel_map_kernel<VEC, Index><<<grid_for(vecs), kBlock, 0, stream>>>(
      static_cast<Index>(vecs), static_cast<Index>(hw / VEC), static_cast<Index>(c), f, out, in...);
  TANDEM_CUDA_CHECK_LAUNCH();
}

// out = f(channel, in...) elementwise for contiguous [N, C, HW] tensors of out's shape (out may
// be one of the inputs), n = N * C * HW elements, on `stream`.
template <typename T, typename F, typename... In>
void channel_map(const F& f, T* out, int64_t n, int64_t c, int64_t hw, cudaStream_t stream, const In*... in) {
  if (n == 0) return;
  const bool narrow = n <= static_cast<int64_t>(INT32_MAX);  // v + grid stride stays below 2^32
  with_channel_vec<T>(hw, [&](auto vec) {
    if (narrow) {
      launch_channel_map<vec.value, uint32_t>(stream, n, c, hw, f, out, in...);
    } else {
      launch_channel_map<vec.value, int64_t>(stream, n, c, hw, f, out, in...);
    }
  }, static_cast<const T*>(out), in...);
}

// partial[c * splits + s] = sum of x over channel c, image group s (in double).
template <int VEC, typename T>
__global__ void channel_sum_partials(const T* x, double* partial, ChannelSplit g) {
  const int64_t c = blockIdx.x, s = blockIdx.y;
  double acc = 0;
  for_channel_group<VEC>(g, c, s, [&](int64_t off) {
    const Vec<T, VEC> v = load_vec<VEC>(x, off);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc += static_cast<double>(v.v[k]);
  });
  acc = block_reduce(acc, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[c * g.splits + s] = acc;
}

// Note [finishing a split reduction]: a channel's `splits` partials are added by one warp:
// lane l takes groups l, l + 32, ... in order, and the lanes are combined by a fixed shuffle
// tree whose result in lane 0 is the one used — deterministic, and a few hundred groups (the
// channels-last split of a stage-1 activation has ~260) cost a few loads per lane instead of
// one thread's serial walk. Launch with finish_grid(g) blocks of kBlock threads; the kernel
// body then runs once per channel, in lane 0 of its warp.
inline unsigned finish_grid(const ChannelSplit& g) {
  return static_cast<unsigned>((g.c * 32 + kBlock - 1) / kBlock);
}

// The warp's channel (g.c or more: the warp has none), and the sums over the groups of the M
// partials of that channel, partial[(c * splits + s) * M + m], in lane 0.
template <int M>
__device__ __forceinline__ int64_t finish_channel(const double* partial, const ChannelSplit& g, double (&sums)[M]) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int m = 0; m < M; ++m) sums[m] = 0;
  if (c >= g.c) return c;  // the whole warp: c is the same for its 32 lanes
  for (int64_t s = lane; s < g.splits; s += 32) {
#pragma unroll
    for (int m = 0; m < M; ++m) sums[m] += partial[(c * g.splits + s) * M + m];
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    for (int off = 16; off > 0; off >>= 1) sums[m] += __shfl_down_sync(0xffffffffu, sums[m], off);
  }
  return c;
}

// out[c] = sum of partial[c * splits .. + splits) (Note [finishing a split reduction]).
template <typename T>
__global__ void channel_sum_finish(const double* partial, T* out, ChannelSplit g) {
  double sums[1];
  const int64_t c = finish_channel<1>(partial, g, sums);
  if (c < g.c && threadIdx.x % 32 == 0) out[c] = static_cast<T>(sums[0]);
}

inline dim3 split_grid(const ChannelSplit& g) {
  return dim3(static_cast<unsigned>(g.c), static_cast<unsigned>(g.splits));
}

// ---- channels-last: [rows, C] with rows = N * H * W (Note [memory formats] in core/tensor.h) ----
//
// Note [channels-last channel reductions]: the channels of one pixel are adjacent, so a block
// takes kLastLanes consecutive channels (lane = channel) and kSplitBlock / kLastLanes rows at a
// time: each warp reads one row's 32 channels, 128 contiguous bytes. As in the NCHW kernels,
// the rows are cut into `splits` groups, one block per (channel tile, group); each thread sums
// its rows in order, the block's rows are added lane by lane in a fixed order, and the same
// finish kernels add a channel's groups in index order: deterministic, no atomics. The split is
// a ChannelSplit with n = rows and hw = 1, so partial[(c * splits + s) * M + m] and the finish
// kernels are those of the NCHW layout.
constexpr int kLastLanes = 32;

inline ChannelSplit channel_split_last(int64_t rows, int64_t c) {
  ChannelSplit g{rows, c, 1, 1, rows};
  if (rows == 0 || c == 0) return g;
  const int64_t tiles = (c + kLastLanes - 1) / kLastLanes;
  const int64_t by_blocks = (4 * 132 + tiles - 1) / tiles;
  const int64_t by_work = std::max<int64_t>(1, rows * std::min<int64_t>(c, kLastLanes) / 4096);
  g.splits = std::max<int64_t>(1, std::min({by_blocks, by_work, rows}));
  g.per = (rows + g.splits - 1) / g.splits;
  g.splits = (rows + g.per - 1) / g.per;
  return g;
}

inline dim3 split_grid_last(const ChannelSplit& g) {
  return dim3(static_cast<unsigned>((g.c + kLastLanes - 1) / kLastLanes), static_cast<unsigned>(g.splits));
}

constexpr int kLastRows = kSplitBlock / kLastLanes;  // rows a block reads at a time

// This thread's channel in a block of split_grid_last(g): lane = channel.
__device__ __forceinline__ int64_t channel_of_lane() {
  return static_cast<int64_t>(blockIdx.x) * kLastLanes + static_cast<int64_t>(threadIdx.x) % kLastLanes;
}

// Calls f(i) for this thread's elements i = row * C + c of channel c in row group s, rows in
// order (c < g.c).
template <typename F>
__device__ __forceinline__ void for_rows_last(const ChannelSplit& g, int64_t c, int64_t s, F f) {
  const int64_t r0 = s * g.per, r1 = r0 + g.per < g.n ? r0 + g.per : g.n;
  for (int64_t row = r0 + static_cast<int64_t>(threadIdx.x) / kLastLanes; row < r1; row += kLastRows) {
    f(row * g.c + c);
  }
}

// partial[(c * splits + s) * M + m] = the block's sums[m] of channel c, added row by row in a
// fixed order. Every thread of the block calls it (it synchronizes), c >= g.c included.
template <int M>
__device__ __forceinline__ void store_partials_last(const double (&sums)[M], const ChannelSplit& g, int64_t c,
                                                    int64_t s, double* partial) {
  const int lane = static_cast<int>(threadIdx.x) % kLastLanes;
  __shared__ double shared[M][kSplitBlock];
#pragma unroll
  for (int m = 0; m < M; ++m) shared[m][threadIdx.x] = sums[m];
  __syncthreads();
  if (threadIdx.x < kLastLanes && c < g.c) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      double t = 0;
      for (int k = 0; k < kLastRows; ++k) t += shared[m][k * kLastLanes + lane];
      partial[(c * g.splits + s) * M + m] = t;
    }
  }
}

// M partial sums per (channel, row group): acc.at(c) loads what channel c needs once (a thread
// keeps its channel, Note [per-channel maps]) and returns a functor a, and a(i, sums) adds
// element i (= row * C + c) into sums[0..M). Launch with split_grid_last(g) and kSplitBlock
// threads.
template <int M, typename Acc>
__global__ void channel_partials_last(ChannelSplit g, Acc acc, double* partial) {
  const int64_t c = channel_of_lane(), s = blockIdx.y;
  double sums[M];
#pragma unroll
  for (int m = 0; m < M; ++m) sums[m] = 0;
  if (c < g.c) {
    const auto a = acc.at(c);
    for_rows_last(g, c, s, [&](int64_t i) { a(i, sums); });
  }
  store_partials_last<M>(sums, g, c, s, partial);
}

// sums[0] += x[i]: the partials of channel_sum_finish.
template <typename T>
struct SumLast {
  const T* x;
  __device__ const SumLast& at(int64_t) const { return *this; }  // nothing per channel
  __device__ void operator()(int64_t i, double* sums) const { sums[0] += static_cast<double>(x[i]); }
};

// out[i] = f(f.coef_of(c), in[i]...) over channels-last [rows, C] tensors, c = i % C; 16-byte
// vectors when C is a multiple of the vector (a vector then holds VEC consecutive channels of
// one pixel). When the grid's stride is a multiple of the C / VEC vectors of a pixel, a
// thread's vectors all hold the same channels, and it loads their coefficients once (Note
// [per-channel maps]); the launch sizes the grid so (one wave of blocks, each thread looping).
template <int VEC, typename Index, typename F, typename Out, typename... In>
__global__ void channel_map_last_kernel(Index vecs, Index channel_vecs, F f, Out* out, const In*... in) {
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  using Coef = decltype(f.coef_of(int64_t{0}));
  auto run = [&](const Coef (&coef)[VEC], Index at) {
    Vec<Out, VEC> o;
    auto apply = [&](const Vec<In, VEC>&... x) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) o.v[k] = f(coef[k], x.v[k]...);
    };
    apply(reinterpret_cast<const Vec<In, VEC>*>(in)[at]...);
    reinterpret_cast<Vec<Out, VEC>*>(out)[at] = o;
  };
  Coef coef[VEC];
  auto load = [&](Index at) {
    const int64_t c0 = static_cast<int64_t>(at % channel_vecs) * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) coef[k] = f.coef_of(c0 + k);
  };
  if (step % channel_vecs == 0) {
    load(v);  // c0 < C also for a thread past the end: the loads stay in bounds
    for (; v < vecs; v += step) run(coef, v);
  } else {
    for (; v < vecs; v += step) {
      load(v);
      run(coef, v);
    }
  }
}

template <typename T, typename F, typename... In>
void channel_map_last(const F& f, T* out, int64_t n, int64_t c, cudaStream_t stream, const In*... in) {
  if (n == 0) return;
  with_channel_vec<T>(c, [&](auto vec) {
    constexpr int V = vec.value;
    const int64_t vecs = n / V;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(grid_for(vecs), one_wave_blocks()));
    if (n <= static_cast<int64_t>(INT32_MAX)) {
      channel_map_last_kernel<V, uint32_t><<<grid, kBlock, 0, stream>>>(
          static_cast<uint32_t>(vecs), static_cast<uint32_t>(c / V), f, out, in...);
    } else {
      channel_map_last_kernel<V, int64_t><<<grid, kBlock, 0, stream>>>(vecs, c / V, f, out, in...);
    }
    TANDEM_CUDA_CHECK_LAUNCH();
  }, static_cast<const T*>(out), in...);
}

// Per-channel elementwise work on a [N, C, H, W] tensor `like` (contiguous or channels-last;
// out and in... in the same format): channel_map or channel_map_last.
template <typename T, typename F, typename... In>
void channel_map_any(const Tensor& like, const F& f, T* out, cudaStream_t stream, const In*... in) {
  const int64_t n = like.numel(), c = like.size(1);
  if (n == 0) return;
  if (like.is_contiguous()) {
    channel_map(f, out, n, c, n / (like.size(0) * c), stream, in...);
  } else {
    channel_map_last(f, out, n, c, stream, in...);
  }
}

// ---- per-channel sums of a [N, C, H, W] or [N, C] tensor in either format ----

// Whether per-channel work reads t as channels-last [N * H * W, C] (Note [memory formats]):
// a tensor that is also contiguous (C = 1, 1x1 pixels) is read as [N, C, HW].
inline bool channels_last_of(const Tensor& t) { return !t.is_contiguous(); }

// The split of per-channel work over t: a function of its shape and format alone.
inline ChannelSplit channel_split_of(const Tensor& t) {
  const int64_t n = t.size(0), c = t.size(1);
  if (channels_last_of(t)) return channel_split_last(c == 0 ? 0 : t.numel() / c, c);
  return channel_split(n, c, n * c == 0 ? 0 : t.numel() / (n * c));
}

// out[c] = the sum of channel c of x, in double and rounded once: channel_sum_partials (or
// channel_partials_last with SumLast) and channel_sum_finish over channel_split_of(x). A
// convolution's bias gradient (x = dy).
template <typename T>
void channel_sum_any(const Tensor& x, T* out, cudaStream_t stream) {
  const ChannelSplit g = channel_split_of(x);
  Tensor partial = empty({g.c * g.splits}, kFloat64, x.device());
  if (channels_last_of(x)) {
    channel_partials_last<1><<<split_grid_last(g), kSplitBlock, 0, stream>>>(g, SumLast<T>{cptr<T>(x)},
                                                                             ptr<double>(partial));
  } else {
    with_channel_vec<T>(g.hw, [&](auto vec) {
      channel_sum_partials<vec.value, T><<<split_grid(g), kSplitBlock, 0, stream>>>(cptr<T>(x),
                                                                                   ptr<double>(partial), g);
    }, cptr<T>(x));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
  channel_sum_finish<T><<<finish_grid(g), kBlock, 0, stream>>>(cptr<double>(partial), out, g);
  TANDEM_CUDA_CHECK_LAUNCH();
}

// Note [a per-channel map that sums its output]: channel_map_sum_any writes out = f(coef, in...)
// as channel_map_any does and, in the same pass, sums what it writes per channel -- the
// rounded T values, in double -- in exactly the order channel_sum_any would add them reading
// out afterwards: the same split (channel_split_of), the same vector width (that of out alone,
// so an input at an offset that breaks those vectors is read element by element), the same
// per-thread walk (for_channel_group, for_rows_last), the same block and finish reductions. So
// the sum is bit for bit channel_sum_any(out), without that second pass over out (Note [conv
// bias in batch norm] in batchnorm.cu). Being a reduction, it runs on the split grid
// rather than the flat grid-stride loop of channel_map.

// A vector of VEC elements at p + off: one vector load when p is aligned to it, else VEC loads.
template <int VEC, typename T>
__device__ __forceinline__ Vec<T, VEC> load_vec_or_elements(const T* p, int64_t off, bool aligned) {
  if (aligned) return load_vec<VEC>(p, off);
  Vec<T, VEC> v;
#pragma unroll
  for (int k = 0; k < VEC; ++k) v.v[k] = p[off + k];
  return v;
}

// [N, C, HW]: block (c, s) maps channel c's image group s and writes its sum to
// partial[c * splits + s], as channel_sum_partials<VEC> sums it. `aligned`: every input is
// aligned to the vectors (out always is).
template <int VEC, typename F, typename T, typename... In>
__global__ void channel_map_sum_kernel(F f, T* out, double* partial, ChannelSplit g, bool aligned,
                                       const In*... in) {
  const int64_t c = blockIdx.x, s = blockIdx.y;
  const auto coef = f.coef_of(c);
  double acc = 0;
  for_channel_group<VEC>(g, c, s, [&](int64_t off) {
    Vec<T, VEC> o;
    auto apply = [&](const Vec<In, VEC>&... x) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) o.v[k] = f(coef, x.v[k]...);
    };
    apply(load_vec_or_elements<VEC>(in, off, aligned)...);
    *reinterpret_cast<Vec<T, VEC>*>(out + off) = o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc += static_cast<double>(o.v[k]);
  });
  acc = block_reduce(acc, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[c * g.splits + s] = acc;
}

// Channels-last [rows, C]: as channel_partials_last<1> with SumLast over out; the thread's
// channel's coefficients are loaded once (Note [per-channel maps]).
template <typename F, typename T, typename... In>
__global__ void channel_map_sum_last_kernel(F f, T* out, double* partial, ChannelSplit g, const In*... in) {
  const int64_t c = channel_of_lane(), s = blockIdx.y;
  double sums[1] = {0};
  if (c < g.c) {
    const auto coef = f.coef_of(c);
    for_rows_last(g, c, s, [&](int64_t i) {
      const T o = f(coef, in[i]...);
      out[i] = o;
      sums[0] += static_cast<double>(o);
    });
  }
  store_partials_last<1>(sums, g, c, s, partial);
}

// channel_map_any(like, f, out, stream, in...) and sum[c] = channel_sum_any(out)[c], in one
// pass (Note [a per-channel map that sums its output]). out and in... in like's format.
template <typename T, typename F, typename... In>
void channel_map_sum_any(const Tensor& like, const F& f, T* out, T* sum, cudaStream_t stream, const In*... in) {
  const ChannelSplit g = channel_split_of(like);
  Tensor partial = empty({g.c * g.splits}, kFloat64, like.device());
  if (channels_last_of(like)) {
    channel_map_sum_last_kernel<<<split_grid_last(g), kSplitBlock, 0, stream>>>(
        f, out, ptr<double>(partial), g, in...);
  } else {
    with_channel_vec<T>(g.hw, [&](auto vec) {
      const bool aligned = channel_vec<T>(g.hw, static_cast<const T*>(out), in...) == vec.value;
      channel_map_sum_kernel<vec.value><<<split_grid(g), kSplitBlock, 0, stream>>>(
          f, out, ptr<double>(partial), g, aligned, in...);
    }, static_cast<const T*>(out));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
  channel_sum_finish<T><<<finish_grid(g), kBlock, 0, stream>>>(cptr<double>(partial), sum, g);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::gpu
