#include "core/error.h"

#include <cstdio>
#include <cstring>

namespace tandem::detail {

namespace {
// "/abs/path/to/tandem/kernels/ops.cpp" -> "kernels/ops.cpp": keeps messages short and stable.
const char* short_path(const char* file) {
  static const char* roots[] = {"/core/", "/kernels/", "/autograd/", "/nn/", "/data/",
                                "/parallel/", "/examples/", "/bench/", "/tests/"};
  const char* best = file;
  for (const char* r : roots) {
    if (const char* p = std::strstr(file, r)) {
      if (best == file || p > best) best = p + 1;
    }
  }
  return best;
}
}  // namespace

void throw_error(int kind, const std::string& msg, const char* file, int line) {
  std::string full = msg + " (" + short_path(file) + ":" + std::to_string(line) + ")";
  switch (kind) {
#define TANDEM_ERROR_THROW_(kind_name, type) \
  case k##kind_name: throw type(full);
    TANDEM_ERROR_TYPES(TANDEM_ERROR_THROW_)
#undef TANDEM_ERROR_THROW_
    default: throw Error(full);
  }
}

void log_error(const std::string& msg, const char* file, int line) noexcept {
  std::fprintf(stderr, "tandem: error: %s (%s:%d)\n", msg.c_str(), short_path(file), line);
}

}  // namespace tandem::detail
