#pragma once
// Element types and the one place where a runtime dtype becomes a C++ type.
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/bfloat16.h"
#include "core/error.h"

namespace tandem {

enum class DType : uint8_t { Float32, Float64, Int64, UInt8, BFloat16 };

inline constexpr DType kFloat32 = DType::Float32;
inline constexpr DType kFloat64 = DType::Float64;
inline constexpr DType kInt64 = DType::Int64;
inline constexpr DType kUInt8 = DType::UInt8;
inline constexpr DType kBFloat16 = DType::BFloat16;

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
    case DType::BFloat16: return 2;
  }
  return 0;
}
constexpr bool is_floating(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::BFloat16;
}
const char* dtype_name(DType t);

template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::Float32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::Float64; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::Int64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::UInt8; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::BFloat16; };

// True for the C++ types of the floating dtypes. BFloat16 is a class, so
// std::is_floating_point_v is false for it: templated kernels test this instead.
template <typename T>
inline constexpr bool is_floating_type_v =
    std::is_floating_point_v<T> || std::is_same_v<T, BFloat16>;

// The type an element of T is computed in (PyTorch's at::opmath_type): float for bfloat16,
// which is only a storage type (Note [bfloat16 arithmetic] in core/bfloat16.h), T otherwise.
template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, BFloat16>, float, T>;

template <typename T> struct TypeTag { using type = T; };

// Calls fn(TypeTag<T>{}) with T the C++ type of dtype t. Use as
//   dispatch_all(t, "relu", [&](auto tag) { using T = typename decltype(tag)::type; ... });
// Works in host code and in .cu host launchers.
template <typename Fn>
decltype(auto) dispatch_all(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::Float32: return fn(TypeTag<float>{});
    case DType::Float64: return fn(TypeTag<double>{});
    case DType::Int64: return fn(TypeTag<int64_t>{});
    case DType::UInt8: return fn(TypeTag<uint8_t>{});
    case DType::BFloat16: return fn(TypeTag<BFloat16>{});
  }
  TANDEM_THROW(DType, op, ": unknown dtype");
}

// Note [bfloat16 opt-in]: bfloat16 is a floating dtype, but a kernel supports it only where it
// says so, by dispatching with dispatch_floating_bf16 (or dispatch_all) and computing in
// opmath_t<T>. dispatch_floating stays float32/float64, so every kernel written before
// bfloat16 existed throws a DTypeError that names the op and the dtype instead of running a
// float64-style kernel with, say, an integer accumulator.

// Same, but only for float32/float64; other dtypes throw a DTypeError naming op.
template <typename Fn>
decltype(auto) dispatch_floating(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::Float32: return fn(TypeTag<float>{});
    case DType::Float64: return fn(TypeTag<double>{});
    default: break;
  }
  TANDEM_THROW(DType, op, ": expected a float32 or float64 tensor, got ", dtype_name(t));
}

// float32, float64 and bfloat16 (Note [bfloat16 opt-in]); other dtypes throw a DTypeError.
template <typename Fn>
decltype(auto) dispatch_floating_bf16(DType t, const char* op, Fn&& fn) {
  switch (t) {
    case DType::Float32: return fn(TypeTag<float>{});
    case DType::Float64: return fn(TypeTag<double>{});
    case DType::BFloat16: return fn(TypeTag<BFloat16>{});
    default: break;
  }
  TANDEM_THROW(DType, op, ": expected a float32, float64 or bfloat16 tensor, got ", dtype_name(t));
}

}  // namespace tandem
