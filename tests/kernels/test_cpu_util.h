#pragma once
// Helpers for the CPU kernel tests: random inputs, host copies and closeness checks.
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "core/tensor.h"
#include "helpers.h"
#include "kernels/ops.h"

namespace tandem::test {

inline const DType kFloatTypes[] = {kFloat32, kFloat64};

// Relative tolerance for results computed in `t` against float64 references.
inline double tol(DType t) {
  return t == kFloat32 ? 2e-5 : 1e-11;
}

// Fresh uniform values in [lo, hi).
inline Tensor rnd(const Shape& shape, DType dtype, double lo = -1.0, double hi = 1.0) {
  return uniform(shape, lo, hi, dtype);
}

// Requires |got - want| <= rtol * max(1, |want|) elementwise (and equal element counts); NaN
// must match NaN. Reports the worst element.
inline void require_close(const Tensor& got, const std::vector<double>& want, double rtol) {
  const std::vector<double> g = values(got);
  REQUIRE(g.size() == want.size());
  size_t worst = 0;
  double worst_excess = 0;
  bool ok = true;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(want[i]) || std::isnan(g[i])) {
      if (std::isnan(want[i]) != std::isnan(g[i])) ok = false, worst = i, worst_excess = INFINITY;
      continue;
    }
    const double excess = std::abs(g[i] - want[i]) - rtol * std::max(1.0, std::abs(want[i]));
    if (excess > 0 && excess >= worst_excess) ok = false, worst = i, worst_excess = excess;
  }
  INFO("worst element " << worst << ": got " << (g.empty() ? 0.0 : g[worst]) << ", want "
                        << (want.empty() ? 0.0 : want[worst]) << " (rtol " << rtol << ")");
  REQUIRE(ok);
}

// Row-major offset of a multi-index into a tensor of shape s.
inline size_t flat(const Shape& s, std::initializer_list<int64_t> idx) {
  size_t off = 0;
  size_t d = 0;
  for (int64_t i : idx) off = off * static_cast<size_t>(s[d++]) + static_cast<size_t>(i);
  return off;
}

// The message of the tandem::Error thrown by fn ("" when none is thrown).
template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace tandem::test
