#pragma once
// Per-channel work on a [N, C, H, W] (or [N, C]) tensor in either memory format, the kernels
// picked from the tensor: maps (channel_map or channel_map_last), per-channel sums, and maps
// that sum their output in the same pass.
#include <type_traits>
#include <utility>

#include "kernels/cuda/channel_reduce_last.cuh"

namespace tandem::gpu {

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

// out[c] = the sum of channel c of x, in double and rounded once (channels-last 16-bit x: each
// thread's rows in float, Note [a thread's sums in float]): channel_sum_partials (or
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
  launch_after_previous(channel_sum_finish<T, T>, finish_grid(g), kBlock, stream, cptr<double>(partial), out, g);
}

// Note [a per-channel map that sums its output]: channel_map_sum_any writes out = f(coef, in...)
// as channel_map_any does and, in the same pass, sums what it writes per channel -- the
// rounded T values, in the same types (Note [a thread's sums in float]) -- in exactly the
// order channel_sum_any would add them reading out afterwards: the same split (channel_split_of), the same vector width (that of out alone,
// so an input at an offset that breaks those vectors is read element by element), the same
// per-thread walk (for_channel_group, for_rows_last), the same block and finish reductions. So
// the sum is bit for bit channel_sum_any(out), without that second pass over out (Note [conv
// bias in batch norm] in batchnorm.cuh). Being a reduction, it runs on the split grid
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
  wait_for_previous_grid();  // Note [programmatic dependent launch]
  let_next_grid_launch();
  const int64_t c0 = last_first_channel(g), s = blockIdx.y;
  using S = thread_sum_t<T>;  // SumLast<T>'s (Note [a thread's sums in float])
  S sums[VEC][1] = {};
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
      for (int k = 0; k < VEC; ++k) sums[k][0] += static_cast<S>(o.v[k]);
    };
    for_rows_last<last_batch_rows(sizeof(InputVecs<T, VEC, N>), kLastBatch), false>(g, c0, s, load, add);
  }
  store_partials_last<VEC, 1>(sums, g, s, partial);
}

// channel_map_any(like, f, out, stream, in...) and sum[c] = channel_sum_any(out)[c], in one
// pass (Note [a per-channel map that sums its output]); sum may be of a wider type S, the same
// values. out and in... in like's format.
template <typename T, typename F, typename S, typename... In>
void channel_map_sum_any(const Tensor& like, const F& f, T* out, S* sum, cudaStream_t stream, const In*... in) {
  const bool last = channels_last_of(like);
  ChannelSplit g;
  Tensor partial;
  // The vector width is that of out alone: channel_sum_any(out)'s.
  const auto run = [&](auto vec) {
    g = channel_split_of(like, vec.value);
    partial = empty({g.c * g.splits}, kFloat64, like.device());
    const bool aligned = channel_vec<T>(last ? g.c : g.hw, static_cast<const T*>(out), in...) == vec.value;
    if (last) {
      launch_after_previous(channel_map_sum_last_kernel<vec.value, F, T, In...>, split_grid_last(g), kSplitBlock,
                            stream, f, out, ptr<double>(partial), g, aligned, in...);
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
  launch_after_previous(channel_sum_finish<T, S>, finish_grid(g), kBlock, stream, cptr<double>(partial), sum, g);
}

}  // namespace tandem::gpu
