// Differentiable neural-network ops: matmul, linear, conv2d, pooling, log_softmax,
// cross_entropy, batch_norm. Each backward calls the matching fused kernel.
#include <optional>

#include "autograd/autocast.h"
#include "autograd/function.h"
#include "autograd/grad_stream.h"
#include "autograd/ops.h"

namespace tandem {

using autograd::needs_grad;
using autograd::record;
using autograd::saved;
using autograd::TensorList;

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  // Under autocast the product runs in bfloat16 (Note [autocast] in autograd/autocast.h): the
  // casts are differentiable, so the gradients reach a_in and b_in in their own dtype.
  const Tensor a = autocast_input(a_in), b = autocast_input(b_in);
  Tensor y = kernels::matmul(a, b);  // [M, K] @ [K, N] -> [M, N]
  if (autograd::any_requires_grad({&a, &b})) {
    const bool na = needs_grad(a), nb = needs_grad(b);
    record("Matmul", {a, b}, {y},
           [na, nb, a = nb ? saved(a) : Tensor(),
            b = na ? saved(b) : Tensor()](TensorList&& g) -> TensorList {
             Tensor ga = na ? kernels::matmul(g[0], b, false, true) : Tensor();  // g @ b^T
             Tensor gb = nb ? kernels::matmul(a, g[0], true, false) : Tensor();  // a^T @ g
             return {ga, gb};
           });
  }
  return y;
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  return linear_activation(x, w, b, Activation::None);
}

Tensor linear_activation(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, Activation act) {
  // Autocast as in matmul. The bias is added to the rounded bfloat16 product (PyTorch's
  // addmm adds it inside the float32 epilogue): one more rounding, within a bfloat16 ulp.
  const Tensor x = autocast_input(x_in), w = autocast_input(w_in), b = autocast_input(b_in);
  Tensor y = kernels::linear(x, w, b, act);  // [N, in] @ [out, in]^T + b -> [N, out]
  if (autograd::any_requires_grad({&x, &w, &b})) {
    const bool nx = needs_grad(x), nw = needs_grad(w), nb = needs_grad(b);
    const char* name = act == Activation::Relu      ? "LinearRelu"
                       : act == Activation::Sigmoid ? "LinearSigmoid"
                                                    : "Linear";
    record(name, {x, w, b}, {y},
           [nx, nw, nb, act, k = x.size(1), n = w.size(0), x = nw ? saved(x) : Tensor(),
            w = nx ? saved(w) : Tensor(),
            y = act != Activation::None ? saved(y) : Tensor()](TensorList&& g) -> TensorList {
             // Into the leaves' zeroed .grad where it can, also through an autocast weight's
             // conversion (Note [gradients written in place]).
             const DType dt = g[0].dtype();
             const Device dev = g[0].device();
             const Tensor dw_to = nw ? autograd::weight_grad_destination(1, {n, k}, dev) : Tensor();
             const Tensor db_to = nb ? autograd::weight_grad_destination(2, {n}, dev) : Tensor();
             const auto weight_grads = [&](bool with_dx) {
               kernels::LinearGrads r = kernels::linear_backward(g[0], y, x, w, act, k, with_dx, nw, nb,
                                                                 autograd::direct_destination(dw_to, dt),
                                                                 autograd::direct_destination(db_to, dt));
               r.dw = autograd::written_into(r.dw, dw_to);
               r.db = autograd::written_into(r.db, db_to);
               return r;
             };
             // Beside dx on a second stream when both land in .grad (Note [weight gradients on a
             // second stream] in autograd/grad_stream.h).
             if (autograd::fork_weight_grads(nx, nw, dw_to, nb, db_to)) {
               kernels::LinearGrads r;
               {
                 // dW = dy^T x: [n, k] from batch rows of both (Note [the side stream's priority]).
                 const autograd::WeightGradStream side(dev, {g[0], y, x}, g[0].numel() * k);
                 r = weight_grads(false);
               }
               r.dx = kernels::linear_backward(g[0], y, x, w, act, k, true, false, false).dx;
               return {r.dx, r.dw, r.db};
             }
             kernels::LinearGrads r = weight_grads(nx);
             return {r.dx, r.dw, r.db};
           });
  }
  return y;
}

Tensor conv2d(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, const Conv2dParams& p, bool add_bias) {
  // Autocast as in matmul (Note [autocast]).
  const Tensor x = autocast_input(x_in), w = autocast_input(w_in), b = autocast_input(b_in);
  Tensor y = kernels::conv2d(x, w, add_bias ? b : Tensor(), p);  // [N, K, P, Q]
  if (autograd::any_requires_grad({&x, &w, &b})) {
    const bool nx = needs_grad(x), nw = needs_grad(w), nb = needs_grad(b);
    record("Conv2d", {x, w, b}, {y},
           [nx, nw, nb, p, xs = x.shape(), ws = w.shape(), x = nw || nb ? saved(x) : Tensor(),
            w = nx ? saved(w) : Tensor()](TensorList&& g) -> TensorList {
             const Tensor& dy = g[0];  // in any layout: the kernels:: op picks the memory format
             Tensor gw, gb, gx;
             // The input gradient first where the weight gradient is to wait for it (Note [weight
             // gradients on a second stream]: weight_grad_after_input_grad).
             const bool dx_first = nx && autograd::weight_grad_after_input_grad();
             if (dx_first) gx = kernels::conv2d_backward_input(dy, w, p, xs);
             if (nw || nb) {
               // Into the leaves' zeroed .grad, also through an autocast weight's conversion
               // (Note [gradients written in place]): by the kernels where dtype and layout
               // allow, else copied there from their result.
               const Tensor dw_to = nw ? autograd::weight_grad_destination(1, ws, x.device()) : Tensor();
               const Tensor db_to = nb ? autograd::weight_grad_destination(2, {ws[0]}, x.device()) : Tensor();
               // Beside dx on a second stream when both land in .grad (Note [weight gradients on
               // a second stream] in autograd/grad_stream.h).
               std::optional<autograd::WeightGradStream> side;
               if (autograd::fork_weight_grads(nx, nw, dw_to, nb, db_to)) {
                 // Each output element takes C/groups * R * S products (Note [the side stream's
                 // priority]).
                 side.emplace(x.device(), std::initializer_list<Tensor>{dy, x}, dy.numel() * (ws[1] * ws[2] * ws[3]));
               }
               std::tie(gw, gb) = kernels::conv2d_backward_weight(x, dy, p, ws, nb,
                                                                  autograd::direct_destination(dw_to, x.dtype()),
                                                                  autograd::direct_destination(db_to, x.dtype()));
               gw = autograd::written_into(gw, dw_to);
               gb = autograd::written_into(gb, db_to);
             }
             if (nx && !dx_first) gx = kernels::conv2d_backward_input(dy, w, p, xs);
             return {gx, nw ? gw : Tensor(), gb};
           });
  }
  return y;
}

namespace {

Tensor pool2d(const char* name, PoolMode mode, const Tensor& x, const Pool2dParams& p) {
  Tensor y = kernels::pool2d(mode, x, p);  // [N, C, P, Q]
  if (autograd::any_requires_grad({&x})) {
    record(name, {x}, {y}, [mode, p, x = saved(x), y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::pool2d_backward(mode, x, y, g[0].contiguous(), p)};
    });
  }
  return y;
}

}  // namespace

Tensor max_pool2d(const Tensor& x, const Pool2dParams& p) {
  return pool2d("MaxPool2d", PoolMode::Max, x, p);
}

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p) {
  return pool2d("AvgPool2d", PoolMode::Avg, x, p);
}

Tensor activation_pool2d(const Tensor& z, Activation act, PoolMode mode, const Pool2dParams& p,
                         const Tensor& bias_in) {
  // A constant here (its gradient is the convolution's): detached, in z's dtype.
  const Tensor bias = !bias_in.defined()                ? Tensor()
                      : bias_in.dtype() == z.dtype() ? bias_in.detach()
                                                       : bias_in.detach().to(z.dtype());
  Tensor y = kernels::activation_pool2d(z, act, mode, p, bias);
  if (autograd::any_requires_grad({&z})) {
    const bool max = mode == PoolMode::Max;
    const char* name = act == Activation::Relu      ? (max ? "ReluMaxPool2d" : "ReluAvgPool2d")
                       : act == Activation::Sigmoid ? (max ? "SigmoidMaxPool2d" : "SigmoidAvgPool2d")
                                                    : (max ? "MaxPool2d" : "AvgPool2d");
    record(name, {z}, {y}, [act, mode, p, z = saved(z), y = saved(y), bias](TensorList&& g) -> TensorList {
      return {kernels::activation_pool2d_backward(g[0].contiguous(), z, y, act, mode, p, bias)};
    });
  }
  return y;
}

Tensor log_softmax(const Tensor& x_in) {
  const Tensor x = autocast_float32(x_in);  // float32 under autocast (Note [autocast])
  Tensor y = kernels::log_softmax(x);       // [N, C]
  if (autograd::any_requires_grad({&x})) {
    record("LogSoftmax", {x}, {y}, [y = saved(y)](TensorList&& g) -> TensorList {
      return {kernels::log_softmax_backward(g[0].contiguous(), y)};
    });
  }
  return y;
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& target) {
  const Tensor logits = autocast_float32(logits_in);                 // Note [autocast]
  auto [loss, log_probs] = kernels::cross_entropy(logits, target);  // [], [N, C]
  if (autograd::any_requires_grad({&logits})) {
    // dloss stays a device tensor: the backward never reads it on the host.
    record("CrossEntropy", {logits}, {loss},
           [log_probs = log_probs, target = saved(target)](TensorList&& g) -> TensorList {
             return {kernels::cross_entropy_backward(log_probs, target, g[0])};
           });
  }
  return loss;
}

namespace {

// [1, C, 1, 1] (or [1, C] for 2-D input): a per-channel vector broadcast against x.
Shape channel_shape(const Tensor& x) {
  Shape s(static_cast<size_t>(x.dim()), 1);
  s[1] = x.size(1);
  return s;
}

// Eval mode is the affine map y = (x - mean) * invstd * gamma + beta with fixed statistics,
// x = z + bias for the output z of a conv run without its bias (bias defined; Note [conv bias
// in batch norm] in kernels/cuda/batchnorm.cuh). invstd and mean are snapshotted at forward
// time because the running stats are updated in place by later training steps. The bias
// gradient is the conv's own reduction of the gradient of z, so it is the bits the conv would
// compute.
Tensor batch_norm_eval(const char* name, const Tensor& x, const Tensor& bias, const Tensor& gamma,
                       const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                       double eps) {
  Tensor y = kernels::batch_norm_eval(x, gamma, beta, running_mean, running_var, eps, false, bias);
  if (autograd::any_requires_grad({&x, &bias, &gamma, &beta})) {
    const bool nx = needs_grad(x), nbias = needs_grad(bias), ng = needs_grad(gamma), nb = needs_grad(beta);
    const Shape cs = channel_shape(x);
    Tensor invstd = kernels::unary(
        UnaryOp::Reciprocal,
        kernels::unary(UnaryOp::Sqrt, kernels::scalar(ScalarOp::Add, running_var, eps)));
    Tensor scale = gamma.defined() ? kernels::binary(BinaryOp::Mul, gamma, invstd) : invstd;
    record(name, {x, bias, gamma, beta}, {y},
           [nx, nbias, ng, nb, cs, scale = scale.reshape(cs), invstd = invstd.reshape(cs),
            mean = ng ? running_mean.clone().reshape(cs) : Tensor(), x = ng ? saved(x) : Tensor(),
            bias = ng ? saved(bias) : Tensor()](TensorList&& g) -> TensorList {
             const int64_t c = cs[1];
             Tensor gx = nx || nbias ? kernels::binary(BinaryOp::Mul, g[0], scale) : Tensor();
             Tensor gbias = nbias ? kernels::conv2d_backward_bias(gx) : Tensor();
             Tensor gg, gb;
             if (ng) {
               // x + bias as the forward formed it: the conv's bias add, elementwise in x's dtype.
               const Tensor xb = bias.defined() ? kernels::binary(BinaryOp::Add, x, bias.reshape(cs)) : x;
               Tensor xhat =
                   kernels::binary(BinaryOp::Mul, kernels::binary(BinaryOp::Sub, xb, mean), invstd);
               gg = kernels::sum_to(kernels::binary(BinaryOp::Mul, g[0], xhat), cs).reshape({c});
             }
             if (nb) gb = kernels::sum_to(g[0], cs).reshape({c});
             return {nx ? gx : Tensor(), gbias, gg, gb};
           });
  }
  return y;
}

// Training mode (x = z + bias with a bias, as in eval mode); relu: relu(batch_norm) in the same
// passes (Note [batch norm + ReLU]); with a residual (and relu), relu(batch_norm + residual)
// (Note [batch norm + residual join] in kernels/cuda/batchnorm.cu).
Tensor batch_norm_train(const char* name, const Tensor& x, const Tensor& bias, const Tensor& gamma,
                        const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                        double momentum, double eps, bool relu, const Tensor& residual,
                        const Tensor& num_batches_tracked) {
  auto r = kernels::batch_norm_train(x, gamma, beta, running_mean, running_var, momentum, eps, relu, bias,
                                     residual, num_batches_tracked);
  if (autograd::any_requires_grad({&x, &bias, &gamma, &beta, &residual})) {
    const bool nx = needs_grad(x), nbias = needs_grad(bias), ng = needs_grad(gamma), nb = needs_grad(beta),
               nr = needs_grad(residual);
    // With the ReLU the node keeps its output, whose zeros mask the incoming gradient (as the
    // ReLU node keeps its own). With a bias it keeps z and the bias, never z + bias.
    record(name, {x, bias, gamma, beta, residual}, {r.y},
           [nx, nbias, ng, nb, nr, x = saved(x), bias = saved(bias), gamma = saved(gamma),
            mean = r.save_mean, invstd = r.save_invstd,
            y = relu ? saved(r.y) : Tensor()](TensorList&& g) -> TensorList {
             // The join's backward as AddRelu's: the masked gradient, which is both the batch
             // norm's output gradient and the residual's; the batch norm's backward masks it as it
             // reads it, and writes it out for the residual (kernels::batch_norm_backward's
             // masked_dy).
             // gamma's and beta's gradients straight into their zeroed .grad where they can
             // (Note [gradients written in place]).
             const Shape cs{x.size(1)};
             const Tensor dg_to = ng ? autograd::grad_destination(2, cs, mean.dtype(), x.device()) : Tensor();
             const Tensor db_to = nb ? autograd::grad_destination(3, cs, mean.dtype(), x.device()) : Tensor();
             // The conv bias's gradient into its leaf's .grad as well, also through an autocast
             // copy's conversion: written there by the kernels where that .grad is x's dtype or
             // the per-channel one (Note [the conv bias's gradient in float32] in
             // kernels/cuda/batchnorm_backward.cu), else copied there from their result.
             const Tensor dbias_to = nbias ? autograd::weight_grad_destination(1, cs, x.device()) : Tensor();
             const bool dbias_direct = dbias_to.defined() && dbias_to.is_contiguous() &&
                                       (dbias_to.dtype() == x.dtype() || dbias_to.dtype() == mean.dtype());
             // A second gradient of the output (a block's output feeds the next block's convolution
             // and its shortcut) is added as the first pass reads dy (Note [gradient parts]).
             auto d = kernels::batch_norm_backward(g[0], x, gamma, mean, invstd, y, bias, nbias, dg_to, db_to, nr,
                                                   autograd::take_gradient_part(0),
                                                   dbias_direct ? dbias_to : Tensor());
             return {nx ? d.dx : Tensor(), autograd::written_into(d.dbias, dbias_to), ng ? d.dgamma : Tensor(),
                     nb ? d.dbeta : Tensor(), nr ? d.masked_dy : Tensor()};
           });
    autograd::meta(r.y).grad_fn->sums_gradient_parts = true;
  }
  return r.y;
}

void check_bn_input(const char* op, const Tensor& x) {
  TANDEM_CHECK(x.defined() && (x.dim() == 2 || x.dim() == 4), Shape, op,
               ": expected [N, C] or [N, C, H, W] input, got ",
               x.defined() ? x.str() : std::string("an undefined tensor"));
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum, double eps, const Tensor& num_batches_tracked) {
  check_bn_input("batch_norm", x);
  if (!training) {
    return batch_norm_eval("BatchNormEval", x, Tensor(), gamma, beta, running_mean, running_var, eps);
  }
  return batch_norm_train("BatchNorm", x, Tensor(), gamma, beta, running_mean, running_var, momentum, eps,
                          false, Tensor(), num_batches_tracked);
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, bool training,
                       double momentum, double eps, const Tensor& num_batches_tracked) {
  check_bn_input("batch_norm_relu", x);
  if (!training) {
    return relu(batch_norm_eval("BatchNormEval", x, Tensor(), gamma, beta, running_mean, running_var, eps));
  }
  return batch_norm_train("BatchNormRelu", x, Tensor(), gamma, beta, running_mean, running_var, momentum, eps,
                          true, Tensor(), num_batches_tracked);
}

Tensor batch_norm_bias(const Tensor& x, const Tensor& bias_in, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, bool training, double momentum,
                       double eps, bool relu, const Tensor& num_batches_tracked) {
  TANDEM_CHECK(x.defined() && x.dim() == 4, Shape, "batch_norm_bias: expected the [N, C, H, W] output of a ",
               "convolution, got ", x.defined() ? x.str() : std::string("an undefined tensor"));
  TANDEM_CHECK(bias_in.defined(), Value, "batch_norm_bias: the bias is undefined (use batch_norm)");
  const Tensor bias = autocast_input(bias_in);  // cast as conv2d casts it (Note [autocast])
  if (!training) {
    Tensor y = batch_norm_eval("BatchNormBiasEval", x, bias, gamma, beta, running_mean, running_var, eps);
    return relu ? tandem::relu(y) : y;
  }
  return batch_norm_train(relu ? "BatchNormBiasRelu" : "BatchNormBias", x, bias, gamma, beta, running_mean,
                          running_var, momentum, eps, relu, Tensor(), num_batches_tracked);
}

Tensor batch_norm_add_relu(const Tensor& x, const Tensor& residual, const Tensor& gamma, const Tensor& beta,
                           const Tensor& running_mean, const Tensor& running_var, bool training,
                           double momentum, double eps, const Tensor& bias_in,
                           const Tensor& num_batches_tracked) {
  check_bn_input("batch_norm_add_relu", x);
  TANDEM_CHECK(residual.defined(), Value, "batch_norm_add_relu: the residual is undefined (use batch_norm_relu)");
  TANDEM_CHECK(!bias_in.defined() || x.dim() == 4, Shape, "batch_norm_add_relu: a conv bias needs the ",
               "[N, C, H, W] output of a convolution, got ", x.str());
  const Tensor bias = autocast_input(bias_in);  // cast as conv2d casts it (Note [autocast])
  const bool biased = bias.defined();
  if (!training) {
    return add_relu(batch_norm_eval(biased ? "BatchNormBiasEval" : "BatchNormEval", x, bias, gamma, beta,
                                    running_mean, running_var, eps),
                    residual);
  }
  return batch_norm_train(biased ? "BatchNormBiasAddRelu" : "BatchNormAddRelu", x, bias, gamma, beta,
                          running_mean, running_var, momentum, eps, true, residual, num_batches_tracked);
}

}  // namespace tandem
