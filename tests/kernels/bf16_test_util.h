#pragma once
// Shared by the bfloat16 tests: random bfloat16 inputs and comparisons in units in the last
// place (ulps) of bfloat16.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "catch.h"
#include "core/bfloat16.h"
#include "core/tensor.h"
#include "helpers.h"

namespace tandem::test {

// Fresh uniform values in [lo, hi), rounded to bfloat16 (so the float32 copy of the same
// values, x.to(kFloat32), is exact).
inline Tensor rnd_bf16(const Shape& shape, double lo = -1.0, double hi = 1.0, Device d = kCPU) {
  return uniform(shape, lo, hi, kFloat32).to(d, kBFloat16);
}

inline Tensor f32(const Tensor& t) { return t.to(kFloat32); }
inline Tensor bf16(const Tensor& t) { return t.to(kBFloat16); }

// Element (r, c) of a 2-D tensor set to v (for NaNs, ties and equal pairs).
inline void set(const Tensor& t, int64_t r, int64_t c, float v) { t.select(0, r).slice(0, c, c + 1).fill_(v); }

// The bit patterns of a bfloat16 tensor, in row-major order.
inline std::vector<uint16_t> bf16_bits(const Tensor& t) {
  REQUIRE(t.dtype() == kBFloat16);
  const Tensor h = t.to(kCPU).contiguous();
  const BFloat16* p = h.data<BFloat16>();
  std::vector<uint16_t> out(static_cast<size_t>(h.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = p[i].bits;
  return out;
}

inline bool bf16_is_nan(uint16_t b) {
  return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0;
}

// Distance in bfloat16 ulps between two bit patterns: 0 for equal values (+0 and -0 included)
// and for two NaNs, a large number for a NaN against a number.
inline int64_t ulp_distance(uint16_t a, uint16_t b) {
  if (bf16_is_nan(a) || bf16_is_nan(b)) return bf16_is_nan(a) && bf16_is_nan(b) ? 0 : 1 << 20;
  auto ordered = [](uint16_t v) -> int64_t {
    return (v & 0x8000u) ? -static_cast<int64_t>(v & 0x7fffu) : static_cast<int64_t>(v);
  };
  return std::llabs(ordered(a) - ordered(b));
}

// Requires got and want (both bfloat16, same shape) to be within max_ulps of each other
// everywhere; reports the worst element.
inline void require_ulps(const Tensor& got, const Tensor& want, int64_t max_ulps) {
  REQUIRE(got.dtype() == kBFloat16);
  REQUIRE(want.dtype() == kBFloat16);
  REQUIRE(got.shape() == want.shape());
  const std::vector<uint16_t> g = bf16_bits(got), w = bf16_bits(want);
  int64_t worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const int64_t d = ulp_distance(g[i], w[i]);
    if (d > worst) worst = d, at = i;
  }
  INFO("worst element " << at << ": got 0x" << std::hex << (g.empty() ? 0 : g[at]) << ", want 0x"
                        << (w.empty() ? 0 : w[at]) << std::dec << " (" << worst << " ulps, at most "
                        << max_ulps << ")");
  REQUIRE(worst <= max_ulps);
}

}  // namespace tandem::test
