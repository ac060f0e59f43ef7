#pragma once
// Per-channel reductions and maps over a channels-last tensor, read as [rows, C] with rows =
// N * H * W: the counterparts of channel_reduce.cuh's [N, C, HW] kernels, with the same partial
// layout and finish kernels.
#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "kernels/cuda/channel_reduce.cuh"

namespace tandem::gpu {

// ---- channels-last: [rows, C] with rows = N * H * W (Note [memory formats] in core/tensor.h) ----
//
// Note [channels-last channel reductions]: the channels of one pixel are adjacent, so a thread
// takes VEC consecutive channels of a row -- a 16-byte vector for a large tensor whose C and
// pointers allow it (with_last_vec), else one element -- and a block takes `lanes` such vectors
// side by side, a tile of lanes * VEC channels, and kSplitBlock / lanes rows of it at a time: a
// warp reads whole rows of the tile, lanes * VEC contiguous elements each. As in the NCHW kernels,
// the rows are cut into `splits` groups, one block per (channel tile, group). Each thread sums its
// rows in order, a batch of them (last_batch_rows) loaded together, the next batch's loads in
// flight while it adds one (Note [rows in flight]); the block's row slots are then added channel
// by channel in a fixed order, and the same finish kernels add a channel's groups in index order:
// deterministic, no atomics. The split is a ChannelSplit with n = rows and hw = 1, so
// partial[(c * splits + s) * M + m] and the finish kernels are those of the NCHW layout. The vector
// width is part of the order of the additions (it sets the tile and the row slots), so two
// reductions that must agree bit for bit use the same one (Note [a per-channel map that sums its
// output]).
//
// Note [a thread's sums in float]: a thread adds its own rows of a 16-bit tensor (bfloat16,
// half) in float, and only the block's and the finish kernel's additions of those per-thread
// sums are in double. A 16-bit element carries 8 or 11 significant bits and is exact in float,
// and a thread adds a few dozen rows in ResNet-18's training step (a split of about two blocks
// per multiprocessor over the rows of a 256-image batch): the rounding of its float sum is far
// below the element's own. In double, every element was converted to double and added at
// double's rate, a fraction of float's on sm_90; in float, ResNet-18's statistics passes took
// 165 us of its step instead of 172 (bf16, H200). 32- and 64-bit tensors are summed in double
// throughout, as the CPU does. Like the vector width, the type is part of the order and
// rounding of the sums: the reductions that must agree bit for bit (Note [a per-channel map that
// sums its output]) use thread_sum_t of the same T.
template <typename T>
using thread_sum_t = std::conditional_t<sizeof(T) == 2, float, double>;

constexpr int kLastMaxLanes = 32;

// Rows in a batch of for_rows_last, for `bytes` loaded per row and `budget` bytes a batch, 1 to 8.
// The reductions pipeline their batches (Note [rows in flight]) at 64 bytes a batch (one 16-byte
// input: 4 rows; two: 2; three or more: 1), one to two batches in flight: each row's loads take
// registers twice, for the batch being added and the one in flight, and with 96 bytes a batch
// the 8-channel gradient sums of 16-bit tensors spilled at the 128 registers that two blocks a
// multiprocessor allow. The reductions of one channel a thread (a tensor too small for the
// vectors), and the dx passes that sum their output (channel_map_sum_last_kernel), which hold
// their channels' coefficients besides and run near the copy's bandwidth already, take one
// batch at a time, 96 bytes: pipelined, the former needed up to 124 registers instead of 72,
// and the GPU would hold two of their blocks a multiprocessor instead of three.
constexpr int last_batch_rows(size_t bytes, size_t budget) {
  const size_t u = budget / bytes;
  return u < 1 ? 1 : u > 8 ? 8 : static_cast<int>(u);
}
constexpr size_t kLastPipelinedBatch = 64, kLastBatch = 96;

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

// Blocks per multiprocessor the vector kernels' split aims at: 2 (what their registers allow
// at once; ResNet-18's step ran 75.5k images/s with it against 73.7k with 4 and 73.0k with 3,
// H100), or TANDEM_LAST_SPLIT_BLOCKS (1 to 16) to measure another split -- which also changes
// the order of the additions, the same way for every reduction that must agree.
inline int64_t last_vector_blocks_per_sm() {
  static const int64_t blocks = [] {
    const char* v = std::getenv("TANDEM_LAST_SPLIT_BLOCKS");
    if (v == nullptr || v[0] == '\0') return int64_t{2};
    const long b = std::strtol(v, nullptr, 10);
    TANDEM_CHECK(b >= 1 && b <= 16, Value, "TANDEM_LAST_SPLIT_BLOCKS=", v, ": expected a whole number from 1 to 16");
    return static_cast<int64_t>(b);
  }();
  return blocks;
}

// Vectors: about last_vector_blocks_per_sm() blocks per multiprocessor in all, each thread at
// least kLastRowsPerThread rows. One channel per thread: about four blocks per multiprocessor,
// at least ~4K elements per block.
inline ChannelSplit channel_split_last(int64_t rows, int64_t c, int vec = 1) {
  ChannelSplit g{rows, c, 1, 1, rows, vec, last_lanes(c, vec)};
  if (rows == 0 || c == 0) return g;
  const int64_t tile = int64_t{g.lanes} * vec;
  const int64_t tiles = (c + tile - 1) / tile;
  const int64_t by_blocks = ((vec > 1 ? last_vector_blocks_per_sm() : 4) * 132 + tiles - 1) / tiles;
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
// rows per thread not hiding the double-precision sums at the vector kernels' occupancy. That
// was before a thread's sums of 16-bit elements went to float (Note [a thread's sums in float]);
// TANDEM_LAST_VECTOR_ELEMENTS (a whole number, 0: vectors always) measures another threshold.
inline int64_t last_vector_elements() {
  static const int64_t n = [] {
    const char* v = std::getenv("TANDEM_LAST_VECTOR_ELEMENTS");
    if (v == nullptr || v[0] == '\0') return int64_t{1} << 22;
    char* end = nullptr;
    const long long e = std::strtoll(v, &end, 10);
    TANDEM_CHECK(end != v && *end == '\0' && e >= 0, Value, "TANDEM_LAST_VECTOR_ELEMENTS=", v,
                 ": expected a whole number of elements, 0 or more");
    return static_cast<int64_t>(e);
  }();
  return n;
}

// Calls f(std::integral_constant<int, VEC>): VEC = channel_vec<T>(c, p...) for a channels-last
// tensor of `numel` >= last_vector_elements() elements and C channels, else 1.
template <typename T, typename F, typename... P>
void with_last_vec(int64_t numel, int64_t c, F f, const P*... p) {
  if (numel >= last_vector_elements()) {
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

// Calls add(i, load(i)) for this thread's rows of group s, i = row * C + c0, rows in order, in
// batches of U rows loaded together before the first of them is added. The last batch may hold
// fewer than U (a thread's rows are rarely a multiple of U; taken one by one they would each wait
// for their load alone).
//
// Note [rows in flight]: with Pipelined, a batch's loads are issued before the batch before it
// is added, so that a thread has U to 2U rows in flight all the way through instead of U, then
// none while it adds them, then U again: a reduction over ResNet-18's activations gives each
// thread a few dozen rows (the first stage's statistics: ~24), and with the batches one after
// another each of them waited a whole memory latency with the multiprocessor's load slots idle
// before the next was issued. A store that add() makes (a map that sums its output, the join's
// mask) goes to the row it has just read, so the next batch's loads, of other rows, may go
// first. The order of the additions is that of the rows either way.
template <int U, bool Pipelined, typename Load, typename Add>
__device__ __forceinline__ void for_rows_last(const ChannelSplit& g, int64_t c0, int64_t s, Load load, Add add) {
  using Loaded = decltype(load(int64_t{0}));
  const int64_t step = kSplitBlock / g.lanes;
  const int64_t r0 = s * g.per, r1 = r0 + g.per < g.n ? r0 + g.per : g.n;
  int64_t row = r0 + static_cast<int64_t>(threadIdx.x) / g.lanes;
  if constexpr (Pipelined) {
    // Rows first, first + step, ... of a batch, those below r1.
    const auto load_batch = [&](Loaded (&v)[U], int64_t first) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (first + u * step < r1) v[u] = load((first + u * step) * g.c + c0);
      }
    };
    const auto add_batch = [&](const Loaded (&v)[U], int64_t first) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (first + u * step < r1) add((first + u * step) * g.c + c0, v[u]);
      }
    };
    if (row >= r1) return;
    Loaded v[U], next[U];
    load_batch(v, row);
    for (;;) {
      const int64_t after = row + U * step;
      if (after < r1) load_batch(next, after);  // in flight while this batch is added
      add_batch(v, row);
      if (after >= r1) return;
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = next[u];
      row = after;
    }
  } else {
    for (; row + (U - 1) * step < r1; row += U * step) {
      Loaded v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = load((row + u * step) * g.c + c0);
#pragma unroll
      for (int u = 0; u < U; ++u) add((row + u * step) * g.c + c0, v[u]);
    }
    if (row < r1) {  // fewer than U rows left (never with U = 1): loaded together, added in order
      Loaded v[U > 1 ? U - 1 : 1];
#pragma unroll
      for (int u = 0; u < U - 1; ++u) {
        if (row + u * step < r1) v[u] = load((row + u * step) * g.c + c0);
      }
#pragma unroll
      for (int u = 0; u < U - 1; ++u) {
        if (row + u * step < r1) add((row + u * step) * g.c + c0, v[u]);
      }
    }
  }
}

// partial[(c * splits + s) * M + m] = the block's sums of channel c, sums[k][m] of each thread
// for its channel c0 + k, added row slot by row slot in a fixed order. Every thread of the block
// calls it (it synchronizes), c0 >= g.c included.
template <int VEC, int M, typename S>
__device__ __forceinline__ void store_partials_last(const S (&sums)[VEC][M], const ChannelSplit& g, int64_t s,
                                                    double* partial) {
  __shared__ double shared[kSplitBlock * VEC];
  const int t = static_cast<int>(threadIdx.x);
  const int tile = g.lanes * VEC;  // thread t < tile finishes channel t of the tile
  const int64_t c = static_cast<int64_t>(blockIdx.x) * tile + t;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m > 0) __syncthreads();  // the previous sums are read
#pragma unroll
    for (int k = 0; k < VEC; ++k) shared[t * VEC + k] = static_cast<double>(sums[k][m]);
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
// a.load(i) reads element i (= row * C + c0) of every input and nothing else (the loads of
// several rows are issued before the first add), a.add(i, loaded, sums) adds it into
// sums[k][0..M) of channel c0 + k, sums of Acc::sum_type (Note [a thread's sums in float]),
// and writes what it writes there: a store between two loads would keep the compiler from
// issuing the later load first (the pointers may alias), one row in flight at a time.
// Launch with split_grid_last(g) and kSplitBlock threads, g = channel_split_last(rows, C, VEC).
template <int VEC, int M, typename Acc>
__global__ void __launch_bounds__(kSplitBlock, 2) channel_partials_last(ChannelSplit g, Acc acc, double* partial) {
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
  const int64_t c0 = last_first_channel(g), s = blockIdx.y;
  typename Acc::sum_type sums[VEC][M] = {};
  if (c0 < g.c) {
    const auto a = acc.template at<VEC>(c0);
    constexpr bool kPipelined = VEC > 1;  // Note [rows in flight]
    constexpr size_t kBatch = kPipelined ? kLastPipelinedBatch : kLastBatch;
    constexpr int U = last_batch_rows(sizeof(decltype(a.load(int64_t{0}))), kBatch);
    for_rows_last<U, kPipelined>(
        g, c0, s, [&](int64_t i) { return a.load(i); },
        [&](int64_t i, const auto& v) { a.add(i, v, sums); });
  }
  store_partials_last<VEC, M>(sums, g, s, partial);
}

// sums[k][0] += x[i + k]: the partials of channel_sum_finish.
template <typename T>
struct SumLast {
  using sum_type = thread_sum_t<T>;
  const T* x;
  template <int VEC>
  struct Channels {
    const T* x;
    __device__ Vec<T, VEC> load(int64_t i) const { return load_vec<VEC>(x, i); }
    __device__ void add(int64_t, const Vec<T, VEC>& v, sum_type (&sums)[VEC][1]) const {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sums[k][0] += static_cast<sum_type>(v.v[k]);
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
    launch_after_previous(channel_partials_last<vec.value, M, Acc>, split_grid_last(g), kSplitBlock, stream, g, acc,
                          ptr<double>(partial));
  }, p...);
  return g;
}

// out[i] = f(f.coef_of(c), in[i]...) over channels-last [rows, C] tensors, c = i % C; 16-byte
// vectors when C is a multiple of the vector (a vector then holds VEC consecutive channels of
// one pixel). When the grid's stride is a multiple of the C / VEC vectors of a pixel, a
// thread's vectors all hold the same channels, and it loads their coefficients once (Note
// [per-channel maps]); the launch sizes the grid so (one wave of blocks, each thread looping),
// and such a thread loads four vectors of every input before it stores the first result (four
// loads in flight, not one; the last fewer than four together too).
template <int VEC, typename Index, typename F, typename Out, typename... In>
__global__ void channel_map_last_kernel(Index vecs, Index channel_vecs, F f, Out* out, const In*... in) {
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
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
    constexpr int U = 4;
    for (; v + (U - 1) * step < vecs; v += U * step) {  // all U read before any is written
      Vec<Out, VEC> o[U];
#pragma unroll
      for (int u = 0; u < U; ++u) o[u] = compute(coef, reinterpret_cast<const Vec<In, VEC>*>(in)[v + u * step]...);
#pragma unroll
      for (int u = 0; u < U; ++u) reinterpret_cast<Vec<Out, VEC>*>(out)[v + u * step] = o[u];
    }
    if (v < vecs) {  // fewer than U left: read together too
      Vec<Out, VEC> o[U - 1];
#pragma unroll
      for (int u = 0; u < U - 1; ++u) {
        if (v + u * step < vecs) o[u] = compute(coef, reinterpret_cast<const Vec<In, VEC>*>(in)[v + u * step]...);
      }
#pragma unroll
      for (int u = 0; u < U - 1; ++u) {
        if (v + u * step < vecs) reinterpret_cast<Vec<Out, VEC>*>(out)[v + u * step] = o[u];
      }
    }
  } else {
    for (; v < vecs; v += step) {
      load(v);
      run(coef, v);
    }
  }
}

// Note [a map's grid in one wave]: the map's threads loop over the tensor, so its grid need be no
// larger than what the GPU holds at once -- but what it holds depends on the kernel. A batch
// norm's apply with its coefficients for eight channels, four vectors in flight and the
// shortcut's join needs 72-96 registers a thread, so an H100 holds two or three of its blocks
// per multiprocessor, not the eight one_wave_blocks() counts. Sized by that count, a small
// activation (ResNet-18's 512 channels at 4x4: 262K vectors) gave each thread one vector, in
// three or four waves of blocks one after the other, each loading its coefficients for that one
// vector: 11-14 us for 4 MB. The grid is now what the kernel's occupancy holds
// (resident_blocks): one wave, each thread a few vectors (2.6 to 3.9 on that layer), loaded
// together, the same values. Measured on an H100 (bench_bn, the replayed passes): that layer's
// forward with the join 20.3 -> 15.3 us, the 7x7x256 one's 23.9 -> 19.1; ResNet-18's step
// 1.010x.
template <typename T, typename F, typename... In>
void channel_map_last(const F& f, T* out, int64_t n, int64_t c, cudaStream_t stream, const In*... in) {
  if (n == 0) return;
  with_channel_vec<T>(c, [&](auto vec) {
    constexpr int V = vec.value;
    const int64_t vecs = n / V;
    const auto grid_of = [&](int64_t resident) {
      return static_cast<unsigned>(std::min<int64_t>(grid_for(vecs), resident));
    };
    if (n <= static_cast<int64_t>(INT32_MAX)) {
      constexpr auto kernel = channel_map_last_kernel<V, uint32_t, F, T, In...>;
      launch_after_previous(kernel, grid_of(resident_blocks<kernel>()), kBlock, stream, static_cast<uint32_t>(vecs),
                            static_cast<uint32_t>(c / V), f, out, in...);
    } else {
      constexpr auto kernel = channel_map_last_kernel<V, int64_t, F, T, In...>;
      launch_after_previous(kernel, grid_of(resident_blocks<kernel>()), kBlock, stream, vecs, c / V, f, out, in...);
    }
  }, static_cast<const T*>(out), in...);
}

}  // namespace tandem::gpu
