#pragma once
// The tandem::Error hierarchy and the check macros that throw it.
//
// Library code never exits or aborts: every failure is an exception that names the
// failing expression, the file and line, and the values involved, e.g.
//   "matmul: [256,400] @ [120,84]: inner dims 400 != 120 (kernels/ops.cpp:88)".
// Destructors must not throw; they use TANDEM_LOG_ERROR instead.
#include <sstream>
#include <stdexcept>
#include <string>

namespace tandem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};
class ShapeError : public Error { using Error::Error; };
class DeviceError : public Error { using Error::Error; };
class DTypeError : public Error { using Error::Error; };
class ValueError : public Error { using Error::Error; };
class IOError : public Error { using Error::Error; };
class FormatError : public IOError { using IOError::IOError; };
class CudaError : public Error { using Error::Error; };
class CublasError : public CudaError { using CudaError::CudaError; };
class CudnnError : public CudaError { using CudaError::CudaError; };
class NcclError : public Error { using Error::Error; };
// Between processes: rendezvous, the store, a process group's collectives.
class DistError : public Error { using Error::Error; };
// A wait that ran past its deadline (a store key, a barrier, a collective).
class TimeoutError : public DistError { using DistError::DistError; };

namespace detail {
// Streams every argument into one string: str("x=", 3, " y=", 4.5).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
[[noreturn]] void throw_error(int kind, const std::string& msg, const char* file, int line);
void log_error(const std::string& msg, const char* file, int line) noexcept;
enum ErrorKind : int {
  kError, kShape, kDevice, kDType, kValue, kIO, kFormat, kCuda, kCublas, kCudnn, kNccl, kDist, kTimeout
};
}  // namespace detail

}  // namespace tandem

// TANDEM_CHECK(cond, Kind, message parts...): throws tandem::<Kind>Error when cond is false.
// Kind is one of Error, Shape, Device, DType, Value, IO, Format, Cuda, Nccl, Dist, Timeout.
#define TANDEM_CHECK(cond, kind, ...)                                                  \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::tandem::detail::throw_error(::tandem::detail::k##kind,                         \
                                    ::tandem::detail::str(__VA_ARGS__), __FILE__,      \
                                    __LINE__);                                         \
    }                                                                                  \
  } while (0)

// TANDEM_THROW(Kind, message parts...): unconditional.
#define TANDEM_THROW(kind, ...)                                                             \
  ::tandem::detail::throw_error(::tandem::detail::k##kind, ::tandem::detail::str(__VA_ARGS__), \
                                __FILE__, __LINE__)

#define TANDEM_LOG_ERROR(...) \
  ::tandem::detail::log_error(::tandem::detail::str(__VA_ARGS__), __FILE__, __LINE__)
