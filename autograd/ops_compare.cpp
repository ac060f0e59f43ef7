// Comparisons (eq, ne, lt, le, gt, ge and their operators) and softmax / log_softmax over any
// dim, composed from existing kernels and differentiable ops.
#include <cmath>

#include "autograd/ops.h"
#include "kernels/ops.h"

namespace tandem {

namespace {

// The dtype two operands are compared in (see autograd/ops.h).
int dtype_rank(DType t) {
  switch (t) {
    case DType::UInt8: return 0;
    case DType::Int64: return 1;
    case DType::BFloat16: return 2;
    case DType::Float32: return 3;
    case DType::Float64: return 4;
  }
  return 0;
}

std::pair<Tensor, Tensor> promoted(const Tensor& a, const Tensor& b) {
  TANDEM_CHECK(a.defined() && b.defined(), Value, "comparison: undefined tensor argument");
  if (a.dtype() == b.dtype()) return {a, b};
  const DType t = dtype_rank(a.dtype()) > dtype_rank(b.dtype()) ? a.dtype() : b.dtype();
  return {a.to(t), b.to(t)};
}

// s as a 0-dim tensor beside a, and a itself, in the dtype they are compared in.
std::pair<Tensor, Tensor> with_scalar(const Tensor& a, double s) {
  TANDEM_CHECK(a.defined(), Value, "comparison: undefined tensor argument");
  const bool fractional = !std::isfinite(s) || std::trunc(s) != s;
  const Tensor x = !is_floating(a.dtype()) && fractional ? a.to(kFloat64) : a;
  return {x, full({}, s, x.dtype(), x.device())};
}

// 1 / 0 in the operands' dtype.
Tensor eq_raw(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::Eq, a, b); }
// a >= b: maximum(a, b) is a exactly when a >= b, and is NaN (never equal) when either is.
Tensor ge_raw(const Tensor& a, const Tensor& b) {
  return eq_raw(kernels::binary(BinaryOp::Max, a, b), a);
}
// a > b: a >= b and not a == b.
Tensor gt_raw(const Tensor& a, const Tensor& b) {
  return kernels::binary(BinaryOp::Sub, ge_raw(a, b), eq_raw(a, b));
}

Tensor as_mask(const Tensor& t) { return t.to(kUInt8); }

}  // namespace

Tensor eq(const Tensor& a, const Tensor& b) {
  auto [x, y] = promoted(a, b);
  return as_mask(eq_raw(x, y));
}
Tensor ne(const Tensor& a, const Tensor& b) {
  auto [x, y] = promoted(a, b);
  return as_mask(kernels::scalar(ScalarOp::RSub, eq_raw(x, y), 1.0));
}
Tensor ge(const Tensor& a, const Tensor& b) {
  auto [x, y] = promoted(a, b);
  return as_mask(ge_raw(x, y));
}
Tensor gt(const Tensor& a, const Tensor& b) {
  auto [x, y] = promoted(a, b);
  return as_mask(gt_raw(x, y));
}
Tensor le(const Tensor& a, const Tensor& b) { return ge(b, a); }
Tensor lt(const Tensor& a, const Tensor& b) { return gt(b, a); }

Tensor eq(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return eq(x, y);
}
Tensor ne(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return ne(x, y);
}
Tensor lt(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return lt(x, y);
}
Tensor le(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return le(x, y);
}
Tensor gt(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return gt(x, y);
}
Tensor ge(const Tensor& a, double s) {
  auto [x, y] = with_scalar(a, s);
  return ge(x, y);
}

Tensor operator==(const Tensor& a, const Tensor& b) { return eq(a, b); }
Tensor operator!=(const Tensor& a, const Tensor& b) { return ne(a, b); }
Tensor operator<(const Tensor& a, const Tensor& b) { return lt(a, b); }
Tensor operator<=(const Tensor& a, const Tensor& b) { return le(a, b); }
Tensor operator>(const Tensor& a, const Tensor& b) { return gt(a, b); }
Tensor operator>=(const Tensor& a, const Tensor& b) { return ge(a, b); }
Tensor operator==(const Tensor& a, double s) { return eq(a, s); }
Tensor operator!=(const Tensor& a, double s) { return ne(a, s); }
Tensor operator<(const Tensor& a, double s) { return lt(a, s); }
Tensor operator<=(const Tensor& a, double s) { return le(a, s); }
Tensor operator>(const Tensor& a, double s) { return gt(a, s); }
Tensor operator>=(const Tensor& a, double s) { return ge(a, s); }
// s op a is a op' s with the comparison mirrored.
Tensor operator==(double s, const Tensor& a) { return eq(a, s); }
Tensor operator!=(double s, const Tensor& a) { return ne(a, s); }
Tensor operator<(double s, const Tensor& a) { return gt(a, s); }
Tensor operator<=(double s, const Tensor& a) { return ge(a, s); }
Tensor operator>(double s, const Tensor& a) { return lt(a, s); }
Tensor operator>=(double s, const Tensor& a) { return le(a, s); }

// ---- softmax over any dim ---------------------------------------------------------------

Tensor log_softmax(const Tensor& x, int64_t dim) {
  TANDEM_CHECK(x.defined(), Value, "log_softmax: undefined tensor argument");
  TANDEM_CHECK(x.dim() >= 1, Shape, "log_softmax: expected a tensor of 1 or more dims, got ",
               shape_str(x.shape()));
  const int64_t n = x.dim();
  const int64_t d = dim < 0 ? dim + n : dim;
  TANDEM_CHECK(d >= 0 && d < n, Shape, "log_softmax: dim ", dim, " out of range for ",
               shape_str(x.shape()));
  if (n == 2 && d == 1) return log_softmax(x);
  const Tensor last = d == n - 1 ? x : transpose(x, d, n - 1);  // dim d now last
  const Shape moved = last.shape();
  const Tensor rows = reshape(last, {-1, moved.back()});        // [R, C]
  const Tensor y = reshape(log_softmax(rows), moved);
  return d == n - 1 ? y : transpose(y, d, n - 1);
}

Tensor softmax(const Tensor& x, int64_t dim) { return exp(log_softmax(x, dim)); }

}  // namespace tandem
