#pragma once
// The argument checks the dispatcher's neural-network ops share (kernels/ops_conv.cpp,
// ops_nn.cpp, ops_batchnorm.cpp, ops_optim.cpp): each names the op and the tensor at fault.
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/ops.h"

namespace tandem::kernels::internal {

inline void check_floating(const char* op, const Tensor& t) {
  TANDEM_CHECK(is_floating(t.dtype()), DType, op, ": expected a float32 or float64 tensor, got ",
               dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

inline void check_dims(const char* op, const Tensor& t, int64_t nd, const char* what) {
  TANDEM_CHECK(t.dim() == nd, Shape, op, ": expected ", what, ", got ", shape_str(t.shape()));
}

inline void check_shape(const char* op, const Tensor& t, const Shape& want, const char* name) {
  TANDEM_CHECK(t.shape() == want, Shape, op, ": ", name, " is ", shape_str(t.shape()),
               ", expected ", shape_str(want));
}

inline void check_in_place(const char* op, const Tensor& t, const char* name) {
  TANDEM_CHECK(t.is_contiguous() || t.is_contiguous(MemoryFormat::ChannelsLast), Value, op, ": ", name, " ",
               shape_str(t.shape()), " is updated in place and must be contiguous or channels-last");
}

// The format the backend computes in: `wanted`, or contiguous where it has no channels-last kernels.
inline MemoryFormat kernel_format(const Backend& be, MemoryFormat wanted) {
  return be.supports_channels_last() ? wanted : MemoryFormat::Contiguous;
}

// `t` (computed in format `have`) with exactly the strides of format `want` (restrided): a
// result the caller reads the format of again, even where size-1 dims make the two layouts the
// same memory.
inline Tensor in_format(const Tensor& t, MemoryFormat have, MemoryFormat want) {
  return have == want ? t : restrided(t, want);
}

// A conv's bias fused into the op after it (Note [conv bias in batch norm], Note [conv bias in
// activation + pooling] in kernels/ops.h): [C], on x's device, of x's own dtype (the conv's
// output's, not a batch norm's per-channel tensors').
inline void check_conv_bias(const char* op, const Tensor& x, const Tensor& bias) {
  if (!bias.defined()) return;
  check_same_device(op, {&x, &bias});
  TANDEM_CHECK(bias.dtype() == x.dtype(), DType, op, ": bias ", dtype_name(bias.dtype()), " ",
               shape_str(bias.shape()), " must have the dtype of the input ", dtype_name(x.dtype()), " ",
               shape_str(x.shape()));
  TANDEM_CHECK(bias.shape() == Shape{x.size(1)}, Shape, op, ": bias is ", shape_str(bias.shape()),
               ", expected [", x.size(1), "] for input ", shape_str(x.shape()));
}

}  // namespace tandem::kernels::internal
