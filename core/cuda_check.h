#pragma once
// Check macros for the CUDA runtime, cuBLAS, cuDNN and NCCL. Include only from code built
// with TANDEM_WITH_CUDA. Each throws a typed tandem error carrying the expression, the
// library's own message, file and line; the _LOG variants only log (for destructors).
// current_cuda_stream is in core/cuda_stream.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"

#define TANDEM_CUDA_CHECK(expr)                                                           \
  do {                                                                                    \
    cudaError_t tandem_err_ = (expr);                                                     \
    if (tandem_err_ != cudaSuccess) {                                                     \
      TANDEM_THROW(Cuda, #expr, " failed: ", cudaGetErrorName(tandem_err_), " (",         \
                   cudaGetErrorString(tandem_err_), ")");                                 \
    }                                                                                     \
  } while (0)

#define TANDEM_CUDA_CHECK_LOG(expr)                                                       \
  do {                                                                                    \
    cudaError_t tandem_err_ = (expr);                                                     \
    if (tandem_err_ != cudaSuccess) {                                                     \
      TANDEM_LOG_ERROR(#expr, " failed: ", cudaGetErrorName(tandem_err_));                \
    }                                                                                     \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronizing.
#define TANDEM_CUDA_CHECK_LAUNCH() TANDEM_CUDA_CHECK(cudaGetLastError())

#define TANDEM_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                    \
    int tandem_st_ = static_cast<int>(expr);                                              \
    if (tandem_st_ != 0) {                                                                \
      TANDEM_THROW(Cublas, #expr, " failed: cublas status ", tandem_st_);                 \
    }                                                                                     \
  } while (0)

#define TANDEM_CUDNN_CHECK(expr)                                                          \
  do {                                                                                    \
    cudnnStatus_t tandem_st_ = (expr);                                                    \
    if (tandem_st_ != CUDNN_STATUS_SUCCESS) {                                             \
      TANDEM_THROW(Cudnn, #expr, " failed: ", cudnnGetErrorString(tandem_st_));           \
    }                                                                                     \
  } while (0)

#define TANDEM_NCCL_CHECK(expr)                                                           \
  do {                                                                                    \
    ncclResult_t tandem_st_ = (expr);                                                     \
    if (tandem_st_ != ncclSuccess) {                                                      \
      TANDEM_THROW(Nccl, #expr, " failed: ", ncclGetErrorString(tandem_st_));             \
    }                                                                                     \
  } while (0)

namespace tandem {
// Blocks for `a` items at `b` per block.
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace tandem
