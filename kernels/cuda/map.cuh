#pragma once
// map_elements: out[i] = f(in0[i], in1[i], ...) over tensors of one shape with any strides
// (zero strides for broadcast inputs). Two kernels:
// - map_contiguous: every operand is one dense range and suitably aligned. Each thread of a
//   grid-stride loop loads VEC elements of each input with one 16-byte (or narrower) vector
//   load, applies f, stores VEC outputs; a scalar loop does the tail.
// - map_strided: anything else. A StridedIndexer (common.cuh) turns the linear index into one
//   offset per operand; 32-bit index math when the element count allows it.
// Out may alias an input when their strides match: each element is read before it is written
// by the same thread.
#include <utility>

#include "kernels/cuda/common.cuh"

namespace tandem::gpu {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <int VEC, typename F, typename Out, typename... In>
__global__ void map_contiguous(int64_t n, F f, Out* out, const In*... in) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += step) {
    Vec<Out, VEC> o;
    auto apply = [&](const Vec<In, VEC>&... x) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) o.v[k] = f(x.v[k]...);
    };
    apply(reinterpret_cast<const Vec<In, VEC>*>(in)[v]...);
    reinterpret_cast<Vec<Out, VEC>*>(out)[v] = o;
  }
  for (int64_t i = nvec * VEC + first; i < n; i += step) out[i] = f(in[i]...);
}

template <typename F, typename Out, typename... In, size_t... I>
__device__ __forceinline__ void apply_at(const F& f, Out* out, const int64_t* off,
                                         std::index_sequence<I...>, const In*... in) {
  out[off[0]] = f(in[off[I + 1]]...);
}

template <typename Index, typename F, typename Out, typename... In>
__global__ void map_strided(Index n, StridedIndexer<1 + sizeof...(In), Index> ix, F f, Out* out,
                            const In*... in) {
  const Index step = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[1 + sizeof...(In)];
    ix.offsets(i, off);
    apply_at(f, out, off, std::index_sequence_for<In...>{}, in...);
  }
}

// Elements per vector: 16 bytes of the widest operand.
template <typename Out, typename... In>
constexpr int vec_width() {
  size_t widest = sizeof(Out);
  ((widest = sizeof(In) > widest ? sizeof(In) : widest), ...);
  return static_cast<int>(16 / widest);
}

template <typename T, int VEC>
bool vec_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * VEC) == 0;
}

template <typename T>
using TensorArg = const Tensor&;

// Runs out = f(in...) on out's current stream. Out and In... are the element types; the
// caller has checked shapes (all equal to out's) and dtypes.
template <typename Out, typename... In, typename F>
void map_elements(const char* op, const F& f, const Tensor& out, TensorArg<In>... in) {
  const int64_t n = out.numel();
  if (n == 0) return;
  cudaStream_t stream = current_cuda_stream(out.device());
  constexpr int N = 1 + sizeof...(In);
  const Layout<N> layout =
      make_layout<N>(out.shape(), std::array<const Strides*, N>{&out.strides(), &in.strides()...});
  Out* o = ptr<Out>(out);
  constexpr int VEC = vec_width<Out, In...>();
  if (layout.contiguous() && vec_aligned<Out, VEC>(o) && (vec_aligned<In, VEC>(in.raw_data()) && ...)) {
    launch_after_previous(map_contiguous<VEC, F, Out, In...>, grid_for(ceil_div(n, VEC)), kBlock, stream, n, f, o,
                          cptr<In>(in)...);
    return;
  }
  if (n <= static_cast<int64_t>(INT32_MAX)) {
    map_strided<uint32_t><<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<uint32_t>(n), layout.template indexer<uint32_t>(op), f, o, cptr<In>(in)...);
  } else {
    map_strided<int64_t><<<grid_for(n), kBlock, 0, stream>>>(
        n, layout.template indexer<int64_t>(op), f, o, cptr<In>(in)...);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::gpu
