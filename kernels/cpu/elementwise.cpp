// Elementwise kernels: fill, copy (with dtype conversion), unary, binary, scalar, axpby.
// All take arbitrary strides; the loops live in map1/map2 (cpu_kernels.h). bfloat16 computes
// in float and rounds once per element (Note [bfloat16 arithmetic] in core/bfloat16.h).
//
// Note [no-trapping-math]: with GCC's default -ftrapping-math a floating-point comparison may
// raise an FP exception flag, so `x > 0 ? x : 0` (relu, max, clamps) is kept as a branch and the
// loop around it is not vectorized. tandem never reads FP exception flags; dropping that
// guarantee for this file lets those loops vectorize and leaves every result unchanged.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem::cpu {

namespace {

// Float-only ops exist for float32, float64 and bfloat16.
template <typename T>
constexpr bool kFloat = is_floating_type_v<T>;

// max/min that propagate NaN from either side, as torch.maximum does.
template <typename T>
inline T max_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T>
inline T min_nan(T a, T b) {
  return (a < b || a != a) ? a : b;
}

// Note [vectorizable exp]: std::exp is an opaque libm call per element, which made sigmoid the
// most expensive elementwise op of LeNet. exp_fast is plain arithmetic the compiler vectorizes:
// x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2), exp(r) from the Cephes expf
// polynomial (about 1 ulp), and 2^n applied as two exactly representable powers of two, so
// results down to the smallest denormal and up to overflow (inf) come out right. float32 only:
// float64 keeps std::exp, it is the precision reference (gradcheck) rather than the fast path.
inline float exp_fast(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  xc = x != x ? 0.0f : xc;
  // Round to nearest by the 1.5 * 2^23 trick (valid for |t| < 2^22).
  const float fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t n = static_cast<int32_t>(fn);  // in [-150, 128]
  const int32_t n1 = n >> 1, n2 = n - n1;
  const float s1 = std::bit_cast<float>(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = std::bit_cast<float>(static_cast<uint32_t>(n2 + 127) << 23);
  return x != x ? x : p * s1 * s2;
}

template <typename T>
inline T exp_t(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_fast(x);
  } else {
    return std::exp(x);
  }
}

// Contiguous float32 exp / sigmoid, the hot activations of small CNNs. The library is built
// for baseline x86-64, where exp_fast vectorizes only 4 wide; these loops are also compiled
// for AVX2 and AVX-512 and the best one for the running CPU is picked at load time.
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TANDEM_VECTOR_CLONES
#endif

TANDEM_VECTOR_CLONES void exp_contiguous(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_fast(x[i]);
}

TANDEM_VECTOR_CLONES void sigmoid_contiguous(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + exp_fast(-x[i]));
}

// Every op computes in C = opmath_t<T> (float for bfloat16, T itself otherwise) and rounds
// once at the end (Note [bfloat16 arithmetic]); for the other dtypes the casts are no-ops.
template <typename T>
void unary_typed(UnaryOp op, const Tensor& x, const Tensor& out) {
  using C = opmath_t<T>;
  // f applied in C to each element.
  auto run = [&](auto f) {
    map1<T, T>(x, out, [f](T v) { return static_cast<T>(f(static_cast<C>(v))); });
  };
  switch (op) {
    case UnaryOp::Neg:
      return run([](C v) { return static_cast<C>(-v); });
    case UnaryOp::Relu:
      return run([](C v) { return v > C(0) ? v : C(0); });
    case UnaryOp::Abs:
      return run([](C v) {
        if constexpr (std::is_unsigned_v<C>)
          return v;
        else
          return v < C(0) ? static_cast<C>(-v) : v;
      });
    case UnaryOp::Square:
      return run([](C v) { return static_cast<C>(v * v); });
    default:
      break;
  }
  if constexpr (std::is_same_v<T, float>) {
    if ((op == UnaryOp::Exp || op == UnaryOp::Sigmoid) && x.is_contiguous() &&
        out.is_contiguous()) {
      auto* kernel = op == UnaryOp::Exp ? exp_contiguous : sigmoid_contiguous;
      return kernel(x.data<float>(), out.data<float>(), out.numel());
    }
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case UnaryOp::Exp:
        return run([](C v) { return exp_t(v); });
      case UnaryOp::Log:
        return run([](C v) { return std::log(v); });
      // 1 / (1 + e^-x) saturates cleanly at both ends: e^-x = inf gives exactly 0.
      case UnaryOp::Sigmoid:
        return run([](C v) { return C(1) / (C(1) + exp_t(-v)); });
      case UnaryOp::Tanh:
        return run([](C v) { return std::tanh(v); });
      case UnaryOp::Sqrt:
        return run([](C v) { return std::sqrt(v); });
      case UnaryOp::Reciprocal:
        return run([](C v) { return C(1) / v; });
      default:
        break;
    }
  }
  TANDEM_THROW(DType, "unary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(x.dtype()));
}

template <typename T>
void binary_typed(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  using C = opmath_t<T>;
  auto run = [&](auto f) {
    map2<T>(a, b, out,
            [f](T x, T y) { return static_cast<T>(f(static_cast<C>(x), static_cast<C>(y))); });
  };
  switch (op) {
    case BinaryOp::Add:
      return run([](C x, C y) { return static_cast<C>(x + y); });
    case BinaryOp::Sub:
      return run([](C x, C y) { return static_cast<C>(x - y); });
    case BinaryOp::Mul:
      return run([](C x, C y) { return static_cast<C>(x * y); });
    case BinaryOp::Max:
      return run([](C x, C y) { return max_nan(x, y); });
    case BinaryOp::Min:
      return run([](C x, C y) { return min_nan(x, y); });
    case BinaryOp::Eq:
      return run([](C x, C y) { return x == y ? C(1) : C(0); });
    case BinaryOp::AddRelu:  // the sum rounded to T, then relu: relu(add(a, b)) bit for bit
      return map2<T>(a, b, out, [](T x, T y) {
        const C s = static_cast<C>(static_cast<T>(static_cast<C>(x) + static_cast<C>(y)));
        return static_cast<T>(s > C(0) ? s : C(0));
      });
    default:
      break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case BinaryOp::Div:
        return run([](C x, C y) { return x / y; });
      case BinaryOp::ReluBackward:
        return run([](C g, C x) { return x > C(0) ? g : C(0); });
      case BinaryOp::SigmoidBackward:
        return run([](C g, C y) { return g * y * (C(1) - y); });
      case BinaryOp::TanhBackward:
        return run([](C g, C y) { return g * (C(1) - y * y); });
      default:
        break;
    }
  }
  TANDEM_THROW(DType, "binary op ", static_cast<int>(op), " is not defined for ",
               dtype_name(a.dtype()));
}

// The scalar stays in C: a bfloat16 tensor times 0.1 multiplies by float 0.1, not by 0.1
// rounded to bfloat16 (PyTorch keeps scalars in opmath precision too).
template <typename T>
void scalar_typed(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  using C = opmath_t<T>;
  const C sv = static_cast<C>(s);
  auto run = [&](auto f) {
    map1<T, T>(x, out, [f](T v) { return static_cast<T>(f(static_cast<C>(v))); });
  };
  switch (op) {
    case ScalarOp::Add:
      return run([sv](C v) { return static_cast<C>(v + sv); });
    case ScalarOp::Mul:
      return run([sv](C v) { return static_cast<C>(v * sv); });
    case ScalarOp::RSub:
      return run([sv](C v) { return static_cast<C>(sv - v); });
    default:
      break;
  }
  if constexpr (kFloat<T>) {
    switch (op) {
      case ScalarOp::RDiv:
        return run([sv](C v) { return sv / v; });
      case ScalarOp::Pow:
        // The common exponents skip std::pow: it is slow and not vectorizable.
        if (s == 2.0) return run([](C v) { return v * v; });
        if (s == 1.0) return run([](C v) { return v; });
        if (s == 0.5) return run([](C v) { return std::sqrt(v); });
        if (s == -1.0) return run([](C v) { return C(1) / v; });
        return run([sv](C v) { return std::pow(v, sv); });
      default:
        break;
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
    for_each_run<1>(
        out.shape(), {&out.strides()},
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
  dispatch_all(x.dtype(), "unary",
               [&](auto tag) { unary_typed<typename decltype(tag)::type>(op, x, out); });
}

void CpuBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  dispatch_all(a.dtype(), "binary",
               [&](auto tag) { binary_typed<typename decltype(tag)::type>(op, a, b, out); });
}

void CpuBackend::scalar(ScalarOp op, const Tensor& x, double s, const Tensor& out) {
  dispatch_all(x.dtype(), "scalar",
               [&](auto tag) { scalar_typed<typename decltype(tag)::type>(op, x, s, out); });
}

void CpuBackend::axpby(double alpha, const Tensor& x, double beta, const Tensor& out) {
  dispatch_all(x.dtype(), "axpby", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = opmath_t<T>;
    const C al = static_cast<C>(alpha), be = static_cast<C>(beta);
    // beta == 0 ignores out's old contents (as BLAS does), so uninitialized memory or NaNs in
    // it never leak into the result.
    if (beta == 0.0) {
      map2<T>(x, out, out, [al](T v, T) { return static_cast<T>(al * static_cast<C>(v)); });
    } else if (alpha == 1.0 && beta == 1.0) {
      map2<T>(x, out, out,
              [](T v, T o) { return static_cast<T>(static_cast<C>(v) + static_cast<C>(o)); });
    } else {
      map2<T>(x, out, out, [al, be](T v, T o) {
        return static_cast<T>(al * static_cast<C>(v) + be * static_cast<C>(o));
      });
    }
  });
}

}  // namespace tandem::cpu
