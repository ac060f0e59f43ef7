// The error hierarchy: every kind of TANDEM_ERROR_TYPES throws its own type with the message,
// file and line; parents catch their children; and the messages of core's own checks name the
// value, shape, dtype or device at fault.
#include <typeinfo>

#include "catch.h"
#include "core/error.h"
#include "core/tensor.h"
#include "helpers.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#endif

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;

TEST_CASE("every error kind throws its own type with the message, file and line", "[core]") {
  const std::vector<test::ErrorCase> cases = test::error_cases();
  REQUIRE(cases.size() == static_cast<size_t>(detail::kNumErrorKinds));
  for (const test::ErrorCase& c : cases) {
    INFO(c.name);
    try {
      detail::throw_error(c.kind, std::string("bad ") + c.name, "/src/tandem/core/thing.cpp", 42);
    } catch (const Error& e) {
      CHECK(typeid(e) == c.type);
      CHECK(std::string(e.what()) == std::string("bad ") + c.name + " (core/thing.cpp:42)");
      // rethrow_with_prefix keeps the type and puts the prefix first.
      try {
        e.rethrow_with_prefix("context: ");
      } catch (const Error& again) {
        CHECK(typeid(again) == c.type);
        CHECK(std::string(again.what()) == std::string("context: bad ") + c.name + " (core/thing.cpp:42)");
      }
    }
  }
}

TEST_CASE("error types are caught by their parents", "[core]") {
  CHECK_THROWS_AS(TANDEM_THROW(Format, "x"), IOError);
  CHECK_THROWS_AS(TANDEM_THROW(Cublas, "x"), CudaError);
  CHECK_THROWS_AS(TANDEM_THROW(Cudnn, "x"), CudaError);
  CHECK_THROWS_AS(TANDEM_THROW(Timeout, "x"), DistError);
  CHECK_THROWS_AS(TANDEM_THROW(Nccl, "x"), Error);
  CHECK_THROWS_AS(TANDEM_THROW(Shape, "x"), std::runtime_error);
  // ...and not by their siblings.
  CHECK_THROWS_AS([] {
    try {
      TANDEM_THROW(IO, "x");
    } catch (const FormatError&) {
      FAIL("an IOError is not a FormatError");
    }
  }(), IOError);
}

TEST_CASE("TANDEM_CHECK throws only when the condition is false, with every part streamed", "[core]") {
  int evaluated = 0;
  TANDEM_CHECK(++evaluated == 1, Value, "never thrown");
  CHECK(evaluated == 1);
  const std::string msg = error_message<ShapeError>([] {
    const int64_t got = 3;
    TANDEM_CHECK(got == 4, Shape, "op: expected 4 dims, got ", got, " in ", shape_str({1, 2, 3}));
  });
  CHECK(contains(msg, "op: expected 4 dims, got 3 in [1,2,3] (core/test_error.cpp:"));
}

TEST_CASE("core's error messages name the shape, dtype, device or value at fault", "[core]") {
  Tensor t = zeros({2, 3}, kFloat64);
  // ShapeError: the shapes.
  CHECK(contains(error_message<ShapeError>([&] { t.view({4, 2}); }), "cannot view [2,3] (6 elements) as [4,2]"));
  CHECK(contains(error_message<ShapeError>([&] { t.item(); }), "one-element tensor, got [2,3]"));
  CHECK(contains(error_message<ShapeError>([] { Tensor({2, -1}, kFloat32, kCPU); }), "negative dimension in shape [2,-1]"));
  CHECK(contains(error_message<ShapeError>([] { from_vector<float>({1, 2, 3}, {2, 2}); }), "3 values for shape [2,2]"));
  // DTypeError: both dtypes.
  const std::string dt = error_message<DTypeError>([&] { t.data<float>(); });
  CHECK(contains(dt, "data<float32>() on a float64 tensor"));
  CHECK(contains(error_message<DTypeError>([] { rand({2}, kInt64); }), "got int64"));
  // DeviceError: the device and why.
  CHECK(contains(error_message<DeviceError>([] { check_device_exists(Device::cpu(64)); }), "cpu:64 does not exist"));
  CHECK(contains(error_message<DeviceError>([] { check_device_exists(Device::cuda(1000)); }), "cuda:1000"));
  // ValueError: the value.
  CHECK(contains(error_message<ValueError>([] { arange(0, 4, 0); }), "step must not be 0"));
  CHECK(contains(error_message<ValueError>([] { Tensor().shape(); }), "undefined tensor"));
}

#ifdef TANDEM_WITH_CUDA
TEST_CASE("CUDA check macros name the expression and the library's error", "[core][cuda]") {
  // Runs without a GPU too: an invalid device is an error either way.
  const std::string msg = error_message<CudaError>([] { TANDEM_CUDA_CHECK(cudaSetDevice(-1)); });
  CHECK(contains(msg, "cudaSetDevice(-1) failed: cudaError"));
  CHECK(contains(msg, "(core/test_error.cpp:"));
  CHECK(contains(error_message<CublasError>([] { TANDEM_CUBLAS_CHECK(7); }), "7 failed: cublas status 7"));
  TANDEM_CUDA_CHECK(cudaSuccess);  // success does not throw
  cudaGetLastError();              // clear the sticky error the failed call left
}
#endif
