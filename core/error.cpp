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
    case kShape: throw ShapeError(full);
    case kDevice: throw DeviceError(full);
    case kDType: throw DTypeError(full);
    case kValue: throw ValueError(full);
    case kIO: throw IOError(full);
    case kFormat: throw FormatError(full);
    case kCuda: throw CudaError(full);
    case kCublas: throw CublasError(full);
    case kCudnn: throw CudnnError(full);
    case kNccl: throw NcclError(full);
    case kDist: throw DistError(full);
    case kTimeout: throw TimeoutError(full);
    default: throw Error(full);
  }
}

void log_error(const std::string& msg, const char* file, int line) noexcept {
  std::fprintf(stderr, "tandem: error: %s (%s:%d)\n", msg.c_str(), short_path(file), line);
}

}  // namespace tandem::detail
