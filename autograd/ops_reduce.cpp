// Differentiable reductions: sum, mean, max.
#include "autograd/function.h"
#include "autograd/ops.h"

namespace tandem {

namespace autograd {

std::vector<bool> reduced_dims_mask(const char* op, int64_t ndim,
                                    const std::vector<int64_t>& dims) {
  std::vector<bool> mask(static_cast<size_t>(ndim), dims.empty());
  for (int64_t d : dims) {
    const int64_t nd = d < 0 ? d + ndim : d;
    TANDEM_CHECK(nd >= 0 && nd < ndim, Shape, op, ": dim ", d, " out of range for a ", ndim,
                 "-d tensor");
    mask[static_cast<size_t>(nd)] = true;
  }
  return mask;
}

}  // namespace autograd

using autograd::record;
using autograd::saved;
using autograd::TensorList;

namespace {

// x's shape with the reduced dims set to 1: the shape of a keepdim result.
Shape keepdim_shape(const Shape& x_shape, const std::vector<bool>& mask) {
  Shape s = x_shape;
  for (size_t i = 0; i < s.size(); ++i) {
    if (mask[i]) s[i] = 1;
  }
  return s;
}

// The gradient of a sum: g (with or without the reduced dims) broadcast back to x's shape.
// An expanded view: nothing is materialized until a consumer needs it.
Tensor expand_back(const Tensor& g, const Shape& keep_shape, const Shape& x_shape) {
  return g.reshape(keep_shape).expand(x_shape);
}

}  // namespace

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = kernels::sum(x, dims, keepdim);
  if (autograd::any_requires_grad({&x})) {
    const auto mask = autograd::reduced_dims_mask("sum", x.dim(), dims);
    record("Sum", {x}, {y},
           [ks = keepdim_shape(x.shape(), mask), xs = x.shape()](TensorList&& g) -> TensorList {
             return {expand_back(g[0], ks, xs)};
           });
  }
  return y;
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = kernels::mean(x, dims, keepdim);
  if (autograd::any_requires_grad({&x})) {
    const auto mask = autograd::reduced_dims_mask("mean", x.dim(), dims);
    const Shape ks = keepdim_shape(x.shape(), mask);
    const double count = static_cast<double>(x.numel()) / static_cast<double>(shape_numel(ks));
    record("Mean", {x}, {y}, [ks, xs = x.shape(), count](TensorList&& g) -> TensorList {
      // Scale the small tensor, then broadcast.
      return {expand_back(kernels::scalar(ScalarOp::Mul, g[0], 1.0 / count), ks, xs)};
    });
  }
  return y;
}

// Note [max backward]
// The gradient goes to the first maximum of each reduced slice (as argmax picks it), so
// ties never split or duplicate it. The reduced dims are permuted to the end and flattened,
// x becomes [R, C], argmax gives one column per row, and a one-hot mask built by comparing
// that column with arange(C) routes g there. Comparing in x's dtype is exact for C < 2^24
// in float32. The indices are never read on the host; arange(C) is a small host-to-device
// upload (no synchronization), the one host step, acceptable for an op that training loops
// rarely differentiate (pooling has its own fused backward).
Tensor max(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  Tensor y = kernels::max(x, dims, keepdim);
  if (autograd::any_requires_grad({&x})) {
    const auto mask = autograd::reduced_dims_mask("max", x.dim(), dims);
    std::vector<int64_t> perm;  // kept dims in order, then reduced dims in order
    for (size_t i = 0; i < mask.size(); ++i) {
      if (!mask[i]) perm.push_back(static_cast<int64_t>(i));
    }
    for (size_t i = 0; i < mask.size(); ++i) {
      if (mask[i]) perm.push_back(static_cast<int64_t>(i));
    }
    record("Max", {x}, {y}, [x = saved(x), perm](TensorList&& g) -> TensorList {
      const int64_t n = x.dim();
      std::vector<int64_t> inverse(static_cast<size_t>(n));
      Shape permuted(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        inverse[static_cast<size_t>(perm[i])] = i;
        permuted[static_cast<size_t>(i)] = x.shape()[static_cast<size_t>(perm[i])];
      }
      const int64_t rows = g[0].numel();
      const int64_t cols = rows == 0 ? 0 : x.numel() / rows;
      Tensor x2 = x.permute(perm).reshape({rows, cols});                          // [R, C]
      Tensor first = kernels::argmax(x2, 1).to(x.dtype()).reshape({rows, 1});     // [R, 1]
      Tensor col = arange(0, cols, 1, x.dtype(), x.device()).reshape({1, cols});  // [1, C]
      Tensor onehot = kernels::binary(BinaryOp::Eq, first, col);                  // [R, C]
      Tensor gx = kernels::binary(BinaryOp::Mul, onehot, g[0].reshape({rows, 1}));
      return {gx.reshape(permuted).permute(inverse)};
    });
  }
  return y;
}

}  // namespace tandem
