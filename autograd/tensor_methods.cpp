// PyTorch's method spellings of Tensor (declared in core/tensor.h): sum, mean, max, min,
// argmax, argmin, each built from the free operations of autograd/ops.h and kernels/ops.h, so
// every backend that runs those runs these.
#include "autograd/ops.h"
#include "kernels/ops.h"

namespace tandem {

namespace {

// PyTorch sums integers (uint8 included) in int64.
Tensor summable(const Tensor& x) {
  return is_floating(x.dtype()) || x.dtype() == kInt64 ? x : x.to(kInt64);
}

int64_t wrapped(const char* op, const Tensor& x, int64_t dim) {
  const int64_t n = x.dim();
  const int64_t w = dim < 0 ? dim + n : dim;
  TANDEM_CHECK(w >= 0 && w < n, Shape, op, ": dim ", dim, " out of range for ", shape_str(x.shape()));
  return w;
}

// The argmax kernels take floating tensors; integers compare the same in float64 (exactly up
// to 2^53), and negate there without wrapping (argmin of uint8).
Tensor comparable(const Tensor& x) { return is_floating(x.dtype()) ? x : x.to(kFloat64); }

// Index of the first maximum along dim; keepdim leaves it as size 1.
Tensor argmax_along(const char* op, const Tensor& x, int64_t dim, bool keepdim) {
  const int64_t d = wrapped(op, x, dim);
  Tensor i = kernels::argmax(comparable(x), d);
  return keepdim ? i.unsqueeze(d) : i;
}

}  // namespace

Tensor Tensor::sum() const { return tandem::sum(summable(*this)); }
Tensor Tensor::sum(int64_t dim, bool keepdim) const { return tandem::sum(summable(*this), {dim}, keepdim); }
Tensor Tensor::sum(const std::vector<int64_t>& dims, bool keepdim) const {
  return tandem::sum(summable(*this), dims, keepdim);
}

Tensor Tensor::mean() const { return tandem::mean(*this); }
Tensor Tensor::mean(int64_t dim, bool keepdim) const { return tandem::mean(*this, {dim}, keepdim); }
Tensor Tensor::mean(const std::vector<int64_t>& dims, bool keepdim) const {
  return tandem::mean(*this, dims, keepdim);
}

Tensor Tensor::max() const { return tandem::max(*this); }
std::tuple<Tensor, Tensor> Tensor::max(int64_t dim, bool keepdim) const {
  wrapped("max", *this, dim);
  // The values' gradient goes to the first maximum (Note [max backward]), the index returned.
  return {tandem::max(*this, {dim}, keepdim), argmax_along("max", *this, dim, keepdim)};
}

// min(x) = -max(-x): the same element, and -max(-x)'s gradient reaches the first minimum.
// uint8 is negated in int64 (where -x does not wrap) and converted back.
Tensor Tensor::min() const {
  const Tensor x = dtype() == kUInt8 ? to(kInt64) : *this;
  const Tensor m = tandem::neg(tandem::max(tandem::neg(x)));
  return dtype() == kUInt8 ? m.to(kUInt8) : m;
}
std::tuple<Tensor, Tensor> Tensor::min(int64_t dim, bool keepdim) const {
  wrapped("min", *this, dim);
  const Tensor x = dtype() == kUInt8 ? to(kInt64) : *this;
  const Tensor negated = tandem::neg(x);
  const Tensor m = tandem::neg(tandem::max(negated, {dim}, keepdim));
  return {dtype() == kUInt8 ? m.to(kUInt8) : m, argmax_along("min", negated.detach(), dim, keepdim)};
}

Tensor Tensor::argmax() const { return kernels::argmax(comparable(*this).reshape({-1}), 0).reshape({}); }
Tensor Tensor::argmax(int64_t dim, bool keepdim) const {
  return argmax_along("argmax", *this, dim, keepdim);
}
// The first minimum of x is the first maximum of -x (a NaN stays the first NaN).
Tensor Tensor::argmin() const {
  return kernels::argmax(kernels::unary(UnaryOp::Neg, comparable(*this).reshape({-1})), 0).reshape({});
}
Tensor Tensor::argmin(int64_t dim, bool keepdim) const {
  return argmax_along("argmin", kernels::unary(UnaryOp::Neg, comparable(*this)), dim, keepdim);
}

}  // namespace tandem
