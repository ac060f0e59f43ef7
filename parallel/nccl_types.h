#pragma once
// NCCL's name for a tandem dtype; shared by the in-process communicator and the NCCL process
// group. Include only in code built with TANDEM_WITH_NCCL.
#include <nccl.h>

#include "core/dtype.h"
#include "core/error.h"

namespace tandem::parallel {

inline ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Int64: return ncclInt64;
    case DType::UInt8: return ncclUint8;
    case DType::BFloat16: return ncclBfloat16;
  }
  TANDEM_THROW(DType, "nccl: unsupported dtype ", dtype_name(t));
}

}  // namespace tandem::parallel
