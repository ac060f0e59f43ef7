#include "nn/linear.h"

#include <algorithm>

#include "autograd/ops.h"
#include "core/error.h"
#include "nn/init.h"

namespace tandem::nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen)
    : in_(in_features), out_(out_features) {
  TANDEM_CHECK(in_ > 0 && out_ > 0, Value, "Linear: sizes must be positive, got in_features=", in_,
               " out_features=", out_);
  register_parameter("weight", empty({out_, in_}));
  if (bias) register_parameter("bias", empty({out_}));
  reset_parameters(gen);
}

void Linear::reset_parameters(Generator& gen) {
  init::default_layer_init_(weight(), bias(), gen);
}

std::string Linear::extra_repr() const {
  return detail::str("in_features=", in_, ", out_features=", out_,
                     ", bias=", bias().defined() ? "true" : "false");
}

Tensor Linear::forward_impl(const Tensor& x) {
  return forward_activation(x, Activation::None);
}

Tensor Linear::forward_activation(const Tensor& x, Activation act) {
  check_forward_input(x);  // as forward()
  TANDEM_CHECK(x.dim() == 2 && x.size(1) == in_, Shape, "Linear(", in_, ", ", out_, "): input ",
               shape_str(x.shape()), " is not [N, ", in_, "]");
  return linear_activation(x, weight(), bias(), act);
}

std::string Flatten::extra_repr() const {
  return detail::str("start_dim=", start_dim_);
}

Tensor Flatten::forward_impl(const Tensor& x) {
  TANDEM_CHECK(start_dim_ >= 0 && start_dim_ < std::max<int64_t>(x.dim(), 1), Shape,
               "Flatten(start_dim=", start_dim_, "): input ", shape_str(x.shape()),
               " has too few dims");
  return flatten(x, start_dim_);
}

}  // namespace tandem::nn
