#pragma once
// Element types and the one place where a runtime dtype becomes a C++ type.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace tandem {

enum class DType : uint8_t { Float32, Float64, Int64, UInt8 };

inline constexpr DType kFloat32 = DType::Float32;
inline constexpr DType kFloat64 = DType::Float64;
inline constexpr DType kInt64 = DType::Int64;
inline constexpr DType kUInt8 = DType::UInt8;

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
  }
  return 0;
}
constexpr bool is_floating(DType t) { return t == DType::Float32 || t == DType::Float64; }
const char* dtype_name(DType t);

template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::Float32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::Float64; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::Int64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::UInt8; };

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
  }
  TANDEM_THROW(DType, op, ": unknown dtype");
}

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

}  // namespace tandem
