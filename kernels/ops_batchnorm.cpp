// The dispatcher, batch norm: training (with the fused ReLU, conv bias and residual join),
// evaluation and the backward. Same rules as ops.cpp.
#include "kernels/ops.h"

#include "kernels/ops_checks.h"

namespace tandem::kernels {

namespace {

using internal::check_conv_bias;
using internal::check_floating;
using internal::check_in_place;
using internal::check_shape;
using internal::in_format;
using internal::kernel_format;

// Batch norm keeps the format of its input: a 4-D channels-last x gives channels-last y and dx.
MemoryFormat bn_format(const Tensor& x) { return suggest_memory_format(x); }

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

}  // namespace

// ---- batch norm -------------------------------------------------------------------------

BatchNormResult batch_norm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 const Tensor& running_mean, const Tensor& running_var,
                                 double momentum, double eps, bool relu, const Tensor& bias,
                                 const Tensor& residual, const Tensor& num_batches_tracked) {
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
  if (num_batches_tracked.defined()) {
    check_same_device(op, {&x, &num_batches_tracked});
    TANDEM_CHECK(num_batches_tracked.dtype() == kInt64, DType, op, ": num_batches_tracked is ",
                 dtype_name(num_batches_tracked.dtype()), ", expected int64");
    TANDEM_CHECK(num_batches_tracked.numel() == 1, Shape, op, ": num_batches_tracked is ",
                 shape_str(num_batches_tracked.shape()), ", expected one element");
    check_in_place(op, num_batches_tracked, "num_batches_tracked");
  }
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
                              residual.defined() ? residual.contiguous(fmt) : Tensor(), num_batches_tracked);
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
                                   const Tensor& dy_part, const Tensor& dbias_into) {
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
  TANDEM_CHECK(!dbias_into.defined() || with_dbias, Value, op, ": dbias_into without with_dbias");
  const int64_t c = x.size(1);
  Backend& be = backend_for(x.device());
  const MemoryFormat want = bn_format(x), fmt = kernel_format(be, want);
  // save_mean has the per-channel dtype and x's device (check_bn_args). dbias: x's dtype, or
  // save_mean's where dbias_into has it.
  const Tensor& dbias_like = dbias_into.defined() && dbias_into.dtype() == save_mean.dtype() ? save_mean : x;
  BatchNormGrads g{Tensor(x.shape(), x.dtype(), x.device(), fmt), output_into(op, dgamma_into, {c}, save_mean, "dgamma"),
                   output_into(op, dbeta_into, {c}, save_mean, "dbeta"),
                   with_dbias ? output_into(op, dbias_into, {c}, dbias_like, "dbias_into") : Tensor(),
                   with_masked_dy ? Tensor(x.shape(), x.dtype(), x.device(), fmt) : Tensor()};
  be.batch_norm_backward(dy.contiguous(fmt), x.contiguous(fmt), bias.defined() ? bias.contiguous() : Tensor(),
                         or_full(gamma, c, 1.0, x), save_mean.contiguous(), save_invstd.contiguous(),
                         relu_out.defined() ? relu_out.contiguous(fmt) : Tensor(), g.dx, g.dgamma, g.dbeta,
                         g.dbias, g.masked_dy, dy_part.defined() ? dy_part.contiguous(fmt) : Tensor());
  g.dx = in_format(g.dx, fmt, want);
  if (with_masked_dy) g.masked_dy = in_format(g.masked_dy, fmt, want);
  return g;
}

}  // namespace tandem::kernels
