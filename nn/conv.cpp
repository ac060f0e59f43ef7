#include "nn/conv.h"

#include "autograd/ops.h"
#include "core/error.h"
#include "nn/init.h"

namespace tandem::nn {

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride,
               int64_t padding, bool bias, Generator& gen)
    : in_(in_channels),
      out_(out_channels),
      kernel_(kernel_size),
      stride_(stride),
      padding_(padding) {
  TANDEM_CHECK(in_ > 0 && out_ > 0 && kernel_ > 0 && stride_ > 0 && padding_ >= 0, Value,
               "Conv2d: invalid configuration in_channels=", in_, " out_channels=", out_,
               " kernel_size=", kernel_, " stride=", stride_, " padding=", padding_);
  register_parameter("weight", empty({out_, in_, kernel_, kernel_}));
  if (bias) register_parameter("bias", empty({out_}));
  reset_parameters(gen);
}

void Conv2d::reset_parameters(Generator& gen) {
  init::default_layer_init_(weight(), bias(), gen);
}

std::string Conv2d::extra_repr() const {
  return detail::str(in_, ", ", out_, ", kernel_size=", kernel_, ", stride=", stride_,
                     ", padding=", padding_, bias().defined() ? "" : ", bias=false");
}

void Conv2d::check_input_shape(const Tensor& x) const {
  TANDEM_CHECK(x.dim() == 4 && x.size(1) == in_, Shape, "Conv2d(", in_, ", ", out_,
               ", kernel_size=", kernel_, "): input ", shape_str(x.shape()), " is not [N, ", in_,
               ", H, W]");
  TANDEM_CHECK(x.size(2) + 2 * padding_ >= kernel_ && x.size(3) + 2 * padding_ >= kernel_, Shape,
               "Conv2d: input ", shape_str(x.shape()), " with padding ", padding_,
               " is smaller than the kernel ", kernel_, "x", kernel_);
}

Tensor Conv2d::forward_impl(const Tensor& x) {
  check_input_shape(x);
  return conv2d(x, weight(), bias(), params());
}

Tensor Conv2d::forward_no_bias(const Tensor& x) {
  check_forward_input(x);  // as forward()
  check_input_shape(x);
  return conv2d(x, weight(), Tensor(), params());
}

Tensor Conv2d::forward_bias_deferred(const Tensor& x) {
  check_forward_input(x);  // as forward()
  check_input_shape(x);
  return conv2d(x, weight(), bias(), params(), /*add_bias=*/false);
}

}  // namespace tandem::nn
