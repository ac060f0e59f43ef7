#pragma once
// Shared test helpers.
#include <cmath>
#include <string>
#include <vector>

#include "catch.h"
#include "core/tensor.h"

namespace tandem::test {

// True when at least one GPU is usable; CUDA sections return early (and say so) otherwise.
bool have_cuda();

// max |a - b| / max(1, max |b|) over all elements, after copying both to the CPU as float64.
double rel_error(const Tensor& a, const Tensor& b);
// Copies a tensor to the CPU as float64 values.
std::vector<double> values(const Tensor& t);

}  // namespace tandem::test

// Skips the rest of a test case on a machine without a GPU.
#define TANDEM_REQUIRE_CUDA()                         \
  do {                                                \
    if (!::tandem::test::have_cuda()) {               \
      WARN("no GPU on this machine: CUDA part skipped"); \
      return;                                         \
    }                                                 \
  } while (0)
