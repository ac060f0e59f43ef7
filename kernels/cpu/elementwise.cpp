// Elementwise kernels: fill, copy (with dtype conversion), unary, binary, scalar, axpby.
// All take arbitrary strides; the loops live in map1/map2 (cpu_kernels.h).
#include <cmath>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

template <typename T>
constexpr bool kFloat = std::is_floating_point_v<T>;

// max/min that propagate NaN from either side, as torch.maximum does.
template <typename T>
inline T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T>
inline T min_nan(T a, T b) {
  return (a < b || a != a) ? a : b;
}

template <typename T>
void unary_typed(UnaryOp op, const Tensor& x, const Tensor& out) {
  switch (op) {
    case UnaryOp::Neg: return map1<T, T>(x, out, [](T v) { return static_cast<T>(-v); });
    case UnaryOp::Relu: return map1<T, T>(x, out, [](T v) { return v > T(0) ? v : T(0); });
    case UnaryOp::Abs:
      return map1<T, T>(x, out, [](T v) {
        if constexpr (std::is_unsigned_v<T>) return v;
        else return v < T(0) ? static_cast<T>(-v) : v;
      });
    case UnaryOp::Square: return map1<T, T>(x, out, [](T v) { return static_cast<T>(v * v); });
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case UnaryOp::Exp: return map1<T, T>(x, out, [](T v) { return std::exp(v); });
      case UnaryOp::Log: return map1<T, T>(x, out, [](T v) { return std::log(v); });
      // 1 / (1 + e^-x) saturates cleanly at both ends: e^-x = inf gives exactly 0.
      case UnaryOp::Sigmoid:
        return map1<T, T>(x, out, [](T v) { return T(1) / (T(1) + std::exp(-v)); });
      case UnaryOp::Tanh: return map1<T, T>(x, out, [](T v) { return std::tanh(v); });
      case UnaryOp::Sqrt: return map1<T, T>(x, out, [](T v) { return std::sqrt(v); });
      case UnaryOp::Reciprocal: return map1<T, T>(x, out, [](T v) { return T(1) / v; });
      default: break;
    }
  }
  TANDEM_THROW(DType, "unary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(x.dtype()));
}

template <typename T>
void binary_typed(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  switch (op) {
    case BinaryOp::Add: return map2<T>(a, b, out, [](T x, T y) { return static_cast<T>(x + y); });
    case BinaryOp::Sub: return map2<T>(a, b, out, [](T x, T y) { return static_cast<T>(x - y); });
    case BinaryOp::Mul: return map2<T>(a, b, out, [](T x, T y) { return static_cast<T>(x * y); });
    case BinaryOp::Max: return map2<T>(a, b, out, [](T x, T y) { return max_nan(x, y); });
    case BinaryOp::Min: return map2<T>(a, b, out, [](T x, T y) { return min_nan(x, y); });
    case BinaryOp::Eq: return map2<T>(a, b, out, [](T x, T y) { return x == y ? T(1) : T(0); });
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case BinaryOp::Div: return map2<T>(a, b, out, [](T x, T y) { return x / y; });
      case BinaryOp::ReluBackward:
        return map2<T>(a, b, out, [](T g, T x) { return x > T(0) ? g : T(0); });
      case BinaryOp::SigmoidBackward:
        return map2<T>(a, b, out, [](T g, T y) { return g * y * (T(1) - y); });
      case BinaryOp::TanhBackward:
        return map2<T>(a, b, out, [](T g, T y) { return g * (T(1) - y * y); });
      default: break;
    }
  }
  TANDEM_THROW(DType, "binary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(a.dtype()));
}

template <typename T>
void scalar_typed(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  const T sv = static_cast<T>(s);
  switch (op) {
    case ScalarOp::Add: return map1<T, T>(x, out, [sv](T v) { return static_cast<T>(v + sv); });
    case ScalarOp::Mul: return map1<T, T>(x, out, [sv](T v) { return static_cast<T>(v * sv); });
    case ScalarOp::RSub: return map1<T, T>(x, out, [sv](T v) { return static_cast<T>(sv - v); });
    default: break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case ScalarOp::RDiv: return map1<T, T>(x, out, [sv](T v) { return sv / v; });
      case ScalarOp::Pow:
        // The common exponents skip std::pow: it is slow and not vectorizable.
        if (s == 2.0) return map1<T, T>(x, out, [](T v) { return v * v; });
        if (s == 1.0) return map1<T, T>(x, out, [](T v) { return v; });
        if (s == 0.5) return map1<T, T>(x, out, [](T v) { return std::sqrt(v); });
        if (s == -1.0) return map1<T, T>(x, out, [](T v) { return T(1) / v; });
        return map1<T, T>(x, out, [sv](T v) { return std::pow(v, sv); });
      default: break;
    }
  }
  TANDEM_THROW(DType, "scalar op ", static_cast<int>(op), " is not defined for ",
               dtype_name(x.dtype()));
}

}  // namespace

void CpuBackend::fill(const Tensor& out, double value) {
  dispatch_all(out.dtype(), "fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = static_cast<T>(value);
    T* p = static_cast<T*>(out.raw_data());
    for_each_run<1>(out.shape(), {&out.strides()},
                    [&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& st) {
                      T* o = p + off[0];
                      if (st[0] == 1) {
                        for (int64_t i = 0; i < n; ++i) o[i] = v;
                      } else {
                        for (int64_t i = 0; i < n; ++i) o[i * st[0]] = v;
                      }
                    });
  });
}

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    if (dst.nbytes() > 0 && src.raw_data() != dst.raw_data()) {
      std::memcpy(dst.raw_data(), src.raw_data(), dst.nbytes());
    }
    return;
  }
  dispatch_all(src.dtype(), "copy", [&](auto stag) {
    using S = typename decltype(stag)::type;
    dispatch_all(dst.dtype(), "copy", [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      map1<D, S>(src, dst, [](S v) { return static_cast<D>(v); });
    });
  });
}

void CpuBackend::unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  dispatch_all(x.dtype(), "unary", [&](auto tag) {
    unary_typed<typename decltype(tag)::type>(op, x, out);
  });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  dispatch_all(a.dtype(), "binary", [&](auto tag) {
    binary_typed<typename decltype(tag)::type>(op, a, b, out);
  });
}

void CpuBackend::scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  dispatch_all(x.dtype(), "scalar", [&](auto tag) {
    scalar_typed<typename decltype(tag)::type>(op, x, s, out);
  });
}

void CpuBackend::axpby(double alpha, const Tensor& x, double beta, const Tensor& out) {
  dispatch_all(x.dtype(), "axpby", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T al = static_cast<T>(alpha), be = static_cast<T>(beta);
    // beta == 0 ignores out's old contents (as BLAS does), so uninitialized memory or NaNs in
    // it never leak into the result.
    if (beta == 0.0) {
      map2<T>(x, out, out, [al](T v, T) { return static_cast<T>(al * v); });
    } else if (alpha == 1.0 && beta == 1.0) {
      map2<T>(x, out, out, [](T v, T o) { return static_cast<T>(v + o); });
    } else {
      map2<T>(x, out, out, [al, be](T v, T o) { return static_cast<T>(al * v + be * o); });
    }
  });
}

}  // namespace tandem::cpu
