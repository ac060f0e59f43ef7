// The dispatcher, part 2: the neural-network ops (convolution, pooling, log-softmax and
// cross-entropy, row indexing, batch norm, optimizer steps). Same rules as ops.cpp: check,
// allocate on the inputs' device, make inputs contiguous where the backend needs it, dispatch.
#include "kernels/ops.h"

#include "kernels/activation_ops.h"

namespace tandem::kernels {

namespace {

void check_floating(const char* op, const Tensor& t) {
  TANDEM_CHECK(is_floating(t.dtype()), DType, op, ": expected a float32 or float64 tensor, got ",
               dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

void check_dims(const char* op, const Tensor& t, int64_t nd, const char* what) {
  TANDEM_CHECK(t.dim() == nd, Shape, op, ": expected ", what, ", got ", shape_str(t.shape()));
}

void check_shape(const char* op, const Tensor& t, const Shape& want, const char* name) {
  TANDEM_CHECK(t.shape() == want, Shape, op, ": ", name, " is ", shape_str(t.shape()),
               ", expected ", shape_str(want));
}

void check_target(const char* op, const Tensor& target, int64_t n) {
  TANDEM_CHECK(target.dtype() == kInt64, DType, op, ": target must be int64, got ",
               dtype_name(target.dtype()));
  check_shape(op, target, {n}, "target");
}

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

// The dtype of batch norm's per-channel tensors (gamma, beta, running and saved statistics,
// their gradients) for input x: x's own, except float32 for a bfloat16 x — mixed precision as
// in PyTorch (bfloat16 activations, float32 parameters and statistics).
DType bn_param_dtype(const Tensor& x) { return x.dtype() == kBFloat16 ? kFloat32 : x.dtype(); }

// gamma/beta may be undefined (no affine part): the backend always gets [C] tensors.
Tensor or_full(const Tensor& t, int64_t c, double value, const Tensor& x) {
  return t.defined() ? t.contiguous() : full({c}, value, bn_param_dtype(x), x.device());
}

void check_bn_args(const char* op, const Tensor& x,
                   std::initializer_list<const Tensor*> per_channel) {
  check_floating(op, x);
  TANDEM_CHECK(x.dim() == 2 || x.dim() == 4, Shape, op,
               ": expected [N, C] or [N, C, H, W] input, got ", shape_str(x.shape()));
  for (const Tensor* t : per_channel) {
    if (!t->defined()) continue;
    check_same_device(op, {&x, t});
    TANDEM_CHECK(t->dtype() == bn_param_dtype(x), DType, op, ": input ", dtype_name(x.dtype()), " ",
                 shape_str(x.shape()), " needs ", dtype_name(bn_param_dtype(x)), " per-channel tensors, got ",
                 dtype_name(t->dtype()), " ", shape_str(t->shape()));
    check_shape(op, *t, {x.size(1)}, "a per-channel tensor");
  }
}

void check_optim_arg(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  check_same_device(op, {&param, &t});
  check_same_dtype(op, {&param, &t});
  check_shape(op, t, param.shape(), name);
}

void check_in_place(const char* op, const Tensor& t, const char* name) {
  TANDEM_CHECK(t.is_contiguous() || t.is_contiguous(MemoryFormat::ChannelsLast), Value, op, ": ", name, " ",
               shape_str(t.shape()), " is updated in place and must be contiguous or channels-last");
}

// The optimizer kernels run over raw memory, so a gradient or state tensor must be laid out as
// its parameter is (same_layout). `t` laid out as the in-place tensor `param` (contiguous or channels-last, check_in_place).
Tensor layout_of(const Tensor& t, const Tensor& param) {
  if (same_layout(t, param)) return t;
  return t.contiguous(param.is_contiguous() ? MemoryFormat::Contiguous : MemoryFormat::ChannelsLast);
}

void check_state_layout(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  TANDEM_CHECK(same_layout(param, t), Value, op, ": ", name, " ", shape_str(t.shape()),
               " is laid out differently from its parameter (memory format)");
}

// A device-resident scalar input of a capturable optimizer step: `numel` contiguous values of
// `dtype` on `device`.
void check_step_input(const char* op, const Tensor& t, DType dtype, int64_t numel, Device device,
                      const char* name) {
  TANDEM_CHECK(t.defined(), Value, op, ": ", name, " is undefined");
  TANDEM_CHECK(t.dtype() == dtype, DType, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
               dtype_name(t.dtype()));
  TANDEM_CHECK(t.numel() == numel && t.is_contiguous(), Shape, op, ": ", name, " must be ", numel,
               " contiguous value", numel == 1 ? "" : "s", ", got ", shape_str(t.shape()));
  TANDEM_CHECK(t.device() == device, Device, op, ": ", name, " is on ", t.device().str(),
               ", the step runs on ", device.str());
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

// The format the backend computes in: `wanted`, or contiguous where it has no channels-last kernels.
MemoryFormat kernel_format(const Backend& be, MemoryFormat wanted) {
  return be.supports_channels_last() ? wanted : MemoryFormat::Contiguous;
}

// `t` (computed in format `have`) with exactly the strides of format `want` (restrided): a
// result the caller reads the format of again, even where size-1 dims make the two layouts the
// same memory.
Tensor in_format(const Tensor& t, MemoryFormat have, MemoryFormat want) {
  return have == want ? t : restrided(t, want);
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

// Batch norm keeps the format of its input: a 4-D channels-last x gives channels-last y and dx.
namespace {
MemoryFormat bn_format(const Tensor& x) { return suggest_memory_format(x); }

// A conv's bias fused into the op after it (Note [conv bias in batch norm], Note [conv bias in
// activation + pooling] in kernels/ops.h): [C], on x's device, of x's own dtype (the conv's
// output's, not a batch norm's per-channel tensors').
void check_conv_bias(const char* op, const Tensor& x, const Tensor& bias) {
  if (!bias.defined()) return;
  check_same_device(op, {&x, &bias});
  TANDEM_CHECK(bias.dtype() == x.dtype(), DType, op, ": bias ", dtype_name(bias.dtype()), " ",
               shape_str(bias.shape()), " must have the dtype of the input ", dtype_name(x.dtype()), " ",
               shape_str(x.shape()));
  TANDEM_CHECK(bias.shape() == Shape{x.size(1)}, Shape, op, ": bias is ", shape_str(bias.shape()),
               ", expected [", x.size(1), "] for input ", shape_str(x.shape()));
}
}  // namespace

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

// ---- log-softmax and cross-entropy ------------------------------------------------------

Tensor log_softmax(const Tensor& x) {
  check_same_device("log_softmax", {&x});
  check_floating("log_softmax", x);
  check_dims("log_softmax", x, 2, "a 2-D [N, C] tensor");
  Tensor y(x.shape(), x.dtype(), x.device());
  backend_for(x.device()).log_softmax(x.contiguous(), y);
  return y;
}

Tensor log_softmax_backward(const Tensor& dy, const Tensor& y) {
  const char* op = "log_softmax_backward";
  check_same_device(op, {&dy, &y});
  check_same_dtype(op, {&dy, &y});
  check_floating(op, y);
  check_dims(op, y, 2, "a 2-D [N, C] tensor");
  check_shape(op, dy, y.shape(), "dy");
  Tensor dx(y.shape(), y.dtype(), y.device());
  backend_for(y.device()).log_softmax_backward(dy.contiguous(), y.contiguous(), dx);
  return dx;
}

std::pair<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target) {
  const char* op = "cross_entropy";
  check_same_device(op, {&logits, &target});
  check_floating(op, logits);
  check_dims(op, logits, 2, "logits [N, C]");
  check_target(op, target, logits.size(0));
  Tensor log_probs(logits.shape(), logits.dtype(), logits.device());
  Tensor loss(Shape{}, logits.dtype(), logits.device());
  backend_for(logits.device())
      .cross_entropy_forward(logits.contiguous(), target.contiguous(), log_probs, loss);
  return {loss, log_probs};
}

Tensor cross_entropy_backward(const Tensor& log_probs, const Tensor& target, const Tensor& dloss) {
  const char* op = "cross_entropy_backward";
  check_same_device(op, {&log_probs, &target, &dloss});
  check_same_dtype(op, {&log_probs, &dloss});
  check_floating(op, log_probs);
  check_dims(op, log_probs, 2, "log_probs [N, C]");
  check_target(op, target, log_probs.size(0));
  TANDEM_CHECK(dloss.numel() == 1, Shape, op, ": dloss must have one element, got ",
               shape_str(dloss.shape()));
  Tensor dlogits(log_probs.shape(), log_probs.dtype(), log_probs.device());
  backend_for(log_probs.device())
      .cross_entropy_backward(log_probs.contiguous(), target.contiguous(), dloss, dlogits);
  return dlogits;
}

void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct) {
  const char* op = "count_correct";
  check_same_device(op, {&logits, &target, &correct});
  check_floating(op, logits);
  check_dims(op, logits, 2, "logits [N, C]");
  check_target(op, target, logits.size(0));
  TANDEM_CHECK(correct.dtype() == kInt64 && correct.numel() == 1, DType, op,
               ": the counter must be a one-element int64 tensor, got ", correct.str());
  // bfloat16 logits (autocast) are counted in float32: every bfloat16 value is one, so the
  // argmax is the same.
  const Tensor l = logits.dtype() == kBFloat16 ? logits.to(kFloat32) : logits;
  backend_for(logits.device()).count_correct(l.contiguous(), target.contiguous(), correct);
}

// ---- indexing ---------------------------------------------------------------------------

Tensor index_select(const Tensor& x, const Tensor& index, const Tensor& into) {
  check_same_device("index_select", {&x, &index});
  TANDEM_CHECK(x.dim() >= 1, Shape, "index_select: cannot index a 0-d tensor");
  TANDEM_CHECK(index.dtype() == kInt64, DType, "index_select: index must be int64, got ",
               dtype_name(index.dtype()));
  check_dims("index_select", index, 1, "a 1-D index");
  Shape shape = x.shape();
  shape[0] = index.size(0);
  Tensor out = output_into("index_select", into, shape, x, "into");
  TANDEM_CHECK(!into.defined() || (into.storage() != x.storage() && into.storage() != index.storage()), Value,
               "index_select: into shares its memory with the input or the index (rows would be read after "
               "they are written)");
  backend_for(x.device()).index_select(x.contiguous(), index.contiguous(), out);
  return out;
}

namespace {
void check_index_add(const char* op, const Tensor& src, const Tensor& index, const Shape& shape) {
  check_same_device(op, {&src, &index});
  TANDEM_CHECK(!shape.empty(), Shape, op, ": the output must have at least one dim");
  TANDEM_CHECK(index.dtype() == kInt64, DType, op, ": index must be int64, got ", dtype_name(index.dtype()));
  check_dims(op, index, 1, "a 1-D index");
  Shape src_shape = shape;
  src_shape[0] = index.size(0);
  check_shape(op, src, src_shape, "src");
}
}  // namespace

Tensor index_add(const Tensor& src, const Tensor& index, const Shape& shape) {
  check_index_add("index_add", src, index, shape);
  Tensor out(shape, src.dtype(), src.device());
  out.zero_();
  backend_for(src.device()).index_add(src.contiguous(), index.contiguous(), out);
  return out;
}

void index_add_(const Tensor& out, const Tensor& index, const Tensor& src) {
  check_index_add("index_add_", src, index, out.shape());
  check_same_device("index_add_", {&out, &src});
  check_same_dtype("index_add_", {&out, &src});
  TANDEM_CHECK(out.is_contiguous(), Shape, "index_add_: out ", shape_str(out.shape()), " is not packed");
  TANDEM_CHECK(out.storage() != src.storage() && out.storage() != index.storage(), Value,
               "index_add_: out shares its memory with src or the index");
  backend_for(out.device()).index_add(src.contiguous(), index.contiguous(), out);
}

// ---- batch norm -------------------------------------------------------------------------

BatchNormResult batch_norm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 const Tensor& running_mean, const Tensor& running_var,
                                 double momentum, double eps, bool relu, const Tensor& bias,
                                 const Tensor& residual) {
  const char* op = "batch_norm";
  check_same_device(op, {&x, &running_mean, &running_var});
  check_bn_args(op, x, {&gamma, &beta, &running_mean, &running_var});
  check_conv_bias(op, x, bias);
  if (residual.defined()) {
    TANDEM_CHECK(relu, Value, op, ": a residual is added before the ReLU; pass relu=true");
    check_same_device(op, {&x, &residual});
    check_same_dtype(op, {&x, &residual});
    check_shape(op, residual, x.shape(), "residual");
  }
  check_in_place(op, running_mean, "running_mean");
  check_in_place(op, running_var, "running_var");
  const int64_t c = x.size(1);
  TANDEM_CHECK(c > 0 && x.numel() / c > 1, Value, op,
               ": training needs more than one value per channel, got input ",
               shape_str(x.shape()));
  Backend& be = backend_for(x.device());
  const MemoryFormat want = bn_format(x), fmt = kernel_format(be, want);
  BatchNormResult r{Tensor(x.shape(), x.dtype(), x.device(), fmt), Tensor({c}, bn_param_dtype(x), x.device()),
                    Tensor({c}, bn_param_dtype(x), x.device())};
  be.batch_norm_forward_train(x.contiguous(fmt), bias.defined() ? bias.contiguous() : Tensor(),
                              or_full(gamma, c, 1.0, x), or_full(beta, c, 0.0, x), running_mean, running_var,
                              momentum, eps, r.y, r.save_mean, r.save_invstd, relu,
                              residual.defined() ? residual.contiguous(fmt) : Tensor());
  r.y = in_format(r.y, fmt, want);
  return r;
}

Tensor batch_norm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, double eps, bool relu,
                       const Tensor& bias) {
  const char* op = "batch_norm";
  check_same_device(op, {&x, &running_mean, &running_var});
  check_bn_args(op, x, {&gamma, &beta, &running_mean, &running_var});
  check_conv_bias(op, x, bias);
  const int64_t c = x.size(1);
  Backend& be = backend_for(x.device());
  const MemoryFormat want = bn_format(x), fmt = kernel_format(be, want);
  Tensor y(x.shape(), x.dtype(), x.device(), fmt);
  be.batch_norm_forward_eval(x.contiguous(fmt), bias.defined() ? bias.contiguous() : Tensor(),
                             or_full(gamma, c, 1.0, x), or_full(beta, c, 0.0, x), running_mean.contiguous(),
                             running_var.contiguous(), eps, y, relu);
  return in_format(y, fmt, want);
}

BatchNormGrads batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                   const Tensor& save_mean, const Tensor& save_invstd,
                                   const Tensor& relu_out, const Tensor& bias, bool with_dbias,
                                   const Tensor& dgamma_into, const Tensor& dbeta_into, bool with_masked_dy,
                                   const Tensor& dy_part) {
  const char* op = "batch_norm_backward";
  check_same_device(op, {&dy, &x, &save_mean, &save_invstd});
  check_same_dtype(op, {&dy, &x});
  check_bn_args(op, x, {&gamma, &save_mean, &save_invstd});
  check_conv_bias(op, x, bias);
  check_shape(op, dy, x.shape(), "dy");
  if (relu_out.defined()) {
    check_same_device(op, {&dy, &relu_out});
    check_same_dtype(op, {&dy, &relu_out});
    check_shape(op, relu_out, x.shape(), "relu_out");
  }
  TANDEM_CHECK(!with_masked_dy || relu_out.defined(), Value, op,
               ": the masked gradient needs the ReLU's output (relu_out is undefined)");
  if (dy_part.defined()) {
    check_same_device(op, {&dy, &dy_part});
    check_same_dtype(op, {&dy, &dy_part});
    check_shape(op, dy_part, x.shape(), "dy_part");
  }
  const int64_t c = x.size(1);
  Backend& be = backend_for(x.device());
  const MemoryFormat want = bn_format(x), fmt = kernel_format(be, want);
  // save_mean has the per-channel dtype and x's device (check_bn_args).
  BatchNormGrads g{Tensor(x.shape(), x.dtype(), x.device(), fmt), output_into(op, dgamma_into, {c}, save_mean, "dgamma"),
                   output_into(op, dbeta_into, {c}, save_mean, "dbeta"),
                   with_dbias ? Tensor({c}, x.dtype(), x.device()) : Tensor(),
                   with_masked_dy ? Tensor(x.shape(), x.dtype(), x.device(), fmt) : Tensor()};
  be.batch_norm_backward(dy.contiguous(fmt), x.contiguous(fmt), bias.defined() ? bias.contiguous() : Tensor(),
                         or_full(gamma, c, 1.0, x), save_mean.contiguous(), save_invstd.contiguous(),
                         relu_out.defined() ? relu_out.contiguous(fmt) : Tensor(), g.dx, g.dgamma, g.dbeta,
                         g.dbias, g.masked_dy, dy_part.defined() ? dy_part.contiguous(fmt) : Tensor());
  g.dx = in_format(g.dx, fmt, want);
  if (with_masked_dy) g.masked_dy = in_format(g.masked_dy, fmt, want);
  return g;
}

// ---- optimizer steps --------------------------------------------------------------------

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
              const SgdParams& p) {
  const char* op = "sgd_step";
  check_same_device(op, {&param});
  check_floating(op, param);
  check_optim_arg(op, param, grad, "grad");
  check_in_place(op, param, "param");
  TANDEM_CHECK(p.lr >= 0 && p.momentum >= 0 && p.weight_decay >= 0, Value, op,
               ": lr, momentum and weight_decay must be >= 0, got ", p.lr, ", ", p.momentum, ", ",
               p.weight_decay);
  TANDEM_CHECK(!p.nesterov || (p.momentum > 0 && p.dampening == 0), Value, op,
               ": nesterov needs momentum > 0 and dampening 0");
  if (p.momentum != 0) {
    TANDEM_CHECK(momentum_buf.defined(), Value, op, ": momentum ", p.momentum,
                 " needs a momentum buffer");
    check_optim_arg(op, param, momentum_buf, "momentum_buf");
    check_in_place(op, momentum_buf, "momentum_buf");
    check_state_layout(op, param, momentum_buf, "momentum_buf");
  }
  if (p.lr_tensor.defined())
    check_step_input(op, p.lr_tensor, kFloat64, 1, param.device(), "lr_tensor");
  backend_for(param.device()).sgd_step(param, layout_of(grad, param), momentum_buf, p);
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               const AdamParams& p) {
  const char* op = "adam_step";
  check_same_device(op, {&param});
  check_floating(op, param);
  check_optim_arg(op, param, grad, "grad");
  check_optim_arg(op, param, m, "m");
  check_optim_arg(op, param, v, "v");
  check_in_place(op, param, "param");
  check_in_place(op, m, "m");
  check_in_place(op, v, "v");
  check_state_layout(op, param, m, "m");
  check_state_layout(op, param, v, "v");
  if (p.consts.defined()) {
    check_step_input(op, p.consts, kFloat64, 3, param.device(), "consts");
  } else {
    TANDEM_CHECK(p.step >= 1, Value, op, ": step is 1-based, got ", p.step);
  }
  TANDEM_CHECK(p.beta1 >= 0 && p.beta1 < 1 && p.beta2 >= 0 && p.beta2 < 1, Value, op,
               ": betas must be in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  backend_for(param.device()).adam_step(param, layout_of(grad, param), m, v, p);
}

void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                       const AdamParams& p) {
  const char* op = "adam_advance_step";
  TANDEM_CHECK(step.defined(), Value, op, ": step is undefined");
  const Device d = step.device();
  check_step_input(op, step, kFloat32, 1, d, "step");
  check_step_input(op, lr, kFloat64, 1, d, "lr");
  check_step_input(op, consts, kFloat64, 3, d, "consts");
  TANDEM_CHECK(p.beta1 >= 0 && p.beta1 < 1 && p.beta2 >= 0 && p.beta2 < 1, Value, op,
               ": betas must be in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  TANDEM_CHECK(p.weight_decay >= 0, Value, op, ": weight_decay must be >= 0, got ", p.weight_decay);
  backend_for(d).adam_advance_step(step, lr, consts, p);
}

}  // namespace tandem::kernels
