#pragma once
// Shared test helpers.
#include <cmath>
#include <string>
#include <typeinfo>
#include <vector>

#include "catch.h"
#include "core/tensor.h"

namespace tandem::test {

// True when at least one GPU is usable; CUDA sections return early (and say so) otherwise.
bool have_cuda();
// The CPU, and cuda:0 when there is a GPU (a test looping over them warns once without one).
std::vector<Device> test_devices();

// max |a - b| / max(1, max |b|) over all elements, after copying both to the CPU as float64.
double rel_error(const Tensor& a, const Tensor& b);
// Copies a tensor to the CPU as float64 values.
std::vector<double> values(const Tensor& t);

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

// What the process writes to stderr while the object lives (a file descriptor 2 redirected to
// a temporary file); text() reads it so far.
class StderrCapture {
 public:
  StderrCapture();
  ~StderrCapture();
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  std::string text() const;

 private:
  std::string path_;
  int saved_ = -1;
};

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every error type of the one list in core/error.h (TANDEM_ERROR_TYPES): its kind, its name
// and its type, for tests that must cover each of them.
struct ErrorCase {
  int kind;
  const char* name;
  const std::type_info& type;
};
std::vector<ErrorCase> error_cases();

}  // namespace tandem::test

// Skips the rest of a test case on a machine without a GPU.
#define TANDEM_REQUIRE_CUDA()                         \
  do {                                                \
    if (!::tandem::test::have_cuda()) {               \
      WARN("no GPU on this machine: CUDA part skipped"); \
      return;                                         \
    }                                                 \
  } while (0)
