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
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/map.cuh"

namespace tandem::gpu {

constexpr int kSplitBlock = 256;  // threads of a partial-reduction block

struct ChannelSplit {
  int64_t n = 0, c = 0, hw = 0;
  int64_t splits = 1;  // groups of images per channel
  int64_t per = 0;     // images per group (the last may have fewer)
  int vec = 1;         // channels-last: channels per thread (Note [channels-last channel reductions])
  int lanes = 32;      // channels-last: vectors side by side in a block
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
// Note [channels-last channel reductions]: the channels of one pixel are adjacent, so a thread
// takes VEC consecutive channels of a row -- a 16-byte vector for a large tensor whose C and
// pointers allow it (with_last_vec), else one element -- and a block takes `lanes` such vectors
// side by side, a tile of lanes * VEC channels, and kSplitBlock / lanes rows of it at a time: a
// warp reads whole rows of the tile, lanes * VEC contiguous elements each. As in the NCHW kernels,
// the rows are cut into `splits` groups, one block per (channel tile, group). Each thread sums its
// rows in order, loading a few of them (last_unroll) before it adds the first, so that several
// loads are in flight per thread rather than one; the block's row slots are then added channel by
// channel in a fixed order, and the same finish kernels add a channel's groups in index order:
// deterministic, no atomics. The split is a ChannelSplit with n = rows and hw = 1, so
// partial[(c * splits + s) * M + m] and the finish kernels are those of the NCHW layout. The vector
// width is part of the order of the additions (it sets the tile and the row slots), so two
// reductions that must agree bit for bit use the same one (Note [a per-channel map that sums its
// output]).
constexpr int kLastMaxLanes = 32;

// Rows a thread loads before it adds the first, for `bytes` loaded per row: about 96 bytes in
// flight per thread, 2 to 8 rows (one 16-byte input: 6; three: 2).
constexpr int last_unroll(size_t bytes) {
  const size_t u = 96 / bytes;
  return u < 2 ? 2 : u > 8 ? 8 : static_cast<int>(u);
}

// Rows a thread walks in a row group at least, where the rows allow: fewer, and a block's fixed
// work (its channels' coefficients, the reduction of its row slots, the finish kernel's read of
// its partials) outweighs its loads; many more, and a small tensor runs on few blocks whose
// threads wait for one load after another (16 took the statistics of ResNet-18's last stage,
// 4 MB, from 4.6 to 9.1 us on an H100).
constexpr int64_t kLastRowsPerThread = 4;

// Vectors side by side in a block's tile: the largest power of two up to kLastMaxLanes that is
// not above the C / vec vectors of a row (a power of two, so a block is whole rows of it).
inline int last_lanes(int64_t c, int vec) {
  const int64_t vectors = (c + vec - 1) / vec;
  int lanes = 1;
  while (lanes < kLastMaxLanes && lanes * 2 <= vectors) lanes *= 2;
  return lanes;
}

// Vectors: about two blocks per multiprocessor in all (what the vector kernels' registers
// allow), each thread at least kLastRowsPerThread rows. One channel per thread: about four
// blocks per multiprocessor, at least ~4K elements per block.
inline ChannelSplit channel_split_last(int64_t rows, int64_t c, int vec = 1) {
  ChannelSplit g{rows, c, 1, 1, rows, vec, last_lanes(c, vec)};
  if (rows == 0 || c == 0) return g;
  const int64_t tile = int64_t{g.lanes} * vec;
  const int64_t tiles = (c + tile - 1) / tile;
  const int64_t by_blocks = ((vec > 1 ? 2 : 4) * 132 + tiles - 1) / tiles;
  const int64_t by_work = vec > 1 ? rows / (kLastRowsPerThread * (kSplitBlock / g.lanes))
                                  : rows * std::min<int64_t>(c, tile) / 4096;
  g.splits = std::max<int64_t>(1, std::min(by_blocks, by_work));
  g.per = (rows + g.splits - 1) / g.splits;
  g.splits = (rows + g.per - 1) / g.per;
  return g;
}

// Channels-last tensors of at least this many elements are reduced in 16-byte vectors, smaller
// ones one channel per thread. Measured on an H100 in ResNet-18's replayed step (bfloat16): the
// vectors took the largest activations' passes (12.8 M elements) from 26 to 19 us (statistics),
// 38 to 32 (gradient sums) and 86 to 39 (the dx pass that sums dbias), and the 6.4 M ones' dx
// pass from 43 to 22; but the 3.2 M and 2.1 M ones' passes from 4.6-11 to 7-17 us, their few
// rows per thread not hiding the double-precision sums at the vector kernels' occupancy.
constexpr int64_t kLastVectorElements = int64_t{1} << 22;

// Calls f(std::integral_constant<int, VEC>): VEC = channel_vec<T>(c, p...) for a channels-last
// tensor of `numel` >= kLastVectorElements elements and C channels, else 1.
template <typename T, typename F, typename... P>
void with_last_vec(int64_t numel, int64_t c, F f, const P*... p) {
  if (numel >= kLastVectorElements) {
    with_channel_vec<T>(c, f, p...);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

inline dim3 split_grid_last(const ChannelSplit& g) {
  const int64_t tile = int64_t{g.lanes} * g.vec;
  return dim3(static_cast<unsigned>((g.c + tile - 1) / tile), static_cast<unsigned>(g.splits));
}

// This thread's first channel in a block of split_grid_last(g): c0 .. c0 + g.vec, all below C
// when c0 is (C is a multiple of the vector).
__device__ __forceinline__ int64_t last_first_channel(const ChannelSplit& g) {
  return (static_cast<int64_t>(blockIdx.x) * g.lanes + static_cast<int64_t>(threadIdx.x) % g.lanes) * g.vec;
}

// Calls add(i, load(i)) for this thread's rows of group s, i = row * C + c0, rows in order;
// U rows are loaded before the first of them is added.
template <int U, typename Load, typename Add>
__device__ __forceinline__ void for_rows_last(const ChannelSplit& g, int64_t c0, int64_t s, Load load, Add add) {
  const int64_t step = kSplitBlock / g.lanes;
  const int64_t r0 = s * g.per, r1 = r0 + g.per < g.n ? r0 + g.per : g.n;
  int64_t row = r0 + static_cast<int64_t>(threadIdx.x) / g.lanes;
  for (; row + (U - 1) * step < r1; row += U * step) {
    decltype(load(int64_t{0})) v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load((row + u * step) * g.c + c0);
#pragma unroll
    for (int u = 0; u < U; ++u) add((row + u * step) * g.c + c0, v[u]);
  }
  for (; row < r1; row += step) add(row * g.c + c0, load(row * g.c + c0));
}

// partial[(c * splits + s) * M + m] = the block's sums of channel c, sums[k][m] of each thread
// for its channel c0 + k, added row slot by row slot in a fixed order. Every thread of the block
// calls it (it synchronizes), c0 >= g.c included.
template <int VEC, int M>
__device__ __forceinline__ void store_partials_last(const double (&sums)[VEC][M], const ChannelSplit& g, int64_t s,
                                                    double* partial) {
  __shared__ double shared[kSplitBlock * VEC];
  const int t = static_cast<int>(threadIdx.x);
  const int tile = g.lanes * VEC;  // thread t < tile finishes channel t of the tile
  const int64_t c = static_cast<int64_t>(blockIdx.x) * tile + t;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m > 0) __syncthreads();  // the previous sums are read
#pragma unroll
    for (int k = 0; k < VEC; ++k) shared[t * VEC + k] = sums[k][m];
    __syncthreads();
    if (t < tile && c < g.c) {
      double sum = 0;
      for (int q = 0; q < kSplitBlock / g.lanes; ++q) sum += shared[q * tile + t];
      partial[(c * g.splits + s) * M + m] = sum;
    }
  }
}

// M partial sums per (channel, row group). acc.at<VEC>(c0) loads what channels c0 .. c0 + VEC
// need once (a thread keeps its channels, Note [per-channel maps]) and returns a functor a:
// a.load(i) reads element i (= row * C + c0) of every input, a.add(loaded, sums) adds it into
// sums[k][0..M) of channel c0 + k. Launch with split_grid_last(g) and kSplitBlock threads,
// g = channel_split_last(rows, C, VEC).
template <int VEC, int M, typename Acc>
__global__ void __launch_bounds__(kSplitBlock, 2) channel_partials_last(ChannelSplit g, Acc acc, double* partial) {
  const int64_t c0 = last_first_channel(g), s = blockIdx.y;
  double sums[VEC][M] = {};
  if (c0 < g.c) {
    const auto a = acc.template at<VEC>(c0);
    constexpr int U = last_unroll(sizeof(decltype(a.load(int64_t{0}))));
    for_rows_last<U>(g, c0, s, [&](int64_t i) { return a.load(i); }, [&](int64_t, const auto& v) { a.add(v, sums); });
  }
  store_partials_last<VEC, M>(sums, g, s, partial);
}

// sums[k][0] += x[i + k]: the partials of channel_sum_finish.
template <typename T>
struct SumLast {
  const T* x;
  template <int VEC>
  struct Channels {
    const T* x;
    __device__ Vec<T, VEC> load(int64_t i) const { return load_vec<VEC>(x, i); }
    __device__ void add(const Vec<T, VEC>& v, double (&sums)[VEC][1]) const {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sums[k][0] += static_cast<double>(v.v[k]);
    }
  };
  template <int VEC>
  __device__ Channels<VEC> at(int64_t) const {
    return {x};  // nothing per channel
  }
};

// Launches channel_partials_last<VEC, M>(g, acc, partial) over `like`'s rows (channels-last
// [N, C, H, W]) at the vector width with_last_vec picks for C and the pointers p; allocates
// `partial` and returns the split for the finish kernel.
template <int M, typename T, typename Acc, typename... P>
ChannelSplit launch_partials_last(const Tensor& like, const Acc& acc, Tensor& partial, cudaStream_t stream,
                                  const P*... p) {
  const int64_t c = like.size(1), rows = c == 0 ? 0 : like.numel() / c;
  ChannelSplit g;
  with_last_vec<T>(like.numel(), c, [&](auto vec) {
    g = channel_split_last(rows, c, vec.value);
    partial = empty({g.c * g.splits * M}, kFloat64, like.device());
    channel_partials_last<vec.value, M><<<split_grid_last(g), kSplitBlock, 0, stream>>>(g, acc, ptr<double>(partial));
  }, p...);
  TANDEM_CUDA_CHECK_LAUNCH();
  return g;
}

// out[i] = f(f.coef_of(c), in[i]...) over channels-last [rows, C] tensors, c = i % C; 16-byte
// vectors when C is a multiple of the vector (a vector then holds VEC consecutive channels of
// one pixel). When the grid's stride is a multiple of the C / VEC vectors of a pixel, a
// thread's vectors all hold the same channels, and it loads their coefficients once (Note
// [per-channel maps]); the launch sizes the grid so (one wave of blocks, each thread looping),
// and such a thread loads two vectors of every input before it stores the first result (two
// loads in flight, not one).
template <int VEC, typename Index, typename F, typename Out, typename... In>
__global__ void channel_map_last_kernel(Index vecs, Index channel_vecs, F f, Out* out, const In*... in) {
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  using Coef = decltype(f.coef_of(int64_t{0}));
  auto compute = [&](const Coef (&coef)[VEC], const Vec<In, VEC>&... x) {
    Vec<Out, VEC> o;
#pragma unroll
    for (int k = 0; k < VEC; ++k) o.v[k] = f(coef[k], x.v[k]...);
    return o;
  };
  auto run = [&](const Coef (&coef)[VEC], Index at) {
    reinterpret_cast<Vec<Out, VEC>*>(out)[at] = compute(coef, reinterpret_cast<const Vec<In, VEC>*>(in)[at]...);
  };
  Coef coef[VEC];
  auto load = [&](Index at) {
    const int64_t c0 = static_cast<int64_t>(at % channel_vecs) * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) coef[k] = f.coef_of(c0 + k);
  };
  if (step % channel_vecs == 0) {
    load(v);  // c0 < C also for a thread past the end: the loads stay in bounds
    constexpr int U = 2;
    for (; v + (U - 1) * step < vecs; v += U * step) {  // all U read before any is written
      Vec<Out, VEC> o[U];
#pragma unroll
      for (int u = 0; u < U; ++u) o[u] = compute(coef, reinterpret_cast<const Vec<In, VEC>*>(in)[v + u * step]...);
#pragma unroll
      for (int u = 0; u < U; ++u) reinterpret_cast<Vec<Out, VEC>*>(out)[v + u * step] = o[u];
    }
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

// The split of per-channel work over t: a function of its shape and format alone, and for
// channels-last of the vector width too (Note [channels-last channel reductions]).
inline ChannelSplit channel_split_of(const Tensor& t, int last_vec = 1) {
  const int64_t n = t.size(0), c = t.size(1);
  if (channels_last_of(t)) return channel_split_last(c == 0 ? 0 : t.numel() / c, c, last_vec);
  return channel_split(n, c, n * c == 0 ? 0 : t.numel() / (n * c));
}

// out[c] = the sum of channel c of x, in double and rounded once: channel_sum_partials (or
// channel_partials_last with SumLast) and channel_sum_finish. A convolution's bias gradient
// (x = dy).
template <typename T>
void channel_sum_any(const Tensor& x, T* out, cudaStream_t stream) {
  ChannelSplit g;
  Tensor partial;
  if (channels_last_of(x)) {
    g = launch_partials_last<1, T>(x, SumLast<T>{cptr<T>(x)}, partial, stream, cptr<T>(x));
  } else {
    g = channel_split_of(x);
    partial = empty({g.c * g.splits}, kFloat64, x.device());
    with_channel_vec<T>(g.hw, [&](auto vec) {
      channel_sum_partials<vec.value, T><<<split_grid(g), kSplitBlock, 0, stream>>>(cptr<T>(x),
                                                                                   ptr<double>(partial), g);
    }, cptr<T>(x));
    TANDEM_CUDA_CHECK_LAUNCH();
  }
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

// The VEC-element vectors of a map's N inputs at one offset (all of the output's type T).
template <typename T, int VEC, int N>
struct InputVecs {
  Vec<T, VEC> v[N > 0 ? N : 1];
};

// o.v[k] = f(coef[k], the inputs' element k...).
template <int VEC, typename F, typename Coef, typename T, int N, size_t... I>
__device__ __forceinline__ Vec<T, VEC> map_vectors(const F& f, const Coef (&coef)[VEC], const InputVecs<T, VEC, N>& in,
                                                   std::index_sequence<I...>) {
  Vec<T, VEC> o;
#pragma unroll
  for (int k = 0; k < VEC; ++k) o.v[k] = f(coef[k], in.v[I].v[k]...);
  return o;
}

// Channels-last [rows, C]: as channel_partials_last<VEC, 1> with SumLast over out; the
// thread's channels' coefficients are loaded once (Note [per-channel maps]). `aligned`: every
// input is aligned to the vectors (out always is).
template <int VEC, typename F, typename T, typename... In>
__global__ void __launch_bounds__(kSplitBlock, 2)
    channel_map_sum_last_kernel(F f, T* out, double* partial, ChannelSplit g, bool aligned, const In*... in) {
  static_assert((std::is_same_v<In, T> && ...), "the inputs have the output's type");
  constexpr int N = static_cast<int>(sizeof...(In));
  const int64_t c0 = last_first_channel(g), s = blockIdx.y;
  double sums[VEC][1] = {};
  if (c0 < g.c) {
    decltype(f.coef_of(int64_t{0})) coef[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) coef[k] = f.coef_of(c0 + k);
    const auto load = [&](int64_t i) {
      InputVecs<T, VEC, N> l;
      int j = 0;
      ((l.v[j++] = load_vec_or_elements<VEC>(in, i, aligned)), ...);
      return l;
    };
    const auto add = [&](int64_t i, const InputVecs<T, VEC, N>& l) {
      const Vec<T, VEC> o = map_vectors(f, coef, l, std::index_sequence_for<In...>{});
      *reinterpret_cast<Vec<T, VEC>*>(out + i) = o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) sums[k][0] += static_cast<double>(o.v[k]);
    };
    for_rows_last<last_unroll(sizeof(InputVecs<T, VEC, N>))>(g, c0, s, load, add);
  }
  store_partials_last<VEC, 1>(sums, g, s, partial);
}

// channel_map_any(like, f, out, stream, in...) and sum[c] = channel_sum_any(out)[c], in one
// pass (Note [a per-channel map that sums its output]). out and in... in like's format.
template <typename T, typename F, typename... In>
void channel_map_sum_any(const Tensor& like, const F& f, T* out, T* sum, cudaStream_t stream, const In*... in) {
  const bool last = channels_last_of(like);
  ChannelSplit g;
  Tensor partial;
  // The vector width is that of out alone: channel_sum_any(out)'s.
  const auto run = [&](auto vec) {
    g = channel_split_of(like, vec.value);
    partial = empty({g.c * g.splits}, kFloat64, like.device());
    const bool aligned = channel_vec<T>(last ? g.c : g.hw, static_cast<const T*>(out), in...) == vec.value;
    if (last) {
      channel_map_sum_last_kernel<vec.value><<<split_grid_last(g), kSplitBlock, 0, stream>>>(
          f, out, ptr<double>(partial), g, aligned, in...);
    } else {
      channel_map_sum_kernel<vec.value><<<split_grid(g), kSplitBlock, 0, stream>>>(
          f, out, ptr<double>(partial), g, aligned, in...);
    }
  };
  if (last) {
    with_last_vec<T>(like.numel(), like.size(1), run, static_cast<const T*>(out));
  } else {
    with_channel_vec<T>(channel_split_of(like).hw, run, static_cast<const T*>(out));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
  channel_sum_finish<T><<<finish_grid(g), kBlock, 0, stream>>>(cptr<double>(partial), sum, g);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::gpu
