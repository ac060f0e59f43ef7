// Row reductions: the dispatcher permutes the reduced dims to the end and makes the input
// contiguous, so every reduction here is over the contiguous rows of an [R, C] matrix.
// bfloat16 sums accumulate in double, like float32, and round once when stored.
#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

// Four independent accumulators: the adds of one row do not wait on each other, which is
// most of the speed a vectorized float sum would give while keeping float64 accumulation.
template <typename T>
acc_t<T> sum_row(const T* x, int64_t n) {
  acc_t<T> s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  using A = acc_t<T>;
  for (; i + 4 <= n; i += 4) {
    s0 += static_cast<A>(x[i]);
    s1 += static_cast<A>(x[i + 1]);
    s2 += static_cast<A>(x[i + 2]);
    s3 += static_cast<A>(x[i + 3]);
  }
  for (; i < n; ++i) s0 += static_cast<A>(x[i]);
  return (s0 + s1) + (s2 + s3);
}

// Index of the first maximum; a NaN counts as the maximum (and the first NaN wins), as in
// torch.argmax.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (x[best] != x[best]) break;
    if (x[i] > x[best] || x[i] != x[i]) best = i;
  }
  return best;
}

}  // namespace

void CpuBackend::reduce_rows(ReduceOp op, const Tensor& x, const Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  dispatch_all(x.dtype(), "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(x.raw_data());
    T* po = static_cast<T*>(out.raw_data());
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = px + r * cols;
      switch (op) {
        case ReduceOp::Sum:
          po[r] = static_cast<T>(sum_row(row, cols));
          break;
        case ReduceOp::Mean:
          po[r] =
              static_cast<T>(static_cast<double>(sum_row(row, cols)) / static_cast<double>(cols));
          break;
        case ReduceOp::Max:
          po[r] = row[argmax_row(row, cols)];
          break;
      }
    }
  });
}

void CpuBackend::argmax_rows(const Tensor& x, const Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  int64_t* po = out.data<int64_t>();
  dispatch_all(x.dtype(), "argmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(x.raw_data());
    for (int64_t r = 0; r < rows; ++r) po[r] = argmax_row(px + r * cols, cols);
  });
}

}  // namespace tandem::cpu
