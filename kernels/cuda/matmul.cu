// Matrix products through cuBLAS.
//
// cuBLAS is column-major; tandem is row-major. A row-major [M, N] matrix is, byte for byte, a
// column-major [N, M] one, so the row-major C = op(A) @ op(B) is computed as the column-major
// C^T = op(B)^T @ op(A)^T: swap the operands and the roles of M and N, keep each operand's
// own transpose flag, and pass each matrix's stored row length as its leading dimension.
//
// The handle runs in CUBLAS_DEFAULT_MATH (handles.cpp): float32 stays float32 (TF32 is only
// used when asked for with CUBLAS_TF32_TENSOR_OP_MATH), so results match the CPU's OpenBLAS.
#include <climits>

#include "core/cuda_check.h"
#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/handles.h"

namespace tandem {

namespace {

// Note [small-output products]: a product with a tiny output and a long inner dimension --
// the weight gradient of a classifier layer, [10, 84] summed over a batch of 256 -- is where
// cuBLAS's heuristics are at their worst: on an H200 it picked a split-K kernel that took 26 us
// (plus a memset and a 5 us gap in a graph) for 215 k multiply-adds, a tenth of a LeNet step.
// Here a warp computes one output: lane l adds the terms l, l + 32, ... of the inner
// dimension, the lanes are then added in a fixed tree (the same bits on every run). Used for
// float32/float64 when the output has at most kSmallOutput elements and the inner dimension
// is at least kSmallOutputMinInner; everything else goes to cuBLAS.
constexpr int64_t kSmallOutput = 2048;
constexpr int64_t kSmallOutputMinInner = 64;

// c[i, j] = alpha * sum over t of op(a)[i, t] * op(b)[t, j] + beta * c[i, j] (beta 0: c is not
// read). Row-major: a is [m, k] or, transposed, [k, m]; b is [k, n] or [n, k].
template <typename T>
__global__ void small_output_gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* __restrict__ a,
                                  const T* __restrict__ b, T beta, T* __restrict__ c) {
  const int out = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (out >= m * n) return;  // the whole warp
  const int i = out / n, j = out % n;
  const int64_t a_step = trans_a ? m : 1, b_step = trans_b ? 1 : n;
  const T* ap = trans_a ? a + i : a + static_cast<int64_t>(i) * k;
  const T* bp = trans_b ? b + static_cast<int64_t>(j) * k : b + j;
  T sum = 0;
  for (int t = lane; t < k; t += 32) sum = fma(ap[t * a_step], bp[t * b_step], sum);
  for (int d = 16; d > 0; d /= 2) sum += __shfl_down_sync(0xffffffffu, sum, d);
  if (lane == 0) c[out] = beta == T(0) ? alpha * sum : alpha * sum + beta * c[out];
}

cublasStatus_t gemm_call(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                         int n, int k, const float* alpha, const float* a, int lda,
                         const float* b, int ldb, const float* beta, float* c, int ldc) {
  return cublasSgemm(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
cublasStatus_t gemm_call(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                         int n, int k, const double* alpha, const double* a, int lda,
                         const double* b, int ldb, const double* beta, double* c, int ldc) {
  return cublasDgemm(h, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
// Note [bfloat16 gemm]: bfloat16 operands and result, float32 accumulation
// (CUBLAS_COMPUTE_32F, whose alpha and beta are floats): the tensor-core path, and the
// precision of PyTorch's bfloat16 matmul. cuBLAS may still split K and combine the partial
// sums in bfloat16 unless CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION is set, as
// PyTorch's default allow_bf16_reduced_precision_reduction = True also permits.
cublasStatus_t gemm_call(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                         int n, int k, const float* alpha, const BFloat16* a, int lda,
                         const BFloat16* b, int ldb, const float* beta, BFloat16* c, int ldc) {
  return cublasGemmEx(h, ta, tb, m, n, k, alpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, beta,
                      c, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace

void CudaBackend::gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                       double beta, const Tensor& c) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  if (m == 0 || n == 0) return;
  DeviceGuard guard(c.device());
  // An empty inner dimension (or alpha = 0) still applies beta; BLAS also rejects the leading
  // dimension 0 that an empty operand would have.
  if (k == 0 || alpha == 0.0) {
    if (beta == 0.0) {
      fill(c, 0.0);
    } else {
      scalar(ScalarOp::Mul, c, beta, c);
    }
    return;
  }
  for (int64_t v : {m, n, k, a.size(1), b.size(1)}) {
    TANDEM_CHECK(v <= INT_MAX, Shape, "gemm: dimension ", v, " exceeds cuBLAS's 32-bit limit");
  }
  if (c.dtype() != kBFloat16 && m * n <= kSmallOutput && k >= kSmallOutputMinInner) {
    dispatch_floating(c.dtype(), "gemm", [&](auto tag) {  // Note [small-output products]
      using T = typename decltype(tag)::type;
      constexpr int kWarps = 8;
      small_output_gemm<T><<<static_cast<unsigned>(ceil_div(m * n, kWarps)), kWarps * 32, 0,
                             current_cuda_stream(c.device())>>>(
          trans_a, trans_b, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<T>(alpha),
          static_cast<const T*>(a.raw_data()), static_cast<const T*>(b.raw_data()), static_cast<T>(beta),
          static_cast<T*>(c.raw_data()));
      TANDEM_CUDA_CHECK_LAUNCH();
    });
    return;
  }
  dispatch_floating_bf16(c.dtype(), "gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // alpha and beta are in the compute type: float for bfloat16.
    const opmath_t<T> al = static_cast<opmath_t<T>>(alpha), be = static_cast<opmath_t<T>>(beta);
    cublasHandle_t h = gpu::cublas_handle(c.device());
    // Column-major C^T [N, M] = op(B)^T [N, K] @ op(A)^T [K, M].
    TANDEM_CUBLAS_CHECK(gemm_call(
        h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
        static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &al,
        static_cast<const T*>(b.raw_data()), static_cast<int>(b.size(1)),
        static_cast<const T*>(a.raw_data()), static_cast<int>(a.size(1)), &be,
        static_cast<T*>(c.raw_data()), static_cast<int>(n)));
  });
}

}  // namespace tandem
