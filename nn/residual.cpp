#include "nn/residual.h"

#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/backend.h"

namespace tandem::nn {

Residual::Residual(int64_t in_channels, int64_t out_channels, bool use_1x1conv, int64_t stride,
                   Generator& gen)
    : use_1x1conv_(use_1x1conv) {
  TANDEM_CHECK(use_1x1conv || (in_channels == out_channels && stride == 1), Value, "Residual(",
               in_channels, ", ", out_channels, ", stride=", stride,
               "): an identity shortcut needs in == out channels and stride 1; use_1x1conv");
  register_module("conv1",
                  std::make_shared<Conv2d>(in_channels, out_channels, 3, stride, 1, true, gen));
  register_module("conv2",
                  std::make_shared<Conv2d>(out_channels, out_channels, 3, 1, 1, true, gen));
  if (use_1x1conv) {
    register_module("conv3",
                    std::make_shared<Conv2d>(in_channels, out_channels, 1, stride, 0, true, gen));
  }
  register_module("bn1", std::make_shared<BatchNorm2d>(out_channels));
  register_module("bn2", std::make_shared<BatchNorm2d>(out_channels));
}

Tensor Residual::forward_impl(const Tensor& x) {
  // relu(bn1(conv1(x))) [N, out, H', W'], the ReLU fused into the batch norm's passes when
  // fuse_bn_relu() is on (Note [batch norm + ReLU] in kernels/backend.h), and each conv's bias
  // into its batch norm's when fuse_conv_bias() is on (conv_batch_norm).
  const bool fuse_relu = fuse_bn_relu();
  Tensor y = conv_batch_norm(conv1(), bn1(), x, fuse_relu);
  if (!fuse_relu) y = relu(y);
  Tensor shortcut = use_1x1conv_ ? child_as<Conv2d>("conv3")(x) : x;
  // relu(bn2(conv2(y)) + shortcut): the join in the batch norm's apply pass when
  // fuse_bn_add_relu() is on (Note [batch norm + residual join] in kernels/cuda/batchnorm.cu),
  // else one pass of its own after it.
  if (fuse_bn_add_relu()) return conv_batch_norm(conv2(), bn2(), y, true, shortcut);
  return add_relu(conv_batch_norm(conv2(), bn2(), y, false), shortcut);
}

}  // namespace tandem::nn
