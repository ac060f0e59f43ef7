// Row gather (index_select along dim 0) and its adjoint, the row scatter-add.
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

void check_index(const char* op, int64_t i, int64_t value, int64_t rows) {
  TANDEM_CHECK(value >= 0 && value < rows, Value, op, ": index[", i, "] = ", value,
               " is out of range for ", rows, " rows");
}

}  // namespace

void CpuBackend::index_select(const Tensor& x, const Tensor& index, const Tensor& out) {
  const int64_t rows = x.size(0), m = index.numel();
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(x.nbytes()) / rows;
  const int64_t* idx = index.data<int64_t>();
  for (int64_t i = 0; i < m; ++i) check_index("index_select", i, idx[i], rows);
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, static_cast<size_t>(row_bytes));
  }
}

void CpuBackend::index_add(const Tensor& src, const Tensor& index, const Tensor& out) {
  const int64_t rows = out.size(0), m = index.numel();
  const int64_t row = rows == 0 ? 0 : out.numel() / rows;
  const int64_t* idx = index.data<int64_t>();
  for (int64_t i = 0; i < m; ++i) check_index("index_add", i, idx[i], rows);
  dispatch_all(out.dtype(), "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(src.raw_data());
    T* o = static_cast<T*>(out.raw_data());
    for (int64_t i = 0; i < m; ++i) {
      T* dst = o + idx[i] * row;
      const T* r = s + i * row;
      for (int64_t j = 0; j < row; ++j) dst[j] = static_cast<T>(dst[j] + r[j]);
    }
  });
}

}  // namespace tandem::cpu
