#pragma once
// Helpers for the float64 gradient checks of tests/autograd.
#include <functional>
#include <vector>

#include "autograd/gradcheck.h"
#include "catch.h"
#include "core/generator.h"
#include "core/tensor.h"

namespace tandem::test {

// A float64 leaf requiring grad, uniform in [lo, hi).
inline Tensor leaf(const Shape& shape, double lo = -1.0, double hi = 1.0) {
  Tensor t = uniform(shape, lo, hi, kFloat64);
  t.set_requires_grad();
  return t;
}

// A float64 leaf with every |value| in [gap, 1 + gap): no element near a kink at zero.
inline Tensor leaf_away_from_zero(const Shape& shape, double gap = 0.2) {
  std::vector<double> v = uniform(shape, -1.0, 1.0, kFloat64).to_vector<double>();
  for (double& x : v) x += x >= 0 ? gap : -gap;
  Tensor t = from_vector(v, shape);
  t.set_requires_grad();
  return t;
}

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

inline void check_gradients(const Fn& fn, const std::vector<Tensor>& inputs) {
  autograd::GradcheckResult r = autograd::gradcheck(fn, inputs);
  INFO(r.message);
  REQUIRE(r.ok);
}

}  // namespace tandem::test
