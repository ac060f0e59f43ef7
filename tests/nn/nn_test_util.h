#pragma once
// Small utilities shared by the nn tests.
#include <string>
#include <vector>

#include "catch.h"
#include "helpers.h"
#include "core/tensor.h"

namespace tandem::test {


// A float64 CPU tensor holding `values` (row-major).
inline Tensor f64(const std::vector<double>& values, const Shape& shape) {
  return from_vector<double>(values, shape);
}

}  // namespace tandem::test
