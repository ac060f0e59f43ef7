#pragma once
// BFloat16: the element type of DType::BFloat16, usable in host code and in CUDA kernels.
//
// A bfloat16 is the upper half of an IEEE float32: 1 sign, 8 exponent and 7 mantissa bits. It
// has float32's range (max 3.39e38, smallest normal 1.18e-38, subnormals down to 9.2e-41) and
// about 3 significant decimal digits (epsilon 2^-7). Converting to float32 is exact (a shift);
// converting from float32 rounds to nearest, ties to even, and keeps NaN a (quiet) NaN.
//
// Note [bfloat16 arithmetic]: BFloat16 is a storage type. Every operator converts its operands
// to float, computes in float and rounds the result back, so templated code instantiates with
// it and each operation rounds once, as a float32 computation followed by a bf16 store would.
// Kernels compute chains of operations in opmath_t<T> (core/dtype.h), float for bfloat16, and
// round only the final value: that is both faster and more accurate than going through these
// operators for every step. Mixed operations with a built-in arithmetic type U compute in
// float (or double when U is double) and return that type for a floating U, BFloat16 for an
// integral one (as c10::BFloat16 does). Doubles convert through float, so double -> bfloat16
// rounds twice, exactly like PyTorch's static_cast<c10::BFloat16>(double).
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__
#else
#define TANDEM_HOST_DEVICE
#endif

namespace tandem {

namespace detail {

TANDEM_HOST_DEVICE inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TANDEM_HOST_DEVICE inline float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

}  // namespace detail

struct alignas(2) BFloat16 {
  uint16_t bits;

  // Trivial, like float: uninitialized unless a value is given (so it can live in __shared__
  // memory and in the vector types of the CUDA kernels).
  BFloat16() = default;
  TANDEM_HOST_DEVICE BFloat16(float f) : bits(round_to_nearest_even(f)) {}

  TANDEM_HOST_DEVICE static constexpr BFloat16 from_bits(uint16_t b) {
    return BFloat16(b, FromBits{});
  }

  TANDEM_HOST_DEVICE operator float() const {
    return detail::bits_to_float(static_cast<uint32_t>(bits) << 16);
  }

  // The upper 16 bits of f, rounded to nearest even on the 16 bits dropped: adding 0x7fff plus
  // the lowest kept bit carries into the kept half exactly when the dropped half is above one
  // half, or exactly one half with an odd kept half. A carry out of the mantissa bumps the
  // exponent, so the largest values round to infinity as they should. NaN is handled first
  // (the add could carry its payload into infinity): its upper half with the quiet bit set.
  TANDEM_HOST_DEVICE static uint16_t round_to_nearest_even(float f) {
    const uint32_t u = detail::float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>((u + rounding) >> 16);
  }

  TANDEM_HOST_DEVICE BFloat16& operator+=(BFloat16 o) {
    return *this = BFloat16(float(*this) + float(o));
  }
  TANDEM_HOST_DEVICE BFloat16& operator-=(BFloat16 o) {
    return *this = BFloat16(float(*this) - float(o));
  }
  TANDEM_HOST_DEVICE BFloat16& operator*=(BFloat16 o) {
    return *this = BFloat16(float(*this) * float(o));
  }
  TANDEM_HOST_DEVICE BFloat16& operator/=(BFloat16 o) {
    return *this = BFloat16(float(*this) / float(o));
  }

 private:
  struct FromBits {};
  TANDEM_HOST_DEVICE constexpr BFloat16(uint16_t b, FromBits) : bits(b) {}
};

static_assert(sizeof(BFloat16) == 2 && std::is_trivially_copyable_v<BFloat16> &&
              std::is_trivially_default_constructible_v<BFloat16>);

// ---- operators (Note [bfloat16 arithmetic]) --------------------------------------------------

TANDEM_HOST_DEVICE inline BFloat16 operator+(BFloat16 a, BFloat16 b) {
  return BFloat16(float(a) + float(b));
}
TANDEM_HOST_DEVICE inline BFloat16 operator-(BFloat16 a, BFloat16 b) {
  return BFloat16(float(a) - float(b));
}
TANDEM_HOST_DEVICE inline BFloat16 operator*(BFloat16 a, BFloat16 b) {
  return BFloat16(float(a) * float(b));
}
TANDEM_HOST_DEVICE inline BFloat16 operator/(BFloat16 a, BFloat16 b) {
  return BFloat16(float(a) / float(b));
}
// Negation flips the sign bit: exact, and -NaN stays NaN.
TANDEM_HOST_DEVICE constexpr BFloat16 operator-(BFloat16 a) {
  return BFloat16::from_bits(static_cast<uint16_t>(a.bits ^ 0x8000u));
}
TANDEM_HOST_DEVICE constexpr BFloat16 operator+(BFloat16 a) {
  return a;
}

TANDEM_HOST_DEVICE inline bool operator==(BFloat16 a, BFloat16 b) {
  return float(a) == float(b);
}
TANDEM_HOST_DEVICE inline bool operator!=(BFloat16 a, BFloat16 b) {
  return float(a) != float(b);
}
TANDEM_HOST_DEVICE inline bool operator<(BFloat16 a, BFloat16 b) {
  return float(a) < float(b);
}
TANDEM_HOST_DEVICE inline bool operator<=(BFloat16 a, BFloat16 b) {
  return float(a) <= float(b);
}
TANDEM_HOST_DEVICE inline bool operator>(BFloat16 a, BFloat16 b) {
  return float(a) > float(b);
}
TANDEM_HOST_DEVICE inline bool operator>=(BFloat16 a, BFloat16 b) {
  return float(a) >= float(b);
}

// Mixed with a built-in arithmetic type. Without these, `h < 0` or `h * 2.0f` would be
// ambiguous between the operators above (converting the number) and the built-in ones
// (converting h through operator float).
namespace detail {
template <typename U>
using if_arith = std::enable_if_t<std::is_arithmetic_v<U>, int>;
// float for bfloat16 with float or an integer, double with double.
template <typename U>
using mixed_math_t =
    std::conditional_t<std::is_same_v<U, double> || std::is_same_v<U, long double>, U, float>;
// The result of a mixed arithmetic operation (see Note [bfloat16 arithmetic]).
template <typename U>
using mixed_result_t = std::conditional_t<std::is_floating_point_v<U>, mixed_math_t<U>, BFloat16>;
}  // namespace detail

#define TANDEM_BF16_MIXED_ARITH(OP)                                                  \
  template <typename U, detail::if_arith<U> = 0>                                     \
  TANDEM_HOST_DEVICE inline detail::mixed_result_t<U> operator OP(BFloat16 a, U b) { \
    using M = detail::mixed_math_t<U>;                                               \
    return detail::mixed_result_t<U>(static_cast<M>(float(a)) OP static_cast<M>(b)); \
  }                                                                                  \
  template <typename U, detail::if_arith<U> = 0>                                     \
  TANDEM_HOST_DEVICE inline detail::mixed_result_t<U> operator OP(U a, BFloat16 b) { \
    using M = detail::mixed_math_t<U>;                                               \
    return detail::mixed_result_t<U>(static_cast<M>(a) OP static_cast<M>(float(b))); \
  }
TANDEM_BF16_MIXED_ARITH(+)
TANDEM_BF16_MIXED_ARITH(-)
TANDEM_BF16_MIXED_ARITH(*)
TANDEM_BF16_MIXED_ARITH(/)
#undef TANDEM_BF16_MIXED_ARITH

#define TANDEM_BF16_MIXED_COMPARE(OP)                           \
  template <typename U, detail::if_arith<U> = 0>                \
  TANDEM_HOST_DEVICE inline bool operator OP(BFloat16 a, U b) { \
    using M = detail::mixed_math_t<U>;                          \
    return static_cast<M>(float(a)) OP static_cast<M>(b);       \
  }                                                             \
  template <typename U, detail::if_arith<U> = 0>                \
  TANDEM_HOST_DEVICE inline bool operator OP(U a, BFloat16 b) { \
    using M = detail::mixed_math_t<U>;                          \
    return static_cast<M>(a) OP static_cast<M>(float(b));       \
  }
TANDEM_BF16_MIXED_COMPARE(==)
TANDEM_BF16_MIXED_COMPARE(!=)
TANDEM_BF16_MIXED_COMPARE(<)
TANDEM_BF16_MIXED_COMPARE(<=)
TANDEM_BF16_MIXED_COMPARE(>)
TANDEM_BF16_MIXED_COMPARE(>=)
#undef TANDEM_BF16_MIXED_COMPARE

}  // namespace tandem

// numeric_limits as for a float with 8 significant bits and float32's exponent range.
namespace std {
template <>
struct numeric_limits<tandem::BFloat16> {
  using B = tandem::BFloat16;

  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr bool has_signaling_NaN = true;
  static constexpr bool is_iec559 = false;
  static constexpr bool is_bounded = true;
  static constexpr bool is_modulo = false;
  static constexpr bool tinyness_before = false;
  static constexpr std::float_round_style round_style = std::round_to_nearest;
  static constexpr int digits = 8;
  static constexpr int digits10 = 2;
  static constexpr int max_digits10 = 4;
  static constexpr int radix = 2;
  static constexpr int min_exponent = -125;
  static constexpr int min_exponent10 = -37;
  static constexpr int max_exponent = 128;
  static constexpr int max_exponent10 = 38;

  TANDEM_HOST_DEVICE static constexpr B min() { return B::from_bits(0x0080); }  // 1.18e-38
  TANDEM_HOST_DEVICE static constexpr B lowest() { return B::from_bits(0xff7f); }
  TANDEM_HOST_DEVICE static constexpr B max() { return B::from_bits(0x7f7f); }          // 3.39e38
  TANDEM_HOST_DEVICE static constexpr B epsilon() { return B::from_bits(0x3c00); }      // 2^-7
  TANDEM_HOST_DEVICE static constexpr B round_error() { return B::from_bits(0x3f00); }  // 0.5
  TANDEM_HOST_DEVICE static constexpr B infinity() { return B::from_bits(0x7f80); }
  TANDEM_HOST_DEVICE static constexpr B quiet_NaN() { return B::from_bits(0x7fc0); }
  TANDEM_HOST_DEVICE static constexpr B signaling_NaN() { return B::from_bits(0x7f81); }
  TANDEM_HOST_DEVICE static constexpr B denorm_min() { return B::from_bits(0x0001); }  // 9.2e-41
};
}  // namespace std
