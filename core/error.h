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
  // Throws a new error of this one's dynamic type whose message is `prefix` + what(): a
  // caller that catches ShapeError still catches it after it was passed on with more context
  // (a worker thread's rank and device, for instance).
  [[noreturn]] virtual void rethrow_with_prefix(const std::string& prefix) const {
    throw Error(prefix + what());
  }
};

namespace detail {
// The base of every error type below Error: gives it rethrow_with_prefix for its own type,
// so that no list of types has to be kept in step with this file by hand.
template <class Self, class Parent>
class ErrorOf : public Parent {
 public:
  using Parent::Parent;
  [[noreturn]] void rethrow_with_prefix(const std::string& prefix) const override {
    throw Self(prefix + this->what());
  }
};
}  // namespace detail

// A new error type derives from detail::ErrorOf<itself, its parent> and joins
// TANDEM_ERROR_TYPES below.
class ShapeError : public detail::ErrorOf<ShapeError, Error> { using ErrorOf::ErrorOf; };
class DeviceError : public detail::ErrorOf<DeviceError, Error> { using ErrorOf::ErrorOf; };
class DTypeError : public detail::ErrorOf<DTypeError, Error> { using ErrorOf::ErrorOf; };
class ValueError : public detail::ErrorOf<ValueError, Error> { using ErrorOf::ErrorOf; };
class IOError : public detail::ErrorOf<IOError, Error> { using ErrorOf::ErrorOf; };
class FormatError : public detail::ErrorOf<FormatError, IOError> { using ErrorOf::ErrorOf; };
class CudaError : public detail::ErrorOf<CudaError, Error> { using ErrorOf::ErrorOf; };
class CublasError : public detail::ErrorOf<CublasError, CudaError> { using ErrorOf::ErrorOf; };
class CudnnError : public detail::ErrorOf<CudnnError, CudaError> { using ErrorOf::ErrorOf; };
class NcclError : public detail::ErrorOf<NcclError, Error> { using ErrorOf::ErrorOf; };
// Between processes: rendezvous, the store, a process group's collectives.
class DistError : public detail::ErrorOf<DistError, Error> { using ErrorOf::ErrorOf; };
// A wait that ran past its deadline (a store key, a barrier, a collective).
class TimeoutError : public detail::ErrorOf<TimeoutError, DistError> { using ErrorOf::ErrorOf; };

// Every error type, as X(Kind, Type): Kind is what TANDEM_CHECK / TANDEM_THROW take. The one
// list the kind enum, throw_error and the tests are made from.
#define TANDEM_ERROR_TYPES(X) \
  X(Error, Error)             \
  X(Shape, ShapeError)        \
  X(Device, DeviceError)      \
  X(DType, DTypeError)        \
  X(Value, ValueError)        \
  X(IO, IOError)              \
  X(Format, FormatError)      \
  X(Cuda, CudaError)          \
  X(Cublas, CublasError)      \
  X(Cudnn, CudnnError)        \
  X(Nccl, NcclError)          \
  X(Dist, DistError)          \
  X(Timeout, TimeoutError)

namespace detail {
// Streams every argument into one string: str("x=", 3, " y=", 4.5).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
#define TANDEM_ERROR_KIND_ENUM_(kind, type) k##kind,
enum ErrorKind : int { TANDEM_ERROR_TYPES(TANDEM_ERROR_KIND_ENUM_) kNumErrorKinds };
#undef TANDEM_ERROR_KIND_ENUM_
// Throws the error type of `kind` with msg + " (file:line)".
[[noreturn]] void throw_error(int kind, const std::string& msg, const char* file, int line);
void log_error(const std::string& msg, const char* file, int line) noexcept;
}  // namespace detail

}  // namespace tandem

// TANDEM_CHECK(cond, Kind, message parts...): throws tandem::<Kind>Error when cond is false.
// Kind is one of the kinds of TANDEM_ERROR_TYPES: Error, Shape, Device, DType, Value, IO,
// Format, Cuda, Cublas, Cudnn, Nccl, Dist, Timeout.
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
