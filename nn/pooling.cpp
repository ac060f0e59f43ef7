#include "nn/pooling.h"

#include "autograd/ops.h"
#include "core/error.h"

namespace tandem::nn {

namespace {

Pool2dParams make_params(const char* op, int64_t kernel, int64_t stride, int64_t padding) {
  if (stride == 0) stride = kernel;
  TANDEM_CHECK(kernel > 0 && stride > 0 && padding >= 0 && 2 * padding <= kernel, Value, op,
               ": invalid kernel_size=", kernel, " stride=", stride, " padding=", padding);
  Pool2dParams p;
  p.kernel_h = p.kernel_w = kernel;
  p.stride_h = p.stride_w = stride;
  p.pad_h = p.pad_w = padding;
  return p;
}

void check_input(const char* op, const Tensor& x, const Pool2dParams& p) {
  TANDEM_CHECK(x.dim() == 4, Shape, op, ": input ", shape_str(x.shape()), " is not [N, C, H, W]");
  TANDEM_CHECK(x.size(2) + 2 * p.pad_h >= p.kernel_h && x.size(3) + 2 * p.pad_w >= p.kernel_w,
               Shape, op, ": input ", shape_str(x.shape()), " is smaller than the ", p.kernel_h,
               "x", p.kernel_w, " window");
}

std::string repr(const Pool2dParams& p) {
  return detail::str("kernel_size=", p.kernel_h, ", stride=", p.stride_h, ", padding=", p.pad_h);
}

}  // namespace

AvgPool2d::AvgPool2d(int64_t kernel_size, int64_t stride, int64_t padding)
    : p_(make_params("AvgPool2d", kernel_size, stride, padding)) {}

std::string AvgPool2d::extra_repr() const {
  return repr(p_);
}

Tensor AvgPool2d::forward_impl(const Tensor& x) {
  check_input("AvgPool2d", x, p_);
  return avg_pool2d(x, p_);
}

Tensor AvgPool2d::forward_activation(const Tensor& z, Activation act, const Tensor& conv_bias) {
  check_forward_input(z);  // as forward()
  check_input("AvgPool2d", z, p_);
  return activation_pool2d(z, act, PoolMode::Avg, p_, conv_bias);
}

MaxPool2d::MaxPool2d(int64_t kernel_size, int64_t stride, int64_t padding)
    : p_(make_params("MaxPool2d", kernel_size, stride, padding)) {}

std::string MaxPool2d::extra_repr() const {
  return repr(p_);
}

Tensor MaxPool2d::forward_impl(const Tensor& x) {
  check_input("MaxPool2d", x, p_);
  return max_pool2d(x, p_);
}

Tensor MaxPool2d::forward_activation(const Tensor& z, Activation act, const Tensor& conv_bias) {
  check_forward_input(z);  // as forward()
  check_input("MaxPool2d", z, p_);
  return activation_pool2d(z, act, PoolMode::Max, p_, conv_bias);
}

Tensor GlobalAvgPool2d::forward_impl(const Tensor& x) {
  TANDEM_CHECK(x.dim() == 4, Shape, "GlobalAvgPool2d: input ", shape_str(x.shape()),
               " is not [N, C, H, W]");
  return mean(x, {2, 3});
}

}  // namespace tandem::nn
