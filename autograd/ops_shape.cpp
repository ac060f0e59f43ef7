// Differentiable shape ops: views (reshape, transpose, slice), gathers (index_select, cat),
// the device copy and the dtype conversion.
#include <algorithm>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"

namespace tandem {

using autograd::fresh_alias;
using autograd::needs_grad;
using autograd::record;
using autograd::saved;
using autograd::TensorList;

Tensor reshape(const Tensor& x, const Shape& shape) {
  Tensor y = fresh_alias(x.reshape(shape), x);
  if (autograd::any_requires_grad({&x})) {
    record("Reshape", {x}, {y},
           [xs = x.shape()](TensorList&& g) -> TensorList { return {g[0].reshape(xs)}; });
  }
  return y;
}

Tensor flatten(const Tensor& x, int64_t start_dim) {
  const int64_t n = x.dim();
  const int64_t start = start_dim < 0 ? start_dim + n : start_dim;
  TANDEM_CHECK(start >= 0 && start <= std::max<int64_t>(n - 1, 0), Shape, "flatten: start_dim ",
               start_dim, " out of range for ", x.str());
  Shape shape(x.shape().begin(), x.shape().begin() + std::min(start, n));
  int64_t rest = 1;
  for (int64_t i = start; i < n; ++i) rest *= x.size(i);
  shape.push_back(rest);
  return reshape(x, shape);
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  Tensor y = fresh_alias(x.transpose(d0, d1), x);
  if (autograd::any_requires_grad({&x})) {
    record("Transpose", {x}, {y},
           [d0, d1](TensorList&& g) -> TensorList { return {g[0].transpose(d0, d1)}; });
  }
  return y;
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end) {
  Tensor y = fresh_alias(x.slice(dim, start, end), x);
  if (autograd::any_requires_grad({&x})) {
    record("Slice", {x}, {y}, [xs = x.shape(), dim, start, end](TensorList&& g) -> TensorList {
      Tensor gx = zeros(xs, g[0].dtype(), g[0].device());
      gx.slice(dim, start, end).copy_(g[0]);  // same normalization as the forward
      return {gx};
    });
  }
  return y;
}

Tensor index_select(const Tensor& x, const Tensor& index) {
  Tensor y = kernels::index_select(x, index);
  if (autograd::any_requires_grad({&x})) {
    record("IndexSelect", {x}, {y},
           [xs = x.shape(), index = saved(index)](TensorList&& g) -> TensorList {
             return {kernels::index_add(g[0].contiguous(), index, xs)};
           });
  }
  return y;
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  TANDEM_CHECK(!xs.empty(), Value, "cat: empty list");
  const Tensor& first = xs[0];
  TANDEM_CHECK(first.defined(), Value, "cat: undefined tensor 0");
  const int64_t n = first.dim();
  const int64_t d = dim < 0 ? dim + n : dim;
  TANDEM_CHECK(d >= 0 && d < n, Shape, "cat: dim ", dim, " out of range for ", first.str());
  Shape out_shape = first.shape();
  out_shape[static_cast<size_t>(d)] = 0;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    TANDEM_CHECK(x.defined(), Value, "cat: undefined tensor ", i);
    TANDEM_CHECK(x.dtype() == first.dtype(), DType, "cat: tensor ", i, " is ", x.str(),
                 ", tensor 0 is ", first.str());
    TANDEM_CHECK(x.device() == first.device(), Device, "cat: tensor ", i, " is ", x.str(),
                 ", tensor 0 is ", first.str());
    bool compatible = x.dim() == n;
    for (int64_t j = 0; compatible && j < n; ++j) {
      compatible = j == d || x.size(j) == first.size(j);
    }
    TANDEM_CHECK(compatible, Shape, "cat: along dim ", d, ": tensor ", i, " ", shape_str(x.shape()),
                 " does not match tensor 0 ", shape_str(first.shape()));
    sizes.push_back(x.size(d));
    out_shape[static_cast<size_t>(d)] += x.size(d);
  }
  Tensor y = empty(out_shape, first.dtype(), first.device());
  int64_t offset = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    y.slice(d, offset, offset + sizes[i]).copy_(xs[i]);
    offset += sizes[i];
  }
  std::vector<bool> need;
  bool any = false;
  for (const Tensor& x : xs) {
    need.push_back(needs_grad(x));
    any = any || need.back();
  }
  if (any && grad_enabled()) {
    record("Cat", xs, {y}, [d, sizes, need](TensorList&& g) -> TensorList {
      TensorList gx(sizes.size());
      int64_t start = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (need[i]) gx[i] = g[0].slice(d, start, start + sizes[i]);
        start += sizes[i];
      }
      return gx;
    });
  }
  return y;
}

namespace {

// The dtype conversion's node from x to y, y holding x's values in another dtype.
Tensor record_conversion(const Tensor& x, const Tensor& y) {
  if (is_floating(y.dtype()) && autograd::any_requires_grad({&x})) {
    auto node = std::make_shared<autograd::FunctionNode>("ToCopy", [src = x.dtype(), xs = x.shape()](TensorList&& g) -> TensorList {
      // Already cast into the leaf's .grad by the layer that used the copy (Note [gradients
      // written in place], weight_grad_destination): passed on as it is.
      if (autograd::is_lent_grad(0, g[0])) return {g[0]};
      // An autocast weight's gradient is cast straight into its zeroed .grad: one pass instead
      // of the cast and then the add, in whatever dense layout .grad has (a channels-last
      // weight's is channels-last; copy_ follows strides).
      if (Tensor to = autograd::grad_destination(0, xs, src, g[0].device(), /*any_dense=*/true); to.defined()) {
        to.copy_(g[0]);
        return {to};
      }
      return {g[0].to(src)};
    });
    node->dtype_conversion = true;
    autograd::record(std::move(node), {x}, {y});
  }
  return y;
}

}  // namespace

Tensor to(const Tensor& x, DType dtype) {
  return record_conversion(x, fresh_alias(x.to(dtype), x));
}

Tensor to_converted(const Tensor& x, const Tensor& converted) {
  TANDEM_CHECK(x.defined() && converted.defined() && converted.shape() == x.shape(), Shape,
               "to_converted: the conversion ", converted.defined() ? converted.str() : std::string("(undefined)"),
               " is not of ", x.defined() ? x.str() : std::string("an undefined tensor"));
  return record_conversion(x, converted.detach());
}

Tensor to_device(const Tensor& x, Device device) {
  Tensor y = fresh_alias(x.to(device), x);
  if (autograd::any_requires_grad({&x})) {
    record("ToDevice", {x}, {y},
           [src = x.device()](TensorList&& g) -> TensorList { return {g[0].to(src)}; });
  }
  return y;
}

}  // namespace tandem
