#pragma once
// Differentiable operations. Each computes its result with kernels/ops.h and, when grad mode
// is on and an input requires grad, records a Node whose backward captures only what it needs.
// Backward functions are built from kernels:: ops (which record nothing): gradients of
// gradients (double backward) are not supported.
#include <vector>

#include "core/tensor.h"
#include "kernels/backend.h"

namespace tandem {

// ---- elementwise (broadcasting) ------------------------------------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor pow(const Tensor& a, double exponent);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// relu(a + b) in one kernel (a residual join), the same values bit for bit; broadcasts as add.
Tensor add_relu(const Tensor& a, const Tensor& b);
Tensor tanh(const Tensor& x);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& x);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator*(double s, const Tensor& a);

// ---- comparisons (autograd/ops_compare.cpp) ----------------------------------------------
// PyTorch's eq, ne, lt, le, gt, ge and their operators: 1 where the comparison holds, else 0,
// as a uint8 tensor (tandem has no bool dtype; to(kInt64) / to(kFloat32) convert it, sum()
// counts it in int64). Tensor with tensor broadcasts; operands of different dtypes are
// compared in the wider one (a floating dtype over an integer one, float64 over float32,
// int64 over uint8); a scalar is compared in the tensor's dtype, or in float64 when the tensor
// is an integer one and the scalar is not an integer. A NaN compares false, except under ne.
// Built from the elementwise kernels eq, maximum and sub (ge(a, b) = eq(maximum(a, b), a)),
// so every backend has them. They record no history.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, double s);
Tensor ne(const Tensor& a, double s);
Tensor lt(const Tensor& a, double s);
Tensor le(const Tensor& a, double s);
Tensor gt(const Tensor& a, double s);
Tensor ge(const Tensor& a, double s);
Tensor operator==(const Tensor& a, const Tensor& b);
Tensor operator!=(const Tensor& a, const Tensor& b);
Tensor operator<(const Tensor& a, const Tensor& b);
Tensor operator<=(const Tensor& a, const Tensor& b);
Tensor operator>(const Tensor& a, const Tensor& b);
Tensor operator>=(const Tensor& a, const Tensor& b);
Tensor operator==(const Tensor& a, double s);
Tensor operator!=(const Tensor& a, double s);
Tensor operator<(const Tensor& a, double s);
Tensor operator<=(const Tensor& a, double s);
Tensor operator>(const Tensor& a, double s);
Tensor operator>=(const Tensor& a, double s);
Tensor operator==(double s, const Tensor& a);
Tensor operator!=(double s, const Tensor& a);
Tensor operator<(double s, const Tensor& a);
Tensor operator<=(double s, const Tensor& a);
Tensor operator>(double s, const Tensor& a);
Tensor operator>=(double s, const Tensor& a);

// ---- reductions ------------------------------------------------------------------------
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Gradient goes to the first maximum of each reduced slice.
Tensor max(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// ---- shape ---------------------------------------------------------------------------
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor flatten(const Tensor& x, int64_t start_dim = 1);  // [N, ...] -> [N, prod(...)]
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end);
Tensor index_select(const Tensor& x, const Tensor& index);  // dim 0
Tensor cat(const std::vector<Tensor>& xs, int64_t dim = 0);
// Differentiable copy to another device (gradient flows back to the source device).
Tensor to_device(const Tensor& x, Device d);
// Differentiable dtype conversion (torch's x.to(dtype)): the gradient is cast back to x's
// dtype, so a float32 leaf used through a bfloat16 copy gets a float32 .grad. A conversion to
// an integer dtype records nothing (its result cannot require grad), as in PyTorch.
Tensor to(const Tensor& x, DType dtype);
// The same node for a conversion of x made elsewhere: `converted` holds x's values in another
// floating dtype (an autocast weight copy, Note [autocast weight copies] in
// autograd/autocast.h). Returns a fresh alias of it whose gradient is cast back into x's; no
// kernel runs. ShapeError unless the shapes match.
Tensor to_converted(const Tensor& x, const Tensor& converted);

// ---- neural network ops ------------------------------------------------------------------
Tensor matmul(const Tensor& a, const Tensor& b);  // 2-D
// y = x @ w^T + b, x [N, in], w [out, in], b [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b);
// act(linear(x, w, b)) as one op (Note [linear + activation] in kernels/backend.h): the values
// and gradients of linear followed by relu or sigmoid, without the activation's own passes.
// What a Sequential runs for a Linear followed by a ReLU or a Sigmoid when
// fuse_linear_activation() is on.
Tensor linear_activation(const Tensor& x, const Tensor& w, const Tensor& b, Activation act);
// With add_bias false the output leaves b out, z = conv(x, w), for an op after it that adds b
// itself (Note [conv bias in activation + pooling] in kernels/ops.h); the gradients, b's
// included, are those of conv2d with the bias: the gradient of z + b is the gradient of z.
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p = {}, bool add_bias = true);
Tensor max_pool2d(const Tensor& x, const Pool2dParams& p);
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p);
// max_pool2d / avg_pool2d (mode) of relu(z) or sigmoid(z) as one op (Note [activation +
// pooling] in kernels/backend.h): the same values and gradients, the activation never stored
// (z is saved instead). What a Sequential runs for a ReLU or a Sigmoid followed by a pooling
// module when fuse_activation_pool() is on. bias, where defined, is added to z first, as a
// constant: the bias of a conv2d with add_bias false, whose backward gives its gradient (Note
// [conv bias in activation + pooling] in kernels/ops.h); cast to z's dtype where it differs.
Tensor activation_pool2d(const Tensor& z, Activation act, PoolMode mode, const Pool2dParams& p,
                         const Tensor& bias = Tensor());
Tensor log_softmax(const Tensor& x);  // over dim 1 of [N, C]
// PyTorch's softmax(x, dim) / log_softmax(x, dim) for any dim of a tensor of 1 or more dims
// (autograd/ops_compare.cpp): dim is moved last and the rows go through the log-softmax
// kernel; softmax is exp(log_softmax). Differentiable.
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor softmax(const Tensor& x, int64_t dim);
// Mean cross-entropy of logits [N, C] against int64 targets [N]; fused log-softmax.
Tensor cross_entropy(const Tensor& logits, const Tensor& target);
// Training-mode batch norm (updates running stats in place) or eval-mode (uses them).
// num_batches_tracked (an int64 with one element on x's device, as BatchNorm2d's buffer; undefined:
// none): in training, 1 is added to it where the running statistics are updated (on the GPU by
// the same kernel: no launch of its own). The same argument in the fused forms below.
Tensor batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum, double eps, const Tensor& num_batches_tracked = Tensor());
// relu(batch_norm(...)), the same values and gradients; in training, one forward pass and one
// backward pass fewer (Note [batch norm + ReLU] in kernels/backend.h). Eval mode composes
// the two ops.
Tensor batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, bool training,
                       double momentum, double eps, const Tensor& num_batches_tracked = Tensor());
// batch_norm(x + bias), or batch_norm_relu(x + bias) when relu, for x [N, C, H, W] the output
// of a convolution run without its bias and bias [C] that bias, without storing x + bias: the
// same values, running statistics and gradients, bit for bit, as conv2d with the bias followed
// by batch_norm or batch_norm_relu (Note [conv bias in batch norm] in kernels/cuda/batchnorm.cuh,
// which also names the layers whose conv sums its bias gradient otherwise). Under autocast the
// bias is cast as conv2d casts it. Gradients reach x, bias, gamma and beta. Training: one op
// (node "BatchNormBias" or "BatchNormBiasRelu"); eval: "BatchNormBiasEval", then the ReLU op.
Tensor batch_norm_bias(const Tensor& x, const Tensor& bias, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, bool training,
                       double momentum, double eps, bool relu = false,
                       const Tensor& num_batches_tracked = Tensor());
// relu(batch_norm(x) + residual) -- the join at the end of a ResNet block -- for residual of x's
// shape, dtype and device; with bias [C], of x + bias as batch_norm_bias takes it. The same values,
// running statistics and gradients, bit for bit, as batch_norm (or batch_norm_bias) followed by
// add_relu; in training the join is done by batch norm's apply pass, without writing the batch
// norm's output (Note [batch norm + residual join] in kernels/cuda/batchnorm.cu). Gradients reach
// x, residual, gamma, beta (and bias). Training: one op (node "BatchNormAddRelu" or
// "BatchNormBiasAddRelu"); eval: the batch norm, then add_relu.
Tensor batch_norm_add_relu(const Tensor& x, const Tensor& residual, const Tensor& gamma, const Tensor& beta,
                           const Tensor& running_mean, const Tensor& running_var, bool training,
                           double momentum, double eps, const Tensor& bias = Tensor(),
                           const Tensor& num_batches_tracked = Tensor());

}  // namespace tandem
