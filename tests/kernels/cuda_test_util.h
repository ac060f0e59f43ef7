#pragma once
// Shared by the CUDA-vs-CPU kernel tests: run the same kernels:: op on CPU inputs and on CUDA
// copies of them, then compare.
#include "catch.h"
#include "core/device.h"
#include "helpers.h"

namespace tandem::test {

inline const Device kGpu = Device::cuda(0);
inline const DType kFloatTypes[] = {kFloat32, kFloat64};

inline double tol(DType t) { return t == kFloat32 ? 1e-5 : 1e-12; }

inline Tensor gpu(const Tensor& t) { return t.to(kGpu); }

// Requires `got` (on the GPU) to match `want` (on the CPU) to `scale` times the tolerance.
inline void check(const Tensor& got, const Tensor& want, double scale = 1.0) {
  REQUIRE(got.device() == kGpu);
  REQUIRE(got.dtype() == want.dtype());
  REQUIRE(got.shape() == want.shape());
  const double err = rel_error(got, want);
  INFO("relative error " << err << " (" << dtype_name(want.dtype()) << ")");
  REQUIRE(err <= tol(want.dtype()) * scale);
}

// Exact equality (integer results, copies, indices).
inline void check_equal(const Tensor& got, const Tensor& want) {
  REQUIRE(got.device() == kGpu);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(values(got) == values(want));
}

}  // namespace tandem::test
