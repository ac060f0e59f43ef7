#pragma once
// Small cuDNN helpers shared by conv.cu and pool.cu: owning descriptor wrappers, the dtype
// mapping and 4-D tensor descriptors from tandem shapes.
#include <cudnn.h>

#include <climits>

#include "core/cuda_check.h"
#include "core/tensor.h"

namespace tandem::gpu {

// Owns one cuDNN descriptor. Destruction only frees host memory, so it is safe in the
// thread_local plan caches that outlive the last GPU call.
template <typename D, cudnnStatus_t (*Create)(D*), cudnnStatus_t (*Destroy)(D)>
struct CudnnDesc {
  D d = nullptr;
  CudnnDesc() { TANDEM_CUDNN_CHECK(Create(&d)); }
  ~CudnnDesc() {
    if (d != nullptr) Destroy(d);
  }
  CudnnDesc(const CudnnDesc&) = delete;
  CudnnDesc& operator=(const CudnnDesc&) = delete;
};

using TensorDesc =
    CudnnDesc<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDesc =
    CudnnDesc<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDesc = CudnnDesc<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                           cudnnDestroyConvolutionDescriptor>;
using PoolDesc =
    CudnnDesc<cudnnPoolingDescriptor_t, cudnnCreatePoolingDescriptor, cudnnDestroyPoolingDescriptor>;

inline cudnnDataType_t cudnn_dtype(DType t) {
  switch (t) {
    case DType::Float32: return CUDNN_DATA_FLOAT;
    case DType::Float64: return CUDNN_DATA_DOUBLE;
    case DType::BFloat16: return CUDNN_DATA_BFLOAT16;
    default: break;
  }
  TANDEM_THROW(DType, "cuDNN ops take float32, float64 or bfloat16 tensors, got ", dtype_name(t));
}

// The type cuDNN computes (and takes alpha/beta) in for data of type t: float32, also for
// bfloat16 data (float32 accumulation, as PyTorch's bfloat16 convolutions), or float64.
inline cudnnDataType_t cudnn_compute_dtype(DType t) {
  return t == DType::Float64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
}

inline int to_int(int64_t v) {
  TANDEM_CHECK(v >= 0 && v <= INT_MAX, Shape, "cuDNN: size or parameter ", v,
               " does not fit in an int");
  return static_cast<int>(v);
}

// A packed NCHW (or, with CUDNN_TENSOR_NHWC, channels-last) descriptor for a 4-D [N, C, H, W] shape.
inline void set_tensor4d(TensorDesc& desc, cudnnDataType_t dt, const Shape& s,
                         cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW) {
  TANDEM_CHECK(s.size() == 4, Shape, "cuDNN: expected a 4-D shape, got ", shape_str(s));
  TANDEM_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc.d, format, dt, to_int(s[0]),
                                                to_int(s[1]), to_int(s[2]), to_int(s[3])));
}

}  // namespace tandem::gpu
