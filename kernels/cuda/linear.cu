// tandem's own kernels for small linear layers with their bias and activation fused (Note
// [linear + activation] in kernels/backend.h).
//
// Note [small fused linear layers]: LeNet's classifier (400 -> 120 -> 84 -> 10 at batch 256) is
// 15 M multiply-adds forward, yet cuBLAS runs each product as a split-K pair of kernels tiled for
// large matrices, and the bias, the activation, its gradient and the bias gradient are passes
// of their own. Here each pass is one kernel over 16 x 16 tiles of the output, one output per
// thread, the reduction dimension staged through shared memory 32 at a time:
//
// - forward, y = act(x @ w^T + bias): x [M, K] and w [N, K] are both read along K, the bias
//   added to the sum and the activation applied before the only store;
// - input gradient, dx = dz @ w with dz = dy * act'(y) formed as the tile of dy is loaded (so
//   dz is never written);
// - weight gradient, dw = dz^T @ x, and the bias gradient as one more column of the same
//   product whose input is 1 (the column sums of dz).
//
// Each output is a sum in a fixed order (the terms in order of the reduced index, each an
// FMA): the same bits on every run and on a CUDA graph replay (Note [deterministic
// reductions]). The activation's arithmetic is the elementwise kernels' (UnaryOp::Relu and
// Sigmoid, BinaryOp::ReluBackward and SigmoidBackward), so fused and unfused layers differ
// only in the summation order of their products. Used for float32 and float64 when M is at
// most kMaxRows and M * N * K at most kMaxWork multiply-adds -- where one output per thread
// still fills the GPU in one short wave; larger layers go to cuBLAS (the dispatcher composes).
#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

constexpr int kTile = 16;                   // output tile: kTile x kTile, one output per thread
constexpr int kStep = 32;                   // reduction elements staged per iteration
constexpr int kThreads = kTile * kTile;     // 256
constexpr int64_t kMaxRows = 4096;          // M: the weight gradient's reduction length
constexpr int64_t kMaxWork = int64_t{1} << 24;  // M * N * K multiply-adds

template <typename T, Activation A>
__device__ T activate(T z) {
  if constexpr (A == Activation::Relu) return z > T(0) ? z : T(0);
  if constexpr (A == Activation::Sigmoid) return T(1) / (T(1) + d_exp(-z));
  return z;
}

// dz from the output's gradient g and the output y, as BinaryOp::ReluBackward and
// SigmoidBackward compute it.
template <typename T, Activation A>
__device__ T activation_grad(T g, T y) {
  if constexpr (A == Activation::Relu) return y > T(0) ? g : T(0);
  if constexpr (A == Activation::Sigmoid) return g * y * (T(1) - y);
  return g;
}

// y [m, n] = act(x [m, k] @ w [n, k]^T + bias [n]); grid (ceil(n / 16), ceil(m / 16)).
template <typename T, Activation A>
__global__ void __launch_bounds__(kThreads) linear_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                  const T* __restrict__ bias, T* __restrict__ y,
                                                                  int m, int n, int k) {
  __shared__ T xs[kTile][kStep + 1];  // xs[r][t] = x[row0 + r, t0 + t]
  __shared__ T ws[kTile][kStep + 1];  // ws[c][t] = w[col0 + c, t0 + t]
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  T acc = 0;
  for (int t0 = 0; t0 < k; t0 += kStep) {
    for (int e = threadIdx.x; e < kTile * kStep; e += kThreads) {
      const int r = e / kStep, t = e % kStep, kk = t0 + t;
      xs[r][t] = row0 + r < m && kk < k ? x[static_cast<int64_t>(row0 + r) * k + kk] : T(0);
      ws[r][t] = col0 + r < n && kk < k ? w[static_cast<int64_t>(col0 + r) * k + kk] : T(0);
    }
    __syncthreads();
    const int steps = min(kStep, k - t0);
    for (int t = 0; t < steps; ++t) acc = fma(xs[ty][t], ws[tx][t], acc);
    __syncthreads();
  }
  const int row = row0 + ty, col = col0 + tx;
  if (row < m && col < n) {
    const T z = bias != nullptr ? acc + bias[col] : acc;
    y[static_cast<int64_t>(row) * n + col] = activate<T, A>(z);
  }
}

// dx [m, k] = dz @ w [n, k], dz = act'(dy [m, n], y [m, n]); grid (ceil(k / 16), ceil(m / 16)).
template <typename T, Activation A>
__global__ void __launch_bounds__(kThreads) linear_input_grad_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                                                     const T* __restrict__ w, T* __restrict__ dx, int m,
                                                                     int n, int k) {
  __shared__ T zs[kTile][kStep + 1];  // zs[r][t] = dz[row0 + r, t0 + t]
  __shared__ T ws[kStep][kTile + 1];  // ws[t][c] = w[t0 + t, col0 + c]
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int row0 = blockIdx.y * kTile, col0 = blockIdx.x * kTile;
  T acc = 0;
  for (int t0 = 0; t0 < n; t0 += kStep) {
    for (int e = threadIdx.x; e < kTile * kStep; e += kThreads) {
      const int r = e / kStep, t = e % kStep;
      const int64_t i = static_cast<int64_t>(row0 + r) * n + t0 + t;
      zs[r][t] = row0 + r < m && t0 + t < n
                     ? activation_grad<T, A>(dy[i], A == Activation::None ? T(0) : y[i])
                     : T(0);
      const int wt = e / kTile, wc = e % kTile;
      ws[wt][wc] = t0 + wt < n && col0 + wc < k ? w[static_cast<int64_t>(t0 + wt) * k + col0 + wc] : T(0);
    }
    __syncthreads();
    const int steps = min(kStep, n - t0);
    for (int t = 0; t < steps; ++t) acc = fma(zs[ty][t], ws[t][tx], acc);
    __syncthreads();
  }
  const int row = row0 + ty, col = col0 + tx;
  if (row < m && col < k) dx[static_cast<int64_t>(row) * k + col] = acc;
}

// dw [n, k] = dz^T @ x [m, k] and db [n] = the column sums of dz, as one product whose column
// k has input 1. Columns [first, last) of that [n, k + 1] product are computed (first = k:
// only db; last = k: no db); grid (ceil((last - first) / 16), ceil(n / 16)).
template <typename T, Activation A>
__global__ void __launch_bounds__(kThreads) linear_weight_grad_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                                                                      const T* __restrict__ x, T* __restrict__ dw,
                                                                      T* __restrict__ db, int m, int n, int k,
                                                                      int first, int last) {
  __shared__ T zs[kStep][kTile + 1];  // zs[t][r] = dz[t0 + t, row0 + r]
  __shared__ T xs[kStep][kTile + 1];  // xs[t][c] = x[t0 + t, col0 + c], 1 in column k
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int row0 = blockIdx.y * kTile, col0 = first + blockIdx.x * kTile;
  T acc = 0;
  for (int t0 = 0; t0 < m; t0 += kStep) {
    for (int e = threadIdx.x; e < kTile * kStep; e += kThreads) {
      const int t = e / kTile, c = e % kTile;
      const bool in = t0 + t < m;
      const int64_t i = static_cast<int64_t>(t0 + t) * n + row0 + c;
      zs[t][c] = in && row0 + c < n ? activation_grad<T, A>(dy[i], A == Activation::None ? T(0) : y[i]) : T(0);
      const int col = col0 + c;
      xs[t][c] = !in || col >= last ? T(0) : col == k ? T(1) : x[static_cast<int64_t>(t0 + t) * k + col];
    }
    __syncthreads();
    const int steps = min(kStep, m - t0);
    for (int t = 0; t < steps; ++t) acc = fma(zs[t][ty], xs[t][tx], acc);
    __syncthreads();
  }
  const int row = row0 + ty, col = col0 + tx;
  if (row >= n || col >= last) return;
  if (col < k) {
    dw[static_cast<int64_t>(row) * k + col] = acc;
  } else {
    db[row] = acc;
  }
}

bool fused_linear_applies(DType dt, int64_t m, int64_t n, int64_t k) {
  return (dt == kFloat32 || dt == kFloat64) && m >= 1 && n >= 1 && k >= 1 && m <= kMaxRows &&
         m * n * k <= kMaxWork;
}

// Calls fn(std::integral_constant<Activation, act>) for the runtime act.
template <typename Fn>
void dispatch_activation(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::None: return fn(std::integral_constant<Activation, Activation::None>{});
    case Activation::Relu: return fn(std::integral_constant<Activation, Activation::Relu>{});
    case Activation::Sigmoid: return fn(std::integral_constant<Activation, Activation::Sigmoid>{});
  }
}

dim3 tiles(int64_t cols, int64_t rows) {
  return dim3(static_cast<unsigned>(ceil_div(cols, kTile)), static_cast<unsigned>(ceil_div(rows, kTile)));
}

}  // namespace
}  // namespace gpu

bool CudaBackend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& bias, Activation act,
                                 const Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  if (!gpu::fused_linear_applies(x.dtype(), m, n, k)) return false;
  DeviceGuard guard(x.device());
  cudaStream_t stream = current_cuda_stream(x.device());
  dispatch_floating(x.dtype(), "linear", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::dispatch_activation(act, [&](auto a) {
      gpu::linear_forward_kernel<T, decltype(a)::value><<<gpu::tiles(n, m), gpu::kThreads, 0, stream>>>(
          gpu::cptr<T>(x), gpu::cptr<T>(w), bias.defined() ? gpu::cptr<T>(bias) : nullptr, gpu::ptr<T>(y),
          static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
      TANDEM_CUDA_CHECK_LAUNCH();
    });
  });
  return true;
}

bool CudaBackend::linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x, const Tensor& w,
                                  Activation act, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  const int64_t m = dy.size(0), n = dy.size(1);
  const int64_t k = dx.defined() ? dx.size(1) : dw.defined() ? dw.size(1) : 1;
  if (!gpu::fused_linear_applies(dy.dtype(), m, n, k)) return false;
  DeviceGuard guard(dy.device());
  cudaStream_t stream = current_cuda_stream(dy.device());
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  dispatch_floating(dy.dtype(), "linear_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* yp = act == Activation::None ? nullptr : gpu::cptr<T>(y);
    gpu::dispatch_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      if (dx.defined()) {
        gpu::linear_input_grad_kernel<T, A><<<gpu::tiles(k, m), gpu::kThreads, 0, stream>>>(
            gpu::cptr<T>(dy), yp, gpu::cptr<T>(w), gpu::ptr<T>(dx), im, in, ik);
        TANDEM_CUDA_CHECK_LAUNCH();
      }
      if (dw.defined() || db.defined()) {
        const int first = dw.defined() ? 0 : ik, last = db.defined() ? ik + 1 : ik;
        gpu::linear_weight_grad_kernel<T, A><<<gpu::tiles(last - first, n), gpu::kThreads, 0, stream>>>(
            gpu::cptr<T>(dy), yp, dw.defined() ? gpu::cptr<T>(x) : nullptr, dw.defined() ? gpu::ptr<T>(dw) : nullptr,
            db.defined() ? gpu::ptr<T>(db) : nullptr, im, in, ik, first, last);
        TANDEM_CUDA_CHECK_LAUNCH();
      }
    });
  });
  return true;
}

}  // namespace tandem
