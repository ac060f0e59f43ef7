#pragma once
// The residual block of d2l's ResNet.
#include "core/generator.h"
#include "nn/batchnorm.h"
#include "nn/conv.h"
#include "nn/module.h"

namespace tandem::nn {

// y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), with conv1 3x3 (in -> out,
// stride), conv2 3x3 (out -> out), and shortcut = conv3, a 1x1 conv (in -> out, stride), when
// use_1x1conv, else the identity (then in must equal out and stride must be 1).
// Children are registered in d2l's order: conv1, conv2, [conv3], bn1, bn2.
class Residual : public Cloneable<Residual> {
 public:
  Residual(int64_t in_channels, int64_t out_channels, bool use_1x1conv = false, int64_t stride = 1,
           Generator& gen = default_generator());

  Conv2d& conv1() const { return child_as<Conv2d>("conv1"); }
  Conv2d& conv2() const { return child_as<Conv2d>("conv2"); }
  BatchNorm2d& bn1() const { return child_as<BatchNorm2d>("bn1"); }
  BatchNorm2d& bn2() const { return child_as<BatchNorm2d>("bn2"); }
  bool use_1x1conv() const { return use_1x1conv_; }

  std::string name() const override { return "Residual"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  bool use_1x1conv_;
};

}  // namespace tandem::nn
