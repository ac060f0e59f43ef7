#pragma once
// Per-channel reductions over a contiguous [N, C, HW] tensor, split across many blocks, and
// the per-channel maps (their channels-last counterparts: channel_reduce_last.cuh; either
// format, chosen from the tensor: channel_any.cuh).
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

// The warp's channel in a finish kernel (g.c or more: the warp has none).
__device__ __forceinline__ int64_t finish_channel_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

// The warp's channel (finish_channel_index), and the sums over the groups of the M partials of
// that channel, partial[(c * splits + s) * M + m], in lane 0. A finish kernel that needs other
// per-channel values loads them before it calls this, so that those loads are in flight with
// the partials' rather than after them.
template <int M>
__device__ __forceinline__ int64_t finish_channel(const double* partial, const ChannelSplit& g, double (&sums)[M]) {
  const int64_t c = finish_channel_index();
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

// out[c] = sum of partial[c * splits .. + splits) (Note [finishing a split reduction]), rounded to
// T; stored as S (a wider type: the same value, Note [the conv bias's gradient in float32] in
// kernels/cuda/batchnorm_backward.cu).
template <typename T, typename S = T>
__global__ void channel_sum_finish(const double* partial, S* out, ChannelSplit g) {
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
  double sums[1];
  const int64_t c = finish_channel<1>(partial, g, sums);
  if (c < g.c && threadIdx.x % 32 == 0) out[c] = static_cast<S>(static_cast<T>(sums[0]));
}

inline dim3 split_grid(const ChannelSplit& g) {
  return dim3(static_cast<unsigned>(g.c), static_cast<unsigned>(g.splits));
}

}  // namespace tandem::gpu
