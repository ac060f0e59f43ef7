#include "nn/batchnorm.h"

#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "nn/conv.h"

namespace tandem::nn {

BatchNorm2d::BatchNorm2d(int64_t num_features, double eps, double momentum)
    : c_(num_features), eps_(eps), momentum_(momentum) {
  TANDEM_CHECK(c_ > 0, Value, "BatchNorm2d: num_features must be positive, got ", c_);
  TANDEM_CHECK(eps_ > 0, Value, "BatchNorm2d: eps must be positive, got ", eps_);
  TANDEM_CHECK(momentum_ >= 0 && momentum_ <= 1, Value, "BatchNorm2d: momentum ", momentum_,
               " is not in [0, 1]");
  register_parameter("weight", ones({c_}));
  register_parameter("bias", zeros({c_}));
  register_buffer("running_mean", zeros({c_}));
  register_buffer("running_var", ones({c_}));
  register_buffer("num_batches_tracked", zeros({}, kInt64));
}

void BatchNorm2d::reset_running_stats() {
  running_mean().fill_(0.0);
  running_var().fill_(1.0);
  num_batches_tracked().fill_(0.0);
}

std::string BatchNorm2d::extra_repr() const {
  return detail::str(c_, ", eps=", eps_, ", momentum=", momentum_);
}

Tensor BatchNorm2d::forward_impl(const Tensor& x) { return run(x, false, Tensor(), Tensor()); }

Tensor BatchNorm2d::forward_relu(const Tensor& x) {
  check_forward_input(x);  // as forward()
  return run(x, true, Tensor(), Tensor());
}

Tensor BatchNorm2d::forward_biased(const Tensor& z, const Tensor& conv_bias, bool relu) {
  check_forward_input(z);  // as forward()
  TANDEM_CHECK(conv_bias.defined(), Value, "BatchNorm2d(", c_, "): forward_biased without a bias");
  return run(z, relu, conv_bias, Tensor());
}

Tensor BatchNorm2d::forward_add_relu(const Tensor& x, const Tensor& residual, const Tensor& conv_bias) {
  check_forward_input(x);  // as forward()
  TANDEM_CHECK(residual.defined(), Value, "BatchNorm2d(", c_, "): forward_add_relu without a residual");
  return run(x, true, conv_bias, residual);
}

Tensor BatchNorm2d::run(const Tensor& x, bool relu, const Tensor& conv_bias, const Tensor& residual) {
  TANDEM_CHECK((x.dim() == 4 || x.dim() == 2) && x.size(1) == c_, Shape, "BatchNorm2d(", c_,
               "): input ", shape_str(x.shape()), " is not [N, ", c_, ", H, W] or [N, ", c_, "]");
  if (is_training()) {
    // The unbiased variance divides by (elements per channel - 1).
    TANDEM_CHECK(x.numel() / c_ > 1, Value,
                 "BatchNorm2d: training needs more than one value per "
                 "channel, got input ",
                 shape_str(x.shape()));
  }
  // The op adds 1 to it in training, where it updates the running statistics.
  const Tensor& count = num_batches_tracked();
  if (residual.defined()) {
    TANDEM_CHECK(relu, Value, "BatchNorm2d(", c_, "): a residual is joined before a ReLU only");
    return batch_norm_add_relu(x, residual, weight(), bias(), running_mean(), running_var(), is_training(),
                               momentum_, eps_, conv_bias, count);
  }
  if (conv_bias.defined()) {
    return batch_norm_bias(x, conv_bias, weight(), bias(), running_mean(), running_var(), is_training(),
                           momentum_, eps_, relu, count);
  }
  return relu ? batch_norm_relu(x, weight(), bias(), running_mean(), running_var(), is_training(), momentum_, eps_,
                                count)
              : batch_norm(x, weight(), bias(), running_mean(), running_var(), is_training(), momentum_, eps_,
                           count);
}

Tensor conv_batch_norm(Conv2d& conv, BatchNorm2d& bn, const Tensor& x, bool relu, const Tensor& residual) {
  const bool bias_in_bn = fuse_conv_bias() && conv.bias().defined();
  const Tensor z = bias_in_bn ? conv.forward_no_bias(x) : conv(x);
  const Tensor b = bias_in_bn ? conv.bias() : Tensor();
  if (residual.defined()) return bn.forward_add_relu(z, residual, b);
  if (b.defined()) return bn.forward_biased(z, b, relu);
  return relu ? bn.forward_relu(z) : bn(z);
}

}  // namespace tandem::nn
