#pragma once
// Helpers shared by the differentiable functions in autograd/ops_*.cpp (internal).
//
// Note [saved tensors]
// A backward lambda captures what it needs through saved(): an alias of the data with no
// autograd state. Capturing the op's own output directly would make a cycle (output ->
// grad_fn -> lambda -> output) that never frees; capturing an input directly would keep its
// .grad and hooks alive for no reason. Like PyTorch without its version counter, a saved
// tensor modified in place between forward and backward gives a wrong gradient.
//
// Note [no double backward]
// Backward lambdas are written with kernels:: ops, which record nothing, and the engine runs
// with grad mode off: gradients of gradients are not supported.
#include "autograd/node.h"
#include "kernels/ops.h"

namespace tandem::autograd {

inline Tensor saved(const Tensor& t) {
  return t.defined() ? t.detach() : Tensor();
}

// Whether the backward must produce a gradient for t (decided at forward time).
inline bool needs_grad(const Tensor& t) {
  return t.defined() && t.requires_grad();
}

// A view result must be a TensorImpl of its own before history is recorded on it: the raw
// view members may hand back the input itself when nothing changes.
inline Tensor fresh_alias(const Tensor& y, const Tensor& x) {
  return y.same(x) ? x.detach() : y;
}

// Dims reduced by a reduction over `dims` of a tensor with `ndim` dims (empty = all).
std::vector<bool> reduced_dims_mask(const char* op, int64_t ndim, const std::vector<int64_t>& dims);

}  // namespace tandem::autograd
