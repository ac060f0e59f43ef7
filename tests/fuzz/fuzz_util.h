#pragma once
// Shared by the libFuzzer targets: what counts as a finding besides a sanitizer report.
//
// A parser given arbitrary bytes may only throw the typed errors its header documents. Any
// other exception (std::bad_alloc from a size the input merely claims, std::out_of_range, a
// tandem error of the wrong type) and any broken property of a successful parse is reported
// and aborts, which libFuzzer records as a crash with the input that caused it.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <typeinfo>

#include "core/error.h"

namespace tandem::fuzz {

[[noreturn]] inline void fail(const char* what, const char* detail) {
  std::fprintf(stderr, "fuzz finding: %s: %s\n", what, detail);
  std::fflush(stderr);
  std::abort();
}

// Runs f; returns true when it returned, false when it threw one of Allowed..., and aborts on
// any other exception.
template <typename... Allowed, typename F>
bool returns_or_throws(F&& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    if ((dynamic_cast<const Allowed*>(&e) || ...)) return false;
    fail(typeid(e).name(), e.what());
  } catch (...) {
    fail("unknown exception", "not derived from std::exception");
  }
}

// Aborts with `what` unless cond holds (a property of a successful parse).
inline void expect(bool cond, const char* what) {
  if (!cond) fail("broken property", what);
}

}  // namespace tandem::fuzz
