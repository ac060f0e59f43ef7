#pragma once
#include <algorithm>
#include <vector>
// Shared pieces of the CUDA kernels: launch sizing, pointer access, the strided indexer used
// by every elementwise op, device math that picks the float or double function, and the
// warp/block reductions used by the row kernels (reduce, softmax, batchnorm, bias).
//
// Everything here is a template or inline: each .cu file instantiates what it uses.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem::gpu {

constexpr int kBlock = 256;           // threads per block of the elementwise kernels
constexpr int64_t kMaxBlocks = 4096;  // grid cap; kernels use grid-stride loops beyond it
constexpr int kMaxDims = 8;           // dims of a strided elementwise op after coalescing

// Blocks for `work` items at `block` threads each: ceil-div, capped, at least one.
inline unsigned grid_for(int64_t work, int block = kBlock) {
  int64_t g = ceil_div(work, block);
  if (g < 1) g = 1;
  if (g > kMaxBlocks) g = kMaxBlocks;
  return static_cast<unsigned>(g);
}

// Threads per block of a row kernel: the next power of two >= n, within [32, max_threads].
inline int row_block_size(int64_t n, int max_threads = 512) {
  int t = 32;
  while (t < n && t < max_threads) t *= 2;
  return t;
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.raw_data());
}
template <typename T>
const T* cptr(const Tensor& t) {
  return static_cast<const T*>(t.raw_data());
}

// ---- strided indexing ----------------------------------------------------------------------
//
// N operands of one shape, each with its own strides (zero for a broadcast dim). Dims are
// stored innermost first after two simplifications done on the host: size-1 dims are dropped
// and neighbouring dims that are contiguous in every operand are merged. A contiguous tensor
// thus becomes a single dim of stride 1, and [N, C] + [C] becomes two dims however many the
// tensors had. Index is uint32_t when the element count fits, int64_t otherwise (64-bit
// division is several times slower on the GPU).
template <int N, typename Index>
struct StridedIndexer {
  int ndim = 0;
  Index sizes[kMaxDims] = {};
  int64_t strides[kMaxDims][N] = {};

  __device__ __forceinline__ void offsets(Index i, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
#pragma unroll
    for (int d = 0; d < kMaxDims; ++d) {
      if (d == ndim) break;
      const Index q = i / sizes[d];
      const Index r = i - q * sizes[d];
      i = q;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += static_cast<int64_t>(r) * strides[d][k];
    }
  }
};

// The simplified layout of N operands over `shape` (host side).
template <int N>
struct Layout {
  std::vector<int64_t> sizes;                  // innermost first
  std::vector<std::array<int64_t, N>> strides;  // per dim, per operand

  // True when every operand is the same dense range (one dim of stride 1, or a single element).
  bool contiguous() const {
    if (sizes.empty()) return true;
    if (sizes.size() != 1) return false;
    for (int64_t s : strides[0]) {
      if (s != 1) return false;
    }
    return true;
  }

  template <typename Index>
  StridedIndexer<N, Index> indexer(const char* op) const {
    TANDEM_CHECK(sizes.size() <= static_cast<size_t>(kMaxDims), Shape, op, ": ", sizes.size(),
                 " non-mergeable dims; the CUDA elementwise kernels handle at most ", kMaxDims);
    StridedIndexer<N, Index> ix;
    ix.ndim = static_cast<int>(sizes.size());
    for (size_t d = 0; d < sizes.size(); ++d) {
      ix.sizes[d] = static_cast<Index>(sizes[d]);
      for (int k = 0; k < N; ++k) ix.strides[d][k] = strides[d][k];
    }
    return ix;
  }
};

template <int N>
Layout<N> make_layout(const Shape& shape, const std::array<const Strides*, N>& strides) {
  Layout<N> l;
  // Dims innermost first by the first operand's strides (the output's), so that operands in
  // another dense order than row-major — channels-last (Note [memory formats]) — merge into
  // one dense range too; row-major operands keep the plain last-to-first order.
  std::vector<int64_t> order;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) order.push_back(d);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return (*strides[0])[a] < (*strides[0])[b]; });
  for (int64_t d : order) {
    if (shape[d] == 1) continue;
    std::array<int64_t, N> st;
    for (int k = 0; k < N; ++k) st[k] = (*strides[k])[d];
    if (!l.sizes.empty()) {
      bool merge = true;
      for (int k = 0; k < N; ++k) merge = merge && st[k] == l.strides.back()[k] * l.sizes.back();
      if (merge) {
        l.sizes.back() *= shape[d];
        continue;
      }
    }
    l.sizes.push_back(shape[d]);
    l.strides.push_back(st);
  }
  return l;
}

// ---- device math ---------------------------------------------------------------------------
// Overloads that resolve to the float (expf) or double (exp) function explicitly.
__device__ __forceinline__ float d_exp(float x) { return expf(x); }
__device__ __forceinline__ double d_exp(double x) { return exp(x); }
__device__ __forceinline__ float d_log(float x) { return logf(x); }
__device__ __forceinline__ double d_log(double x) { return log(x); }
__device__ __forceinline__ float d_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double d_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float d_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double d_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float d_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double d_pow(double x, double y) { return pow(x, y); }

template <typename T>
__host__ __device__ constexpr T lowest_value() {
  if constexpr (is_floating_type_v<T>) {
    return -std::numeric_limits<T>::infinity();
  } else {
    return std::numeric_limits<T>::lowest();
  }
}

// Blocks (of up to 256 threads) that fill every multiprocessor of the current device once (eight
// resident blocks each), for grid-stride loops that should loop rather than launch more blocks.
inline int64_t one_wave_blocks() {
  static std::atomic<int> cached[64] = {};
  // cudaGetDevice answers the physical ordinal (DeviceGuard set it from the logical device,
  // Note [virtual CUDA devices]), which is what cudaDeviceGetAttribute takes and what the
  // cache is keyed by: logical devices on one GPU share its count.
  int device = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = cached[device & 63];
  int sms = slot.load(std::memory_order_relaxed);
  if (sms == 0) {
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    slot.store(sms, std::memory_order_relaxed);
  }
  return 8 * static_cast<int64_t>(sms);
}

// Blocks of Block threads of Kernel that the current device holds at once: how many its
// registers and shared memory let one multiprocessor hold (asked of CUDA once per kernel; every
// GPU of a machine is taken to be the same chip), times the multiprocessors. one_wave_blocks()
// assumes eight per multiprocessor; a kernel that needs more than 32 registers a thread gets
// fewer, and a grid sized by it then runs in waves (Note [a map's grid in one wave] in
// channel_reduce_last.cuh).
template <auto Kernel, int Block = kBlock>
int64_t resident_blocks() {
  static const int per_sm = [] {
    int n = 0;
    TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, Block, 0));
    return std::max(n, 1);
  }();
  return per_sm * (one_wave_blocks() / 8);
}

// Note [programmatic dependent launch]: between two kernels of one stream the GPU drains the
// first grid, then takes the second's launch, then fills the multiprocessors with its blocks:
// ~0.4 us of idle between nodes of a replayed graph, and the ramp of the second grid, paid at
// every boundary of batch norm's chain of small passes (statistics -> finish -> apply; gradient
// sums -> finish -> dx pass -> bias sums' finish: five boundaries a layer, 17 layers, forward
// and backward, in ResNet-18's step). Since sm_90 a kernel may be launched "after the previous
// one programmatically" (launch_after_previous): its grid launches as soon as every block of
// the kernel before it has signalled let_next_grid_launch() (or exited), and each of its threads
// calls wait_for_previous_grid() before it touches memory -- that returns once the grid before
// has completed and its writes are visible, and so everything before that grid too. The launch
// and the ramp then overlap the previous grid's tail; what the kernels compute, and the order in
// which they read and write, do not change. So the kernels launched this way wait first thing,
// before any load (a read of what an earlier kernel wrote, or a write of what it still reads,
// would race), and signal at their start: once all of this grid's blocks have started, the next
// grid's blocks take what the multiprocessors have free and wait there, never holding back a
// block of this grid. A kernel launched the usual way after one of them still waits for its
// whole completion; both instructions do nothing for a kernel launched the usual way. In a
// captured graph the launch becomes a programmatic edge between the two kernel nodes.
// Launched this way: batch norm's reductions, finishing kernels and channels-last maps (and the
// per-channel sums with them), the elementwise maps over contiguous tensors, and the kernels of
// LeNet's step -- the direct and row-window convolutions and the direct weight gradients, the
// activation + pooling passes, the linear passes, the cross-entropy's and the accuracy count's,
// the rows' gather and add, SGD's update. A kernel after one of cuDNN's or cuBLAS's, which never
// signal, launches when that one completes, as before. set_programmatic_launch(false) (or
// TANDEM_PDL=0) launches them the usual way.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// kernel<<<grid, block, shared, stream>>>(args...), allowed to launch while the kernel before it
// in the stream finishes (Note [programmatic dependent launch]): for kernels that call
// wait_for_previous_grid() before their first load or store.
template <typename... Params, typename... Args>
void launch_after_previous_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                                  cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic_launch() ? 1 : 0;  // kernels/backend.h
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(std::forward<Args>(args))...));
}
// The same without dynamic shared memory.
template <typename... Params, typename... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  launch_after_previous_shared(kernel, grid, block, size_t{0}, stream, std::forward<Args>(args)...);
}

// An asynchronous copy of one element from global to shared memory (cp.async, sm_80 on): a
// thread issues all of its copies without waiting for any, so a block's whole tile is in
// flight at once rather than one load-then-store at a time. The block waits for all of its
// copies with copy_wait_all() before a barrier.
template <typename T>
__device__ __forceinline__ void copy_async(T* dst_shared, const T* src_global) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async copies 4, 8 or 16 bytes");
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src_global), "n"(sizeof(T)));
}
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Closes the copies issued so far into a group; copy_wait_group<N>() waits until at most the N
// most recent groups are still in flight (a double-buffered stage: N = 1 while the next one loads).
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copy_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Accumulator type of sums, as on the CPU: double for floating types, bfloat16 included (a
// float32 sum of 10^6 terms loses digits otherwise; the kernels are memory-bound, so it costs
// nothing), int64 for integers.
template <typename T>
using acc_t = std::conditional_t<is_floating_type_v<T>, double, int64_t>;

// ---- warp and block reductions ---------------------------------------------------------------
//
// Note [deterministic reductions]: every reduction here combines values in an order fixed by
// the launch configuration, which depends only on the shapes, so the same inputs give the
// same bits on every run. Only index_add and the integer counter of count_correct use atomics.

// (value, index) for argmax: the larger value wins, ties go to the lower index (first maximum).
template <typename T>
struct ArgMax {
  T value;
  int64_t index;
};

// (uint8 values travel as int: there is no 8-bit shuffle.)
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return static_cast<T>(__shfl_xor_sync(0xffffffffu, v, mask));
}
// bfloat16 travels as its bits (a conversion to float and back would be exact too, but
// costs two instructions more).
__device__ __forceinline__ BFloat16 shfl_xor(BFloat16 v, int mask) {
  return BFloat16::from_bits(
      static_cast<uint16_t>(__shfl_xor_sync(0xffffffffu, static_cast<unsigned>(v.bits), mask)));
}
template <typename T>
__device__ __forceinline__ ArgMax<T> shfl_xor(ArgMax<T> v, int mask) {
  return {shfl_xor(v.value, mask), shfl_xor(v.index, mask)};
}

struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
// Maximum in which a NaN wins, as on the CPU (and in torch.max).
struct MaxOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    if (a != a) return a;
    return (b > a || b != b) ? b : a;
  }
};
// First maximum: a NaN beats any number (the first NaN wins), then the larger value, then the
// lower index. The identity is {lowest_value<T>(), INT64_MAX}.
struct ArgMaxOp {
  template <typename T>
  __device__ __forceinline__ ArgMax<T> operator()(ArgMax<T> a, ArgMax<T> b) const {
    const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
    if (a_nan != b_nan) return a_nan ? a : b;
    if (!a_nan && a.value != b.value) return a.value > b.value ? a : b;
    return a.index <= b.index ? a : b;
  }
};

// All lanes of a full warp get the reduction of the warp's values.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = op(v, shfl_xor(v, mask));
  return v;
}

// Every thread of the block gets the reduction of the block's values. blockDim.x must be a
// multiple of 32 (at most 1024). Safe to call several times in a row in one kernel.
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity) {
  __shared__ V partial[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  __syncthreads();  // a previous call may still be reading partial[0]
  v = warp_reduce(v, op);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < nwarps ? partial[lane] : identity;
    v = warp_reduce(v, op);
    if (lane == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}

// ---- per-channel loops ---------------------------------------------------------------------
//
// Calls f(offset) for the elements of channel c of a contiguous [N, C, HW] tensor that belong
// to this thread: the flat channel indices threadIdx.x, threadIdx.x + blockDim.x, ... The
// (image, position) pair advances by a precomputed step instead of a division per element.
template <typename F>
__device__ __forceinline__ void for_channel(int64_t n, int64_t channels, int64_t hw, int64_t c,
                                            F f) {
  const int64_t count = n * hw;
  if (count == 0) return;
  const int64_t block = blockDim.x;
  const int64_t step_img = block / hw, step_pos = block - step_img * hw;
  int64_t img = threadIdx.x / hw, pos = threadIdx.x - img * hw;
  for (int64_t i = threadIdx.x; i < count; i += block) {
    f((img * channels + c) * hw + pos);
    img += step_img;
    pos += step_pos;
    if (pos >= hw) {
      pos -= hw;
      ++img;
    }
  }
}

}  // namespace tandem::gpu
