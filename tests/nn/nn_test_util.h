#pragma once
// Small utilities shared by the nn tests.
#include <string>
#include <vector>

#include "catch.h"
#include "core/tensor.h"

namespace tandem::test {

// The message of the E thrown by f; fails the test when f throws nothing.
template <typename E, typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return "";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A float64 CPU tensor holding `values` (row-major).
inline Tensor f64(const std::vector<double>& values, const Shape& shape) {
  return from_vector<double>(values, shape);
}

}  // namespace tandem::test
