// The dispatcher, the convolution ops: convolution and its gradients, pooling, activation +
// pooling. Same rules as ops.cpp: check, allocate on the inputs' device, make inputs contiguous
// where the backend needs it, dispatch.
#include "kernels/ops.h"

#include "kernels/activation_ops.h"
#include "kernels/ops_checks.h"

namespace tandem::kernels {

namespace {

using internal::check_conv_bias;
using internal::check_dims;
using internal::check_floating;
using internal::check_shape;
using internal::in_format;
using internal::kernel_format;

// Output extent of a convolution or pooling window sliding along one dim.
int64_t out_extent(const char* op, int64_t in, int64_t k, int64_t stride, int64_t pad,
                   const Shape& x_shape) {
  TANDEM_CHECK(stride >= 1 && pad >= 0, Value, op, ": stride ", stride, " and padding ", pad,
               " must be >= 1 and >= 0");
  TANDEM_CHECK(in + 2 * pad >= k, Shape, op, ": window ", k, " is larger than the padded input ",
               in + 2 * pad, " of ", shape_str(x_shape));
  return (in + 2 * pad - k) / stride + 1;
}

// [N, K, P, Q] of a convolution of x_shape [N, C, H, W] with w_shape [K, C, R, S].
Shape conv_out_shape(const char* op, const Shape& x, const Shape& w, const Conv2dParams& p) {
  TANDEM_CHECK(x.size() == 4 && w.size() == 4, Shape, op,
               ": expected input [N, C, H, W] and weight [K, C, R, S], got ", shape_str(x), " and ",
               shape_str(w));
  TANDEM_CHECK(x[1] == w[1], Shape, op, ": input ", shape_str(x), " has ", x[1],
               " channels but weight ", shape_str(w), " expects ", w[1]);
  return {x[0], w[0], out_extent(op, x[2], w[2], p.stride_h, p.pad_h, x),
          out_extent(op, x[3], w[3], p.stride_w, p.pad_w, x)};
}

const char* pool_name(PoolMode mode) {
  return mode == PoolMode::Max ? "max_pool2d" : "avg_pool2d";
}

Shape pool_out_shape(const char* op, const Tensor& x, const Pool2dParams& p) {
  check_dims(op, x, 4, "input [N, C, H, W]");
  TANDEM_CHECK(p.kernel_h >= 1 && p.kernel_w >= 1, Value, op, ": kernel ", p.kernel_h, "x",
               p.kernel_w, " must be positive");
  // A window entirely in the padding would have no input to pool (PyTorch has the same rule).
  TANDEM_CHECK(2 * p.pad_h <= p.kernel_h && 2 * p.pad_w <= p.kernel_w, Value, op, ": padding ",
               p.pad_h, "x", p.pad_w, " must be at most half the kernel ", p.kernel_h, "x",
               p.kernel_w);
  return {x.size(0), x.size(1),
          out_extent(op, x.size(2), p.kernel_h, p.stride_h, p.pad_h, x.shape()),
          out_extent(op, x.size(3), p.kernel_w, p.stride_w, p.pad_w, x.shape())};
}

}  // namespace

// ---- convolution ------------------------------------------------------------------------

namespace {

// output_into for a weight or bias gradient: also a float32 `into` for bfloat16 `like` (an
// autocast parameter's float32 .grad; kernels/backend.h, conv2d_backward_weight).
Tensor grad_into(const char* op, const Tensor& into, const Shape& shape, const Tensor& like,
                 const char* name) {
  if (!into.defined() || like.dtype() != kBFloat16 || into.dtype() != kFloat32) {
    return output_into(op, into, shape, like, name);
  }
  TANDEM_CHECK(into.shape() == shape && into.is_contiguous(), Shape, op, ": ", name, " is ",
               shape_str(into.shape()), into.is_contiguous() ? "" : " (not packed)", ", expected a packed ",
               shape_str(shape));
  TANDEM_CHECK(into.device() == like.device(), Device, op, ": ", name, " is on ", into.device().str(),
               ", expected ", like.device().str());
  return into;
}

// Note [memory formats] in core/tensor.h: a convolution runs channels-last when either of its
// two operands is; on a backend without channels-last kernels it runs contiguous and its result
// is converted, so the caller sees the same format on every device.
MemoryFormat conv_format(const Tensor& a, const Tensor& b) {
  return suggest_memory_format(a) == MemoryFormat::ChannelsLast ||
                 suggest_memory_format(b) == MemoryFormat::ChannelsLast
             ? MemoryFormat::ChannelsLast
             : MemoryFormat::Contiguous;
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p) {
  check_same_device("conv2d", {&x, &w});
  check_same_dtype("conv2d", {&x, &w});
  check_floating("conv2d", x);
  const Shape ys = conv_out_shape("conv2d", x.shape(), w.shape(), p);
  Tensor b;
  if (bias.defined()) {
    check_same_device("conv2d", {&x, &bias});
    check_same_dtype("conv2d", {&x, &bias});
    check_shape("conv2d", bias, {w.size(0)}, "bias");
    b = bias.contiguous();
  }
  Backend& be = backend_for(x.device());
  const MemoryFormat want = conv_format(x, w), fmt = kernel_format(be, want);
  Tensor y(ys, x.dtype(), x.device(), fmt);
  be.conv2d_forward(x.contiguous(fmt), w.contiguous(fmt), b, p, y);
  return in_format(y, fmt, want);
}

Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                             const Shape& x_shape) {
  const char* op = "conv2d_backward_input";
  check_same_device(op, {&dy, &w});
  check_same_dtype(op, {&dy, &w});
  check_floating(op, dy);
  check_shape(op, dy, conv_out_shape(op, x_shape, w.shape(), p), "dy");
  Backend& be = backend_for(dy.device());
  const MemoryFormat want = conv_format(dy, w), fmt = kernel_format(be, want);
  Tensor dx(x_shape, dy.dtype(), dy.device(), fmt);
  be.conv2d_backward_input(dy.contiguous(fmt), w.contiguous(fmt), p, dx);
  return in_format(dx, fmt, want);
}

std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& x, const Tensor& dy,
                                                 const Conv2dParams& p, const Shape& w_shape,
                                                 bool with_bias, const Tensor& dw_into,
                                                 const Tensor& db_into) {
  const char* op = "conv2d_backward_weight";
  check_same_device(op, {&x, &dy});
  check_same_dtype(op, {&x, &dy});
  check_floating(op, x);
  check_shape(op, dy, conv_out_shape(op, x.shape(), w_shape, p), "dy");
  Backend& be = backend_for(x.device());
  const MemoryFormat want = conv_format(x, dy), fmt = kernel_format(be, want);
  // dw_into takes the kernels' output in their layout: packed NCHW, or channels-last where a
  // filter of one input channel (or 1x1) makes the two the same memory; it is then the dw
  // returned, with its own strides.
  Tensor dw = dw_into.defined() ? grad_into(op, dw_into, w_shape, x, "dw") : Tensor();
  const bool same_memory = w_shape[1] == 1 || (w_shape[2] == 1 && w_shape[3] == 1);
  const bool into = dw.defined() && (fmt == MemoryFormat::Contiguous || same_memory);
  if (!into) dw = Tensor(w_shape, x.dtype(), x.device(), fmt);
  Tensor db = with_bias ? grad_into(op, db_into, {w_shape[0]}, x, "db") : Tensor();
  // The backend takes dw and db of one dtype: a db of the other is written from one of dw's.
  const bool db_other = db.defined() && db.dtype() != dw.dtype();
  const Tensor db_k = db_other ? Tensor(db.shape(), dw.dtype(), db.device()) : db;
  be.conv2d_backward_weight(x.contiguous(fmt), dy.contiguous(fmt), p, dw, db_k);
  if (!db_k.same(db)) db.copy_(db_k);
  return {into ? dw : in_format(dw, fmt, want), db};
}

Tensor conv2d_backward_bias(const Tensor& dy) {
  const char* op = "conv2d_backward_bias";
  check_floating(op, dy);
  check_dims(op, dy, 4, "dy [N, K, P, Q]");
  Backend& be = backend_for(dy.device());
  Tensor db({dy.size(1)}, dy.dtype(), dy.device());
  be.conv2d_backward_bias(dy.contiguous(kernel_format(be, suggest_memory_format(dy))), db);
  return db;
}

// ---- pooling ----------------------------------------------------------------------------

// Note [bfloat16 pooling]: pooling has no bfloat16 kernels; a bfloat16 input is pooled in
// float32 and the result rounded once (exact for max pooling; the average is one rounding of
// the float32 average), on every backend.
namespace {
// pool2d of a checked x into y [pool_out_shape], of x's dtype.
void pool2d_into(PoolMode mode, const Tensor& x, const Pool2dParams& p, const Tensor& y) {
  if (x.dtype() == kBFloat16) {  // Note [bfloat16 pooling]
    y.copy_(pool2d(mode, x.to(kFloat32), p));
    return;
  }
  backend_for(x.device()).pool2d_forward(mode, x.contiguous(), p, y);
}
// pool2d_backward's arithmetic into dx (x's shape and dtype), the arguments checked.
void pool2d_backward_into(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                          const Pool2dParams& p, const Tensor& dx) {
  if (x.dtype() == kBFloat16) {  // Note [bfloat16 pooling]
    dx.copy_(pool2d_backward(mode, x.to(kFloat32), y.to(kFloat32), dy.to(kFloat32), p));
    return;
  }
  backend_for(x.device()).pool2d_backward(mode, x.contiguous(), y.contiguous(), dy.contiguous(), p, dx);
}
}  // namespace

Tensor pool2d(PoolMode mode, const Tensor& x, const Pool2dParams& p) {
  const char* op = pool_name(mode);
  check_same_device(op, {&x});
  check_floating(op, x);
  Tensor y(pool_out_shape(op, x, p), x.dtype(), x.device());
  pool2d_into(mode, x, p, y);
  return y;
}

Tensor pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                       const Pool2dParams& p) {
  const char* op = mode == PoolMode::Max ? "max_pool2d_backward" : "avg_pool2d_backward";
  check_same_device(op, {&x, &y, &dy});
  check_same_dtype(op, {&x, &y, &dy});
  check_floating(op, x);
  const Shape ys = pool_out_shape(op, x, p);
  check_shape(op, y, ys, "y");
  check_shape(op, dy, ys, "dy");
  Tensor dx(x.shape(), x.dtype(), x.device());
  pool2d_backward_into(mode, x, y, dy, p, dx);
  return dx;
}

// ---- activation + pooling (Note [activation + pooling]) ---------------------------------

namespace {

Tensor activate(const Tensor& z, Activation act) {
  if (act == Activation::None) return z;
  return unary(activation_forward_op(act), z);
}

// z + bias[c] over z [N, C, H, W]: the add of the convolution that left its bias out (the
// conv's own add, the same bits).
Tensor add_channel_bias(const Tensor& z, const Tensor& bias) {
  if (!bias.defined()) return z;
  Shape cs(static_cast<size_t>(z.dim()), 1);
  cs[1] = z.size(1);
  return binary(BinaryOp::Add, z, bias.reshape(cs));
}

}  // namespace

Tensor activation_pool2d(const Tensor& z, Activation act, PoolMode mode, const Pool2dParams& p, const Tensor& bias) {
  const char* op = pool_name(mode);
  check_same_device(op, {&z});
  check_floating(op, z);
  Tensor y(pool_out_shape(op, z, p), z.dtype(), z.device());
  check_conv_bias(op, z, bias);
  if (z.is_contiguous() && backend_for(z.device()).activation_pool2d_forward(z, bias, act, mode, p, y)) return y;
  pool2d_into(mode, activate(add_channel_bias(z, bias), act), p, y);  // the composition, the reference's way
  return y;
}

Tensor activation_pool2d_backward(const Tensor& dy, const Tensor& z, const Tensor& y, Activation act,
                                  PoolMode mode, const Pool2dParams& p, const Tensor& bias) {
  const char* op = mode == PoolMode::Max ? "max_pool2d_backward" : "avg_pool2d_backward";
  check_same_device(op, {&dy, &z, &y});
  check_same_dtype(op, {&dy, &z, &y});
  check_floating(op, z);
  const Shape ys = pool_out_shape(op, z, p);
  check_shape(op, y, ys, "y");
  check_shape(op, dy, ys, "dy");
  check_conv_bias(op, z, bias);
  Tensor dz(z.shape(), z.dtype(), z.device());
  if (z.is_contiguous() && dy.is_contiguous() &&
      backend_for(z.device()).activation_pool2d_backward(dy, z, bias, act, mode, p, dz)) {
    return dz;
  }
  // The composition: the gradients the separate ops compute, the same bits, into the same dz.
  const Tensor a = activate(add_channel_bias(z, bias), act);
  pool2d_backward_into(mode, a, y, dy, p, dz);  // the pooling gradient, at a
  if (act != Activation::None) binary_(activation_backward_op(act), dz, a);
  return dz;
}

}  // namespace tandem::kernels
