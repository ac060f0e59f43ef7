// log_softmax over the rows of [N, C], its backward, the fused cross-entropy and the accuracy
// counter. One block per row (sized to C), sums in double as on the CPU.
//
// The cross-entropy mean is deterministic: the row kernel writes each row's log-probability of
// its target into a buffer [N], and a one-block kernel sums that buffer in a fixed order (no
// atomics; Note [deterministic reductions] in common.cuh). A target outside [0, C) traps the
// kernel (see cuda_backend.h). count_correct adds into an int64 counter with one atomicAdd per
// block; integer addition is associative, so the count is exact and deterministic too.
#include "core/allocator.h"
#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

constexpr int kMeanThreads = 1024;

// y = x - (max + log(sum(exp(x - max)))) per row. With target != nullptr it also checks the
// row's target and writes its log-probability into row_lp[row].
template <typename T>
__global__ void log_softmax_kernel(const T* x, T* y, int64_t cols, const int64_t* target,
                                   T* row_lp) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  T m = lowest_value<T>();
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = MaxOp{}(m, xr[j]);
  m = block_reduce(m, MaxOp{}, lowest_value<T>());
  double s = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += exp(static_cast<double>(xr[j] - m));
  s = block_reduce(s, SumOp{}, 0.0);
  // An all -inf row has no finite max; its log-probabilities are NaN, as in PyTorch.
  const T lse = static_cast<T>(static_cast<double>(m) + log(s));
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = xr[j] - lse;
  if (target != nullptr && threadIdx.x == 0) {
    const int64_t t = target[row];
    if (t < 0 || t >= cols) __trap();  // invalid class index
    row_lp[row] = xr[t] - lse;
  }
}

// loss[0] = -mean(row_lp[0..n)), summed in double by one block.
template <typename T>
__global__ void mean_loss_kernel(const T* row_lp, int64_t n, T* loss) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += row_lp[i];
  s = block_reduce(s, SumOp{}, 0.0);
  if (threadIdx.x == 0) loss[0] = static_cast<T>(-s / static_cast<double>(n));
}

// dx = dy - exp(y) * sum(dy) per row.
template <typename T>
__global__ void log_softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t cols) {
  const int64_t off = static_cast<int64_t>(blockIdx.x) * cols;
  double s = 0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += dy[off + j];
  const T st = static_cast<T>(block_reduce(s, SumOp{}, 0.0));
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    dx[off + j] = dy[off + j] - d_exp(y[off + j]) * st;
  }
}

// dlogits = (exp(log_probs) - onehot(target)) * dloss / N, elementwise over [N, C].
template <typename T>
__global__ void cross_entropy_backward_kernel(const T* lp, const int64_t* target, const T* dloss,
                                              T* dx, int64_t rows, int64_t cols) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const T scale = static_cast<T>(static_cast<double>(dloss[0]) / static_cast<double>(rows));
  const int64_t total = rows * cols;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t row = i / cols, j = i - row * cols;
    const int64_t t = target[row];
    if (t < 0 || t >= cols) __trap();  // invalid class index
    T v = d_exp(lp[i]) * scale;
    if (j == t) v -= scale;
    dx[i] = v;
  }
}

// One warp per row (grid-stride over rows); each block adds its hits to *correct once.
template <typename T>
__global__ void count_correct_kernel(const T* x, const int64_t* target, int64_t rows,
                                     int64_t cols, unsigned long long* correct) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const ArgMax<T> identity{lowest_value<T>(), INT64_MAX};
  int64_t hits = 0;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    const T* xr = x + row * cols;
    ArgMax<T> best = identity;
    for (int64_t j = lane; j < cols; j += 32) best = ArgMaxOp{}(best, {xr[j], j});
    best = warp_reduce(best, ArgMaxOp{});
    if (lane == 0 && best.index == target[row]) ++hits;
  }
  hits = block_reduce(hits, SumOp{}, int64_t{0});
  if (threadIdx.x == 0 && hits > 0) atomicAdd(correct, static_cast<unsigned long long>(hits));
}

}  // namespace
}  // namespace gpu

void CudaBackend::log_softmax(const Tensor& x, const Tensor& y) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(x.device());
  dispatch_floating(x.dtype(), "log_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::log_softmax_kernel<T><<<static_cast<unsigned>(rows), gpu::row_block_size(cols), 0,
                                 current_cuda_stream(x.device())>>>(
        gpu::cptr<T>(x), gpu::ptr<T>(y), cols, nullptr, nullptr);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::log_softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx) {
  const int64_t rows = y.size(0), cols = y.size(1);
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(y.device());
  dispatch_floating(y.dtype(), "log_softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::log_softmax_backward_kernel<T><<<static_cast<unsigned>(rows), gpu::row_block_size(cols),
                                          0, current_cuda_stream(y.device())>>>(
        gpu::cptr<T>(dy), gpu::cptr<T>(y), gpu::ptr<T>(dx), cols);
    TANDEM_CUDA_CHECK_LAUNCH();
  });
}

void CudaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& target,
                                        const Tensor& log_probs, const Tensor& loss) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  DeviceGuard guard(logits.device());
  cudaStream_t stream = current_cuda_stream(logits.device());
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    DataPtr row_lp = allocate(logits.device(), static_cast<size_t>(rows) * sizeof(T));  // [N]
    if (rows > 0) {
      gpu::launch_after_previous(gpu::log_softmax_kernel<T>, static_cast<unsigned>(rows), gpu::row_block_size(cols),
                                 stream, gpu::cptr<T>(logits), gpu::ptr<T>(log_probs), cols,
                                 gpu::cptr<int64_t>(target), static_cast<T*>(row_lp.get()));
    }
    gpu::launch_after_previous(gpu::mean_loss_kernel<T>, 1, gpu::kMeanThreads, stream,
                               static_cast<const T*>(row_lp.get()), rows, gpu::ptr<T>(loss));
  });
}

void CudaBackend::cross_entropy_backward(const Tensor& log_probs, const Tensor& target,
                                         const Tensor& dloss, const Tensor& dlogits) {
  const int64_t rows = log_probs.size(0), cols = log_probs.size(1);
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(log_probs.device());
  dispatch_floating(log_probs.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::launch_after_previous(gpu::cross_entropy_backward_kernel<T>, gpu::grid_for(rows * cols), gpu::kBlock,
                               current_cuda_stream(log_probs.device()), gpu::cptr<T>(log_probs),
                               gpu::cptr<int64_t>(target), gpu::cptr<T>(dloss), gpu::ptr<T>(dlogits), rows, cols);
  });
}

void CudaBackend::count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) {
  const int64_t rows = logits.size(0), cols = logits.size(1);
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(logits.device());
  static_assert(sizeof(unsigned long long) == sizeof(int64_t));
  dispatch_floating(logits.dtype(), "count_correct", [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kRowsPerBlock = gpu::kBlock / 32;
    gpu::launch_after_previous(gpu::count_correct_kernel<T>, gpu::grid_for(rows, kRowsPerBlock), gpu::kBlock,
                               current_cuda_stream(logits.device()), gpu::cptr<T>(logits),
                               gpu::cptr<int64_t>(target), rows, cols,
                               reinterpret_cast<unsigned long long*>(gpu::ptr<int64_t>(correct)));
  });
}

}  // namespace tandem
