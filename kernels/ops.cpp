// The dispatcher, part 1: argument checks, broadcasting, elementwise ops, reductions and
// matmul. (Convolution and pooling are in ops_conv.cpp, losses and indexing in ops_nn.cpp,
// batch norm in ops_batchnorm.cpp, optimizer steps in ops_optim.cpp.) Nothing here branches on the device type: outputs are allocated on the inputs'
// device and the work goes to backend_for(device).
#include "kernels/ops.h"

#include <algorithm>
#include <cmath>

#include "kernels/activation_ops.h"

namespace tandem::kernels {

namespace {

const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg:
      return "neg";
    case UnaryOp::Exp:
      return "exp";
    case UnaryOp::Log:
      return "log";
    case UnaryOp::Sigmoid:
      return "sigmoid";
    case UnaryOp::Relu:
      return "relu";
    case UnaryOp::Tanh:
      return "tanh";
    case UnaryOp::Sqrt:
      return "sqrt";
    case UnaryOp::Abs:
      return "abs";
    case UnaryOp::Square:
      return "square";
    case UnaryOp::Reciprocal:
      return "reciprocal";
  }
  return "unary";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add:
      return "add";
    case BinaryOp::Sub:
      return "sub";
    case BinaryOp::Mul:
      return "mul";
    case BinaryOp::Div:
      return "div";
    case BinaryOp::Max:
      return "maximum";
    case BinaryOp::Min:
      return "minimum";
    case BinaryOp::Eq:
      return "eq";
    case BinaryOp::AddRelu:
      return "add_relu";
    case BinaryOp::ReluBackward:
      return "relu_backward";
    case BinaryOp::SigmoidBackward:
      return "sigmoid_backward";
    case BinaryOp::TanhBackward:
      return "tanh_backward";
  }
  return "binary";
}

const char* scalar_name(ScalarOp op) {
  switch (op) {
    case ScalarOp::Add:
      return "add_scalar";
    case ScalarOp::Mul:
      return "mul_scalar";
    case ScalarOp::RSub:
      return "rsub_scalar";
    case ScalarOp::RDiv:
      return "rdiv_scalar";
    case ScalarOp::Pow:
      return "pow";
  }
  return "scalar";
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Mean:
      return "mean";
    case ReduceOp::Max:
      return "max";
  }
  return "reduce";
}

// Floating here includes bfloat16: every op of this file has bfloat16 kernels (Note [bfloat16
// opt-in] in core/dtype.h).
void check_floating(const char* op, const Tensor& t) {
  TANDEM_CHECK(is_floating(t.dtype()), DType, op,
               ": expected a floating tensor (float32, float64 or bfloat16), got ",
               dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

int64_t wrap_dim(const char* op, int64_t d, const Tensor& x) {
  const int64_t nd = x.dim();
  const int64_t w = d < 0 ? d + nd : d;
  TANDEM_CHECK(w >= 0 && w < nd, Shape, op, ": dim ", d, " out of range for ",
               shape_str(x.shape()));
  return w;
}

// Ops whose integer versions would be wrong (truncating) or undefined (division by zero).
bool needs_floating(UnaryOp op) {
  return op != UnaryOp::Neg && op != UnaryOp::Relu && op != UnaryOp::Abs && op != UnaryOp::Square;
}
bool needs_floating(BinaryOp op) {
  return op == BinaryOp::Div || op == BinaryOp::ReluBackward || op == BinaryOp::SigmoidBackward ||
         op == BinaryOp::TanhBackward;
}

// Reduction of x over the dims flagged in `reduced`, as an [R, C] row problem: the kept dims
// are permuted to the front and the reduced ones to the back, so each output element is one
// contiguous row. x is copied only when that permutation is not already contiguous.
template <typename Kernel>
Tensor reduce_over(const char* op, const Tensor& x, const std::vector<bool>& reduced, bool keepdim,
                   DType out_dtype, Kernel kernel) {
  std::vector<int64_t> perm;
  Shape kept, keep_shape;
  int64_t rows = 1, cols = 1;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (reduced[d]) continue;
    perm.push_back(d);
    kept.push_back(x.size(d));
    rows *= x.size(d);
  }
  for (int64_t d = 0; d < x.dim(); ++d) {
    keep_shape.push_back(reduced[d] ? 1 : x.size(d));
    if (!reduced[d]) continue;
    perm.push_back(d);
    cols *= x.size(d);
  }
  // An empty input has no data to move; a fresh [R, C] tensor stands in for it.
  Tensor rows_x = x.numel() == 0 ? Tensor({rows, cols}, x.dtype(), x.device())
                                 : x.permute(perm).contiguous().view({rows, cols});
  Tensor out({rows}, out_dtype, x.device());
  kernel(rows_x, out, cols);
  return out.view(keepdim ? keep_shape : kept);
}

std::vector<bool> reduced_dims(const char* op, const Tensor& x, const std::vector<int64_t>& dims) {
  std::vector<bool> reduced(static_cast<size_t>(x.dim()), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(op, d, x);
    TANDEM_CHECK(!reduced[w], Shape, op, ": dim ", d, " listed twice for ", shape_str(x.shape()));
    reduced[w] = true;
  }
  return reduced;
}

// The memory format of an elementwise result of `shape` (Note [memory formats]): channels-last
// when an operand of that full shape is, else contiguous.
MemoryFormat output_format(const Shape& shape, std::initializer_list<const Tensor*> operands) {
  for (const Tensor* t : operands) {
    if (t->shape() == shape && suggest_memory_format(*t) == MemoryFormat::ChannelsLast) {
      return MemoryFormat::ChannelsLast;
    }
  }
  return MemoryFormat::Contiguous;
}

std::string matmul_operand(const Tensor& t, bool trans) {
  return shape_str(t.shape()) + (trans ? "^T" : "");
}

// A gemm operand that is contiguous as stored: a transposed view of a contiguous matrix is
// passed as that matrix with the transpose flag flipped, so x.transpose(0, 1) costs no copy.
std::pair<Tensor, bool> gemm_operand(const Tensor& t, bool trans) {
  if (t.is_contiguous()) return {t, trans};
  Tensor tt = t.transpose(0, 1);
  if (tt.is_contiguous()) return {tt, !trans};
  return {t.contiguous(), trans};
}

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TANDEM_CHECK(da == db || da == 1 || db == 1, Shape, op, ": shapes ", shape_str(a), " and ",
                 shape_str(b), " cannot be broadcast (", da, " vs ", db, " in dim ", i, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

void check_same_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    TANDEM_CHECK(t->defined(), Value, op, ": undefined tensor argument");
    if (!first) {
      first = t;
      continue;
    }
    TANDEM_CHECK(t->device() == first->device(), Device, op,
                 ": tensors on different devices: ", first->device().str(), " ",
                 shape_str(first->shape()), " and ", t->device().str(), " ", shape_str(t->shape()));
  }
}

void check_same_dtype(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    TANDEM_CHECK(t->defined(), Value, op, ": undefined tensor argument");
    if (!first) {
      first = t;
      continue;
    }
    TANDEM_CHECK(t->dtype() == first->dtype(), DType, op,
                 ": dtype mismatch: ", dtype_name(first->dtype()), " ", shape_str(first->shape()),
                 " and ", dtype_name(t->dtype()), " ", shape_str(t->shape()));
  }
}

// ---- elementwise ------------------------------------------------------------------------

Tensor output_into(const char* op, const Tensor& into, const Shape& shape, const Tensor& like,
                   const char* name) {
  if (!into.defined()) return Tensor(shape, like.dtype(), like.device());
  TANDEM_CHECK(into.shape() == shape && into.is_contiguous(), Shape, op, ": ", name, " is ",
               shape_str(into.shape()), into.is_contiguous() ? "" : " (not packed)",
               ", expected a packed ", shape_str(shape));
  TANDEM_CHECK(into.dtype() == like.dtype(), DType, op, ": ", name, " is ",
               dtype_name(into.dtype()), ", expected ", dtype_name(like.dtype()));
  TANDEM_CHECK(into.device() == like.device(), Device, op, ": ", name, " is on ",
               into.device().str(), ", expected ", like.device().str());
  return into;
}

Tensor unary(UnaryOp op, const Tensor& x) {
  const char* name = unary_name(op);
  check_same_device(name, {&x});
  if (needs_floating(op)) check_floating(name, x);
  Tensor out(x.shape(), x.dtype(), x.device(), suggest_memory_format(x));
  backend_for(x.device()).unary(op, x, out);
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_same_device(name, {&a, &b});
  check_same_dtype(name, {&a, &b});
  if (needs_floating(op)) check_floating(name, a);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor out(shape, a.dtype(), a.device(), output_format(shape, {&a, &b}));
  backend_for(a.device()).binary(op, a.expand(shape), b.expand(shape), out);
  return out;
}

void binary_(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  check_same_device(name, {&a, &b});
  check_same_dtype(name, {&a, &b});
  if (needs_floating(op)) check_floating(name, a);
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  TANDEM_CHECK(shape == a.shape(), Shape, name, "_: cannot write the broadcast result ",
               shape_str(shape), " of ", shape_str(a.shape()), " and ", shape_str(b.shape()),
               " in place into ", shape_str(a.shape()));
  backend_for(a.device()).binary(op, a, b.expand(shape), a);
}

Tensor scalar(ScalarOp op, const Tensor& x, double s) {
  const char* name = scalar_name(op);
  check_same_device(name, {&x});
  if (op == ScalarOp::RDiv || op == ScalarOp::Pow) check_floating(name, x);
  if (!is_floating(x.dtype())) {
    TANDEM_CHECK(std::trunc(s) == s && std::abs(s) < 9.2e18, Value, name, ": scalar ", s,
                 " is not an integer, but the tensor is ", dtype_name(x.dtype()));
  }
  Tensor out(x.shape(), x.dtype(), x.device(), suggest_memory_format(x));
  backend_for(x.device()).scalar(op, x, s, out);
  return out;
}

void axpby_(double alpha, const Tensor& x, double beta, const Tensor& out) {
  check_same_device("axpby_", {&x, &out});
  check_same_dtype("axpby_", {&x, &out});
  TANDEM_CHECK(x.shape() == out.shape(), Shape, "axpby_: x ", shape_str(x.shape()), " and out ",
               shape_str(out.shape()), " differ in shape");
  backend_for(out.device()).axpby(alpha, x, beta, out);
}

// ---- reductions -------------------------------------------------------------------------

Tensor reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  const char* name = reduce_name(op);
  check_same_device(name, {&x});
  if (op == ReduceOp::Mean) check_floating(name, x);
  const std::vector<bool> reduced = reduced_dims(name, x, dims);
  return reduce_over(name, x, reduced, keepdim, x.dtype(),
                     [&](const Tensor& rows_x, const Tensor& out, int64_t cols) {
                       TANDEM_CHECK(op != ReduceOp::Max || cols > 0 || rows_x.size(0) == 0, Value,
                                    name, ": reduction over zero elements of ",
                                    shape_str(x.shape()));
                       backend_for(x.device()).reduce_rows(op, rows_x, out);
                     });
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  check_same_device("sum_to", {&x});
  if (x.shape() == shape) return x;
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  TANDEM_CHECK(lead >= 0, Shape, "sum_to: cannot reduce ", shape_str(x.shape()), " to ",
               shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < lead) {
      dims.push_back(d);
      continue;
    }
    const int64_t want = shape[d - lead];
    TANDEM_CHECK(want == x.size(d) || want == 1, Shape, "sum_to: cannot reduce ",
                 shape_str(x.shape()), " to ", shape_str(shape));
    if (want == 1 && x.size(d) != 1) dims.push_back(d);
  }
  // Only size-1 leading dims to drop: a view, not a reduction (empty dims would mean "all").
  if (dims.empty()) return x.reshape(shape);
  return reduce(ReduceOp::Sum, x, dims, true).view(shape);
}

Tensor argmax(const Tensor& x, int64_t dim) {
  check_same_device("argmax", {&x});
  check_floating("argmax", x);
  std::vector<bool> reduced(static_cast<size_t>(x.dim()), false);
  reduced[wrap_dim("argmax", dim, x)] = true;
  TANDEM_CHECK(x.size(dim) > 0, Value, "argmax: dim ", dim, " of ", shape_str(x.shape()),
               " is empty");
  return reduce_over("argmax", x, reduced, false, kInt64,
                     [&](const Tensor& rows_x, const Tensor& out, int64_t) {
                       backend_for(x.device()).argmax_rows(rows_x, out);
                     });
}

// ---- matmul -----------------------------------------------------------------------------

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  check_same_device("matmul", {&a, &b});
  check_same_dtype("matmul", {&a, &b});
  check_floating("matmul", a);
  TANDEM_CHECK(a.dim() == 2 && b.dim() == 2, Shape, "matmul: expected 2-D tensors, got ",
               matmul_operand(a, trans_a), " @ ", matmul_operand(b, trans_b));
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t ka = trans_a ? a.size(0) : a.size(1);
  const int64_t kb = trans_b ? b.size(1) : b.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  TANDEM_CHECK(ka == kb, Shape, "matmul: ", matmul_operand(a, trans_a), " @ ",
               matmul_operand(b, trans_b), ": inner dims ", ka, " != ", kb);
  auto [ga, ta] = gemm_operand(a, trans_a);
  auto [gb, tb] = gemm_operand(b, trans_b);
  Tensor c({m, n}, a.dtype(), a.device());
  backend_for(a.device()).gemm(ta, tb, 1.0, ga, gb, 0.0, c);
  return c;
}

// ---- linear layers (Note [linear + activation]) ----------------------------------------

namespace {

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::Relu: return "relu";
    case Activation::Sigmoid: return "sigmoid";
    case Activation::None: break;
  }
  return "none";
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias, Activation act) {
  const char* op = "linear";
  check_same_device(op, {&x, &w});
  check_same_dtype(op, {&x, &w});
  check_floating(op, x);
  TANDEM_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), Shape, op, ": input ",
               shape_str(x.shape()), " and weight ", shape_str(w.shape()),
               " are not [M, K] and [N, K]");
  const int64_t m = x.size(0), n = w.size(0);
  if (bias.defined()) {
    check_same_device(op, {&x, &bias});
    check_same_dtype(op, {&x, &bias});
    TANDEM_CHECK(bias.shape() == Shape{n}, Shape, op, ": bias ", shape_str(bias.shape()),
                 " for weight ", shape_str(w.shape()), ", expected [", n, "]");
  }
  Backend& be = backend_for(x.device());
  Tensor y({m, n}, x.dtype(), x.device());
  if (be.linear_forward(x.contiguous(), w.contiguous(), bias.defined() ? bias.contiguous() : bias, act, y)) {
    return y;
  }
  // The composition, the CPU's way (and the reference's): the product as matmul computes it,
  // then the bias, then the activation, each in place.
  auto [gx, tx] = gemm_operand(x, false);
  auto [gw, tw] = gemm_operand(w, true);
  be.gemm(tx, tw, 1.0, gx, gw, 0.0, y);
  if (bias.defined()) binary_(BinaryOp::Add, y, bias);
  if (act != Activation::None) {
    be.unary(activation_forward_op(act), y, y);
  }
  return y;
}

LinearGrads linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x, const Tensor& w,
                            Activation act, int64_t in_features, bool need_dx, bool need_dw,
                            bool need_db, const Tensor& dw_into, const Tensor& db_into) {
  const char* op = "linear_backward";
  check_floating(op, dy);
  TANDEM_CHECK(dy.dim() == 2, Shape, op, ": gradient ", shape_str(dy.shape()), " is not [M, N]");
  const int64_t m = dy.size(0), n = dy.size(1);
  LinearGrads g;
  if (!need_dx && !need_dw && !need_db) return g;
  const auto check_operand = [&](const Tensor& t, const char* name, int64_t rows) {
    TANDEM_CHECK(t.defined(), Value, op, ": the ", name, " is needed for these gradients (",
                 activation_name(act), ")");
    check_same_device(op, {&dy, &t});
    check_same_dtype(op, {&dy, &t});
    TANDEM_CHECK(t.dim() == 2 && t.size(0) == rows, Shape, op, ": ", name, " ",
                 shape_str(t.shape()), " for gradient ", shape_str(dy.shape()));
  };
  if (act != Activation::None) {
    check_operand(y, "output", m);
    TANDEM_CHECK(y.size(1) == n, Shape, op, ": output ", shape_str(y.shape()), " for gradient ",
                 shape_str(dy.shape()));
  }
  if (need_dx) check_operand(w, "weight", n);
  if (need_dw) check_operand(x, "input", m);
  for (const Tensor* t : {need_dx ? &w : nullptr, need_dw ? &x : nullptr}) {
    if (t == nullptr) continue;
    TANDEM_CHECK(t->size(1) == in_features, Shape, op, ": ", t == &w ? "weight " : "input ",
                 shape_str(t->shape()), " for a layer of ", in_features, " inputs");
  }
  const Tensor dyc = dy.contiguous();
  const Tensor yc = act != Activation::None ? y.contiguous() : Tensor();
  const Tensor xc = need_dw ? x.contiguous() : Tensor(), wc = need_dx ? w.contiguous() : Tensor();
  if (need_dx) g.dx = Tensor({m, in_features}, dy.dtype(), dy.device());
  if (need_dw) g.dw = output_into(op, dw_into, {n, in_features}, dy, "dw");
  if (need_db) g.db = output_into(op, db_into, {n}, dy, "db");
  Backend& be = backend_for(dy.device());
  if (be.linear_backward(dyc, yc, xc, wc, act, in_features, g.dx, g.dw, g.db)) return g;
  // The composition: the gradients the separate ops would compute, the same bits.
  const Tensor dz = act == Activation::None ? dyc : binary(activation_backward_op(act), dyc, yc);
  if (need_dx) be.gemm(false, false, 1.0, dz, wc, 0.0, g.dx);
  if (need_dw) be.gemm(true, false, 1.0, dz, xc, 0.0, g.dw);
  if (need_db) g.db.copy_(sum(dz, {0}));
  return g;
}

}  // namespace tandem::kernels
