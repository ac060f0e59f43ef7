// Matrix products through OpenBLAS (row-major CBLAS).
#include <cblas.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

template <typename T>
void scale(T* c, int64_t m, int64_t n, int64_t ldc, T beta) {
  for (int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    if (beta == T(0)) {
      std::fill(row, row + n, T(0));
    } else {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

// BLAS rejects leading dimensions below 1 even for empty operands, and an empty inner
// dimension must still apply beta to C, so the degenerate shapes are handled here.
template <typename T, typename Gemm>
void gemm_checked(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                  int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc, Gemm blas) {
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == T(0)) {
    scale(c, m, n, ldc, beta);
    return;
  }
  blas(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
       static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
       static_cast<blasint>(std::max<int64_t>(lda, 1)), b,
       static_cast<blasint>(std::max<int64_t>(ldb, 1)), beta, c,
       static_cast<blasint>(std::max<int64_t>(ldc, 1)));
}

}  // namespace

void gemm_raw(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_checked(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, cblas_sgemm);
}

void gemm_raw(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_checked(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, cblas_dgemm);
}

namespace {

std::vector<float> to_float(const BFloat16* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// Note [bfloat16 gemm on the CPU]: OpenBLAS has no bfloat16 product in every build, so the
// operands are widened to float32 (exact), multiplied by sgemm and the result rounded once:
// the same numbers as cuBLAS's bfloat16 gemm with float32 compute, up to the order of the
// float32 sums. It costs a float32 copy of each operand; the CPU path is the reference, not
// the fast one.
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const Tensor& a, const Tensor& b, float beta, const Tensor& c) {
  const std::vector<float> fa = to_float(static_cast<const BFloat16*>(a.raw_data()), a.numel());
  const std::vector<float> fb = to_float(static_cast<const BFloat16*>(b.raw_data()), b.numel());
  BFloat16* pc = static_cast<BFloat16*>(c.raw_data());
  // beta == 0 never reads c (it may hold NaNs or uninitialized memory), as BLAS does.
  std::vector<float> fc = beta == 0.0f ? std::vector<float>(static_cast<size_t>(m * n))
                                       : to_float(pc, m * n);
  gemm_raw(trans_a, trans_b, m, n, k, alpha, fa.data(), a.size(1), fb.data(), b.size(1), beta,
           fc.data(), n);
  for (int64_t i = 0; i < m * n; ++i) pc[i] = BFloat16(fc[i]);
}

}  // namespace

void CpuBackend::gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b,
                      double beta, const Tensor& c) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  dispatch_floating_bf16(c.dtype(), "gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, BFloat16>) {
      gemm_bf16(trans_a, trans_b, m, n, k, static_cast<float>(alpha), a, b,
                static_cast<float>(beta), c);
    } else {
      // Row-major storage: the leading dimension is the stored row length.
      gemm_raw(trans_a, trans_b, m, n, k, static_cast<T>(alpha),
               static_cast<const T*>(a.raw_data()), a.size(1), static_cast<const T*>(b.raw_data()),
               b.size(1), static_cast<T>(beta), static_cast<T*>(c.raw_data()), n);
    }
  });
}

}  // namespace tandem::cpu

namespace tandem {

void set_cpu_blas_threads(int n) { openblas_set_num_threads(n < 1 ? 1 : n); }

}  // namespace tandem
