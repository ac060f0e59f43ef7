#pragma once
// The CPU backend, internal to kernels/cpu/: the class (its methods are defined one op family
// per file) and the loop helpers those files share.
//
// Everything here runs synchronously on the calling thread. The only threads are OpenBLAS's
// own, inside gemm.
#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/backend.h"

namespace tandem::cpu {

class CpuBackend final : public Backend {
 public:
  // elementwise.cpp
  void fill(const Tensor& out, double value) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void unary(UnaryOp op, const Tensor& x, const Tensor& out) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) override;
  void axpby(double alpha, const Tensor& x, double beta, const Tensor& out) override;
  // cpu_backend.cpp
  void memcpy(void* dst, Device dst_device, const void* src, Device src_device,
              size_t nbytes) override;
  // reduce.cpp
  void reduce_rows(ReduceOp op, const Tensor& x, const Tensor& out) override;
  void argmax_rows(const Tensor& x, const Tensor& out) override;
  // matmul.cpp
  void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta,
            const Tensor& c) override;
  // conv.cpp
  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p,
                      const Tensor& y) override;
  void conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                             const Tensor& dx) override;
  void conv2d_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p,
                              const Tensor& dw, const Tensor& db) override;
  void conv2d_backward_bias(const Tensor& dy, const Tensor& db) override;
  // pool.cpp
  void pool2d_forward(PoolMode mode, const Tensor& x, const Pool2dParams& p,
                      const Tensor& y) override;
  void pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                       const Pool2dParams& p, const Tensor& dx) override;
  // softmax.cpp
  void log_softmax(const Tensor& x, const Tensor& y) override;
  void log_softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& target, const Tensor& log_probs,
                             const Tensor& loss) override;
  void cross_entropy_backward(const Tensor& log_probs, const Tensor& target, const Tensor& dloss,
                              const Tensor& dlogits) override;
  void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) override;
  // index.cpp
  void index_select(const Tensor& x, const Tensor& index, const Tensor& out) override;
  void index_add(const Tensor& src, const Tensor& index, const Tensor& out) override;
  // batchnorm.cpp
  void batch_norm_forward_train(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                                const Tensor& beta, const Tensor& running_mean,
                                const Tensor& running_var, double momentum, double eps,
                                const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                                bool relu, const Tensor& residual,
                                const Tensor& num_batches_tracked) override;
  void batch_norm_forward_eval(const Tensor& x, const Tensor& bias, const Tensor& gamma,
                               const Tensor& beta, const Tensor& running_mean,
                               const Tensor& running_var, double eps, const Tensor& y,
                               bool relu) override;
  void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& bias, const Tensor& gamma,
                           const Tensor& save_mean, const Tensor& save_invstd, const Tensor& relu_out,
                           const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                           const Tensor& dbias, const Tensor& masked_dy, const Tensor& dy_part) override;
  // optim.cpp
  void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
                const SgdParams& p) override;
  void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                 const AdamParams& p) override;
  void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                         const AdamParams& p) override;
};

// Accumulator type of sums: double for floating types, bfloat16 included (float32 sums of
// 10^6 terms lose digits otherwise), int64 for integers.
template <typename T>
using acc_t = std::conditional_t<is_floating_type_v<T>, double, int64_t>;

// Row-major BLAS gemm on raw pointers (matmul.cpp): C = alpha * op(A) @ op(B) + beta * C with
// op(A) [M, K], op(B) [K, N], C [M, N] and leading dimensions lda, ldb, ldc.
void gemm_raw(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
              int64_t ldc);
void gemm_raw(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
              const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
              int64_t ldc);

// Per-thread scratch memory (conv.cpp) of at least n elements of T, reused across calls:
// conv needs a few hundred KB of column buffers on every call, and fresh allocations of that
// size come from mmap and cost page faults each time. One buffer per slot (0..3) and host
// thread, since virtual CPU devices run on their own threads. A buffer only grows; it is
// freed when its thread exits.
template <typename T>
T* scratch(int slot, size_t n);

// Calls fn(off, n, st) for every innermost run of a loop nest over `shape`: operand k's
// elements are at off[k] + i * st[k] for i in [0, n). Size-1 dims are dropped and adjacent dims
// that are contiguous in every operand are merged, so same-layout contiguous operands form one
// run and a broadcast operand shows up as a zero stride. Nothing is called for an empty shape.
template <size_t N, typename Fn>
void for_each_run(const Shape& shape, const std::array<const Strides*, N>& strides, Fn&& fn) {
  using Idx = std::array<int64_t, N>;
  std::vector<int64_t> sizes;
  std::vector<Idx> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) return;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    Idx s;
    for (size_t k = 0; k < N; ++k) s[k] = (*strides[k])[d];
    if (!sizes.empty()) {
      bool merge = true;
      for (size_t k = 0; k < N; ++k) merge = merge && st.back()[k] == s[k] * shape[d];
      if (merge) {
        sizes.back() *= shape[d];
        st.back() = s;
        continue;
      }
    }
    sizes.push_back(shape[d]);
    st.push_back(s);
  }
  Idx off{};
  if (sizes.empty()) {
    fn(off, int64_t{1}, Idx{});
    return;
  }
  const int64_t outer = static_cast<int64_t>(sizes.size()) - 1;
  const int64_t n = sizes.back();
  const Idx inner = st.back();
  std::vector<int64_t> idx(outer, 0);
  while (true) {
    fn(off, n, inner);
    int64_t d = outer - 1;
    for (; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k) off[k] += st[d][k];
      if (++idx[d] < sizes[d]) break;
      for (size_t k = 0; k < N; ++k) off[k] -= st[d][k] * sizes[d];
      idx[d] = 0;
    }
    if (d < 0) break;
  }
}

// out = f(a) elementwise over same-shaped strided operands. The unit-stride branch is a plain
// loop the compiler vectorizes; the rest is the general strided walk.
template <typename TO, typename TA, typename F>
void map1(const Tensor& a, const Tensor& out, F f) {
  TO* po = static_cast<TO*>(out.raw_data());
  const TA* pa = static_cast<const TA*>(a.raw_data());
  for_each_run<2>(
      out.shape(), {&out.strides(), &a.strides()},
      [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& st) {
        TO* o = po + off[0];
        const TA* x = pa + off[1];
        if (st[0] == 1 && st[1] == 1) {
          for (int64_t i = 0; i < n; ++i) o[i] = f(x[i]);
        } else if (st[0] == 1 && st[1] == 0) {
          const TO v = f(x[0]);
          for (int64_t i = 0; i < n; ++i) o[i] = v;
        } else {
          for (int64_t i = 0; i < n; ++i) o[i * st[0]] = f(x[i * st[1]]);
        }
      });
}

// out = f(a, b) elementwise; a and b already broadcast to out's shape (zero strides allowed).
// Unit-stride and one-side-broadcast runs (bias adds, scaling by a per-row value) get their own
// vectorizable loops.
template <typename T, typename F>
void map2(const Tensor& a, const Tensor& b, const Tensor& out, F f) {
  T* po = static_cast<T*>(out.raw_data());
  const T* pa = static_cast<const T*>(a.raw_data());
  const T* pb = static_cast<const T*>(b.raw_data());
  for_each_run<3>(
      out.shape(), {&out.strides(), &a.strides(), &b.strides()},
      [&](const std::array<int64_t, 3>& off, int64_t n, const std::array<int64_t, 3>& st) {
        T* o = po + off[0];
        const T* x = pa + off[1];
        const T* y = pb + off[2];
        if (st[0] == 1 && st[1] == 1 && st[2] == 1) {
          for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
        } else if (st[0] == 1 && st[1] == 1 && st[2] == 0) {
          const T yv = y[0];
          for (int64_t i = 0; i < n; ++i) o[i] = f(x[i], yv);
        } else if (st[0] == 1 && st[1] == 0 && st[2] == 1) {
          const T xv = x[0];
          for (int64_t i = 0; i < n; ++i) o[i] = f(xv, y[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) o[i * st[0]] = f(x[i * st[1]], y[i * st[2]]);
        }
      });
}

}  // namespace tandem::cpu
