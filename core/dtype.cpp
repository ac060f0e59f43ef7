#include "core/dtype.h"

namespace tandem {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
    case DType::BFloat16: return "bfloat16";
  }
  return "unknown";
}

}  // namespace tandem
