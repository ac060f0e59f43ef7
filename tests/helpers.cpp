#include "helpers.h"

#include <algorithm>

#include "core/device.h"
#include "core/error.h"
#include "kernels/backend.h"

namespace tandem::test {

namespace {
// The suite compares CUDA against the CPU in exact float32: no TF32 convolutions.
const bool tf32_off = (set_allow_tf32(false), true);
}  // namespace

bool have_cuda() { return cuda_device_count() > 0; }

std::vector<Device> test_devices() {
  if (!have_cuda()) {
    WARN("no GPU on this machine: CUDA part skipped");
    return {kCPU};
  }
  return {kCPU, Device::cuda(0)};
}

std::vector<double> values(const Tensor& t) { return t.to(kCPU, kFloat64).contiguous().to_vector<double>(); }

double rel_error(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  auto va = values(a), vb = values(b);
  double num = 0, den = 1;
  for (size_t i = 0; i < va.size(); ++i) {
    num = std::max(num, std::abs(va[i] - vb[i]));
    den = std::max(den, std::abs(vb[i]));
  }
  return num / den;
}

std::vector<ErrorCase> error_cases() {
  return {
#define TANDEM_TEST_ERROR_CASE_(kind, type) {detail::k##kind, #type, typeid(type)},
      TANDEM_ERROR_TYPES(TANDEM_TEST_ERROR_CASE_)
#undef TANDEM_TEST_ERROR_CASE_
  };
}

}  // namespace tandem::test
