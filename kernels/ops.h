#pragma once
// Checked, allocating, non-differentiable operations: the single dispatch point between a
// Tensor and a Backend. Each function validates shapes, dtypes and devices (throwing an error
// that names them), allocates its outputs on the inputs' device, and calls
// backend_for(device). Autograd (autograd/ops.h) is built on these; so are optimizers and
// data loading, which must not record history.
#include <utility>
#include <vector>

#include "kernels/backend.h"

namespace tandem::kernels {

// Broadcast two shapes (numpy rules); throws ShapeError naming both.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op = "broadcast");
// Checks that all tensors are defined and on the same device; `op` names the caller.
void check_same_device(const char* op, std::initializer_list<const Tensor*> ts);
void check_same_dtype(const char* op, std::initializer_list<const Tensor*> ts);
// An op's output of `shape` in like's dtype, on its device: `into` where defined (it must be a
// packed tensor of that shape, dtype and device: ShapeError, DTypeError or DeviceError naming
// `name` otherwise), else a new tensor.
Tensor output_into(const char* op, const Tensor& into, const Shape& shape, const Tensor& like,
                   const char* name);

Tensor unary(UnaryOp op, const Tensor& x);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);  // broadcasting
void binary_(BinaryOp op, const Tensor& a, const Tensor& b);  // a = op(a, b), b broadcast to a
Tensor scalar(ScalarOp op, const Tensor& x, double s);
// out = alpha * x + beta * out, in place (same shape).
void axpby_(double alpha, const Tensor& x, double beta, const Tensor& out);

// Reductions over `dims` (empty = all dims). Negative dims count from the end.
Tensor reduce(ReduceOp op, const Tensor& x, const std::vector<int64_t>& dims, bool keepdim = false);
inline Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::Sum, x, dims, keepdim);
}
inline Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::Mean, x, dims, keepdim);
}
inline Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::Max, x, dims, keepdim);
}
// Sums x down to `shape` (the inverse of broadcasting `shape` up to x.shape()).
Tensor sum_to(const Tensor& x, const Shape& shape);
// Index of the maximum along dim (int64, dim removed).
Tensor argmax(const Tensor& x, int64_t dim);

// 2-D matrix product: op(a) @ op(b).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// act(x [M, K] @ w [N, K]^T + bias [N]) (bias undefined: none): a linear layer with its
// activation (Note [linear + activation] in kernels/backend.h), one fused kernel where the
// backend has one, else the product, the bias add and the activation in turn.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias, Activation act = Activation::None);
struct LinearGrads {
  Tensor dx, dw, db;  // undefined when not asked for
};
// The gradients of linear from the output y (unused for Activation::None) and its gradient
// dy, for a layer of in_features inputs (x's size(1)): dx needs w, dw needs x. dw_into and
// db_into, where defined (and asked for), are where dw and db are written (packed tensors of
// their shape, dtype and device; ShapeError otherwise) and are what the result holds.
LinearGrads linear_backward(const Tensor& dy, const Tensor& y, const Tensor& x, const Tensor& w,
                            Activation act, int64_t in_features, bool need_dx, bool need_dw,
                            bool need_db, const Tensor& dw_into = Tensor(), const Tensor& db_into = Tensor());

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p);
Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                             const Shape& x_shape);
// Returns {dw, db}; db undefined when with_bias is false. dw_into and db_into, where defined,
// are packed (NCHW) tensors of their shape, dtype and device that the gradients are written
// into when the kernels work in that layout (dw_into is then the dw returned; db_into always is
// the db returned); ShapeError for another shape. A channels-last convolution writes dw_into
// too where its filter has one input channel or is 1x1 (the two layouts are then the same
// memory). For bfloat16 x and dy, dw_into and db_into may be float32 (an autocast weight's
// .grad): the sums are then rounded to float32 where the kernels allow it (kernels/backend.h).
std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& x, const Tensor& dy,
                                                 const Conv2dParams& p, const Shape& w_shape,
                                                 bool with_bias, const Tensor& dw_into = Tensor(),
                                                 const Tensor& db_into = Tensor());
// db [K] of dy [N, K, P, Q] alone: the bias gradient conv2d_backward_weight returns.
Tensor conv2d_backward_bias(const Tensor& dy);

Tensor pool2d(PoolMode mode, const Tensor& x, const Pool2dParams& p);
Tensor pool2d_backward(PoolMode mode, const Tensor& x, const Tensor& y, const Tensor& dy,
                       const Pool2dParams& p);

// pool(act(z)) as one op (Note [activation + pooling] in kernels/backend.h), and its backward
// from the pooled output y and its gradient dy: dz.
//
// Note [conv bias in activation + pooling]: in LeNet a convolution's output goes to nothing but
// an activation and a pooling. Where the convolution runs in cuDNN its bias is a pass of its
// own over the output (one more node of a replayed step, ~2 us); so the convolution can leave
// the bias out and these ops add it as they read z: pool(act(z + bias[c])) and, backward, dz
// with a = act(z + bias[c]) -- the same adds in z's dtype, the same bits. bias ([C], z's dtype
// and device: DTypeError, ShapeError or DeviceError naming it otherwise) is a constant here:
// its gradient is the sum of dz, which the convolution's backward computes as before
// (autograd::conv2d with add_bias false; nn::Sequential pairs them, fuse_conv_bias()).
Tensor activation_pool2d(const Tensor& z, Activation act, PoolMode mode, const Pool2dParams& p,
                         const Tensor& bias = Tensor());
Tensor activation_pool2d_backward(const Tensor& dy, const Tensor& z, const Tensor& y, Activation act,
                                  PoolMode mode, const Pool2dParams& p, const Tensor& bias = Tensor());

Tensor log_softmax(const Tensor& x);  // over the last dim of a 2-D tensor
Tensor log_softmax_backward(const Tensor& dy, const Tensor& y);
// Returns {loss [] , log_probs [N, C]}.
std::pair<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target);
Tensor cross_entropy_backward(const Tensor& log_probs, const Tensor& target, const Tensor& dloss);
// correct (int64 [1]) += rows whose argmax equals the target. No host sync.
void count_correct(const Tensor& logits, const Tensor& target, const Tensor& correct);

// Rows index[i] of x (along dim 0); into, where defined, is where they are written (a packed
// tensor of the result's shape, dtype and device: output_into's errors otherwise).
Tensor index_select(const Tensor& x, const Tensor& index, const Tensor& into = Tensor());
// Zeros of shape `shape` with rows index[i] += src[i].
Tensor index_add(const Tensor& src, const Tensor& index, const Shape& shape);
// out's rows index[i] += src[i], in place (PyTorch's out.index_add_(0, index, src)); out packed.
void index_add_(const Tensor& out, const Tensor& index, const Tensor& src);

struct BatchNormResult {
  Tensor y, save_mean, save_invstd;
};
// relu: y = relu(batch_norm(x)) in one pass (Note [batch norm + ReLU] in kernels/backend.h).
// bias [C] (x's dtype and device; undefined: none): x is a convolution's output without its
// bias, normalized as x + bias without storing that (Note [conv bias in batch norm] in
// kernels/cuda/batchnorm.cuh).
// residual (x's shape, dtype and device; undefined: none; relu must be on): y = relu(batch_norm(x) +
// residual) in the same pass (Note [batch norm + residual join] in kernels/cuda/batchnorm.cu).
// num_batches_tracked (an int64 [] or [1] on x's device; undefined: none): 1 is added to it where
// the running statistics are updated, on the GPU by the same kernel (Note [the batch count in
// the statistics' finish] in kernels/cuda/batchnorm.cu).
BatchNormResult batch_norm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 const Tensor& running_mean, const Tensor& running_var,
                                 double momentum, double eps, bool relu = false,
                                 const Tensor& bias = Tensor(), const Tensor& residual = Tensor(),
                                 const Tensor& num_batches_tracked = Tensor());
Tensor batch_norm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, double eps, bool relu = false,
                       const Tensor& bias = Tensor());
struct BatchNormGrads {
  Tensor dx, dgamma, dbeta;
  Tensor dbias;      // [C] in x's dtype (or dbias_into) when asked for (with_dbias), else undefined
  Tensor masked_dy;  // dy masked by relu_out, x's shape and dtype, when asked for (with_masked_dy)
};
// relu_out: the fused forward's output, whose zeros mask dy (undefined: no ReLU). bias: the
// forward's; with_dbias: also dbias = the per-channel sum of dx, bit for bit
// conv2d_backward_bias(dx). dgamma_into, dbeta_into: packed [C] tensors of save_mean's dtype
// and device to write dgamma and dbeta into (Note [gradients written in place]); undefined:
// fresh ones. with_masked_dy (relu_out defined): also masked_dy = dy masked by relu_out, bit for
// bit the ReluBackward op's, without a pass of its own on CUDA (the gradient of a residual joined
// before the ReLU: Note [batch norm + residual join] in kernels/cuda/batchnorm.cu). dy_part
// (dy's shape, dtype and device; undefined: none): the backward of dy + dy_part, the two added
// as they are read where the kernels can (Note [gradient parts] in autograd/node.h).
// dbias_into (with_dbias): a packed [C] tensor on x's device to write dbias into, of x's dtype or
// of save_mean's (float32 for a bfloat16 x: each sum rounded to bfloat16, then stored as float32;
// Note [the conv bias's gradient in float32] in kernels/cuda/batchnorm_backward.cu).
BatchNormGrads batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                   const Tensor& save_mean, const Tensor& save_invstd,
                                   const Tensor& relu_out = Tensor(), const Tensor& bias = Tensor(),
                                   bool with_dbias = false, const Tensor& dgamma_into = Tensor(),
                                   const Tensor& dbeta_into = Tensor(), bool with_masked_dy = false,
                                   const Tensor& dy_part = Tensor(), const Tensor& dbias_into = Tensor());

// In-place optimizer updates (backend.h). The device-resident inputs of a capturable step,
// SgdParams::lr_tensor and AdamParams::consts, are checked like the tensors: dtype, size and
// device, named in the error; so is the copy the update writes, SgdParams::copy_into and
// AdamParams::copy_into (DTypeError, ShapeError, DeviceError).
void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
              const SgdParams& p);
void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               const AdamParams& p);
// step (float32 []) += 1 and consts (float64 [3]) from it, lr (float64 []) and p's betas and
// weight decay: the first kernel of a capturable Adam step (Backend::adam_advance_step). No
// host synchronization.
void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                       const AdamParams& p);

}  // namespace tandem::kernels
