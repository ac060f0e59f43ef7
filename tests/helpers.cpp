#include "helpers.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>

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

StderrCapture::StderrCapture() {
  static std::atomic<int> counter{0};
  std::fflush(stderr);
  path_ = "/tmp/tandem_test_stderr_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
  saved_ = ::dup(2);
  const int fd = ::open(path_.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  ::close(fd);
}

StderrCapture::~StderrCapture() {
  std::fflush(stderr);
  ::dup2(saved_, 2);
  ::close(saved_);
  ::unlink(path_.c_str());
}

std::string StderrCapture::text() const {
  std::fflush(stderr);
  std::ifstream f(path_);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace tandem::test
