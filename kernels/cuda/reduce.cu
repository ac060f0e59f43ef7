// Row reductions of a contiguous [R, C] matrix (the dispatcher moves the reduced dims last):
// sum, mean, max and argmax, one block per row.
//
// A few long rows (a full reduction is R = 1) would leave most of the GPU idle, so such rows
// are cut into segments: a first launch reduces each segment into a partial buffer [R, S], a
// second one reduces the partials of each row. Both launches combine in a fixed order, so the
// result does not change from run to run (Note [deterministic reductions] in common.cuh).
// Sums accumulate in double for floating types and in int64 for integers, as on the CPU.
#include <algorithm>
#include <type_traits>

#include "core/allocator.h"
#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

// Rows shorter than this, or more rows than kFewRows, are reduced in one launch.
constexpr int64_t kSplitCols = 16384;
constexpr int64_t kFewRows = 128;
constexpr int64_t kSegmentsPerLaunch = 512;  // total segments aimed at when splitting
constexpr int64_t kShortRow = 64;             // rows this short get a thread each

// The partial result type: the accumulator for sums, the element itself for max.
template <ReduceOp OP, typename T>
using part_t = std::conditional_t<OP == ReduceOp::Max, T, acc_t<T>>;

template <ReduceOp OP, typename P>
struct RowOp {
  __device__ static P identity() {
    if constexpr (OP == ReduceOp::Max) return lowest_value<P>();
    else return P(0);
  }
  __device__ static P combine(P a, P b) {
    if constexpr (OP == ReduceOp::Max) return MaxOp{}(a, b);
    else return a + b;
  }
};

// Block b reduces segment b % segs of row b / segs of x [rows, cols]: the elements
// [seg * chunk, min(cols, (seg + 1) * chunk)). With mean_count > 0 the sum is divided by it
// (the final launch of a mean).
template <ReduceOp OP, typename In, typename P, typename Out>
__global__ void reduce_segments(const In* x, int64_t cols, int64_t chunk, int64_t segs,
                                int64_t mean_count, Out* out) {
  using Op = RowOp<OP, P>;
  const int64_t row = blockIdx.x / segs, seg = blockIdx.x % segs;
  const int64_t begin = seg * chunk;
  const int64_t end = begin + chunk < cols ? begin + chunk : cols;
  const In* xr = x + row * cols;
  P v = Op::identity();
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    v = Op::combine(v, static_cast<P>(xr[j]));
  }
  v = block_reduce(v, [](P a, P b) { return Op::combine(a, b); }, Op::identity());
  if (threadIdx.x == 0) {
    if (mean_count > 0) {
      out[blockIdx.x] = static_cast<Out>(static_cast<double>(v) / static_cast<double>(mean_count));
    } else {
      out[blockIdx.x] = static_cast<Out>(v);
    }
  }
}

// Short rows (global average pooling: 16 or 49 values per row, 100k+ rows): one thread per
// row, in column order. A block per row would leave most of its threads idle.
template <ReduceOp OP, typename T, typename P>
__global__ void reduce_short_rows(const T* x, int64_t rows, int64_t cols, int64_t mean_count, T* out) {
  using Op = RowOp<OP, P>;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const T* xr = x + r * cols;
    P v = Op::identity();
    for (int64_t j = 0; j < cols; ++j) v = Op::combine(v, static_cast<P>(xr[j]));
    out[r] = mean_count > 0 ? static_cast<T>(static_cast<double>(v) / static_cast<double>(mean_count))
                            : static_cast<T>(v);
  }
}

template <ReduceOp OP, typename T>
void reduce_typed(const Tensor& x, const Tensor& out) {
  using P = part_t<OP, T>;
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t mean_count = OP == ReduceOp::Mean ? cols : 0;
  cudaStream_t stream = current_cuda_stream(x.device());
  if (cols <= kShortRow && rows >= kFewRows) {
    reduce_short_rows<OP, T, P><<<grid_for(rows), kBlock, 0, stream>>>(cptr<T>(x), rows, cols, mean_count,
                                                                       ptr<T>(out));
    TANDEM_CUDA_CHECK_LAUNCH();
    return;
  }
  int64_t segs = 1;
  if (rows < kFewRows && cols >= kSplitCols) {
    segs = std::min(ceil_div(cols, kSplitCols / 2), std::max<int64_t>(1, kSegmentsPerLaunch / rows));
  }
  if (segs == 1) {
    reduce_segments<OP, T, P, T><<<static_cast<unsigned>(rows), row_block_size(cols), 0, stream>>>(
        cptr<T>(x), cols, cols, 1, mean_count, ptr<T>(out));
    TANDEM_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t chunk = ceil_div(cols, segs);
  DataPtr partial = allocate(x.device(), static_cast<size_t>(rows * segs) * sizeof(P));  // [R, S]
  P* pp = static_cast<P*>(partial.get());
  reduce_segments<OP, T, P, P><<<static_cast<unsigned>(rows * segs), 512, 0, stream>>>(
      cptr<T>(x), cols, chunk, segs, 0, pp);
  TANDEM_CUDA_CHECK_LAUNCH();
  reduce_segments<OP, P, P, T><<<static_cast<unsigned>(rows), row_block_size(segs), 0, stream>>>(
      pp, segs, segs, 1, mean_count, ptr<T>(out));
  TANDEM_CUDA_CHECK_LAUNCH();
}

// out[r] = index of the first maximum of row r (a NaN counts as the maximum).
template <typename T>
__global__ void argmax_rows_kernel(const T* x, int64_t cols, int64_t* out) {
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  const ArgMax<T> identity{lowest_value<T>(), INT64_MAX};
  ArgMax<T> best = identity;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) best = ArgMaxOp{}(best, {xr[j], j});
  best = block_reduce(best, ArgMaxOp{}, identity);
  if (threadIdx.x == 0) out[blockIdx.x] = best.index == INT64_MAX ? 0 : best.index;
}

}  // namespace
}  // namespace gpu

void CudaBackend::reduce_rows(ReduceOp op, const Tensor& x, const Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  DeviceGuard guard(x.device());
  if (cols == 0) {  // empty rows: sum 0, mean NaN (0 / 0), max the lowest value
    fill(out, op == ReduceOp::Sum ? 0.0
              : op == ReduceOp::Mean ? std::nan("")
                                     : -std::numeric_limits<double>::infinity());
    return;
  }
  TANDEM_CHECK(x.dtype() == out.dtype(), DType, "reduce_rows: input ", dtype_name(x.dtype()),
               " but output ", dtype_name(out.dtype()));
  dispatch_all(x.dtype(), "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (op) {
      case ReduceOp::Sum: return gpu::reduce_typed<ReduceOp::Sum, T>(x, out);
      case ReduceOp::Mean: return gpu::reduce_typed<ReduceOp::Mean, T>(x, out);
      case ReduceOp::Max: return gpu::reduce_typed<ReduceOp::Max, T>(x, out);
    }
  });
}

void CudaBackend::argmax_rows(const Tensor& x, const Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  DeviceGuard guard(x.device());
  cudaStream_t stream = current_cuda_stream(x.device());
  dispatch_all(x.dtype(), "argmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::argmax_rows_kernel<T><<<static_cast<unsigned>(rows), gpu::row_block_size(cols), 0, stream>>>(
        gpu::cptr<T>(x), cols, gpu::ptr<int64_t>(out));
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace tandem
