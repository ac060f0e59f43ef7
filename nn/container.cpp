#include "nn/container.h"

#include <string>

#include "kernels/backend.h"
#include "nn/activation.h"
#include "nn/batchnorm.h"
#include "nn/conv.h"
#include "nn/linear.h"
#include "nn/pooling.h"

namespace tandem::nn {

SequentialImpl::SequentialImpl(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) push_back(m);
}

SequentialImpl::SequentialImpl(const std::vector<std::shared_ptr<Module>>& modules) {
  for (const auto& m : modules) push_back(m);
}

SequentialImpl& SequentialImpl::push_back(std::shared_ptr<Module> m) {
  register_module(std::to_string(size()), std::move(m));
  return *this;
}

Tensor SequentialImpl::forward_impl(const Tensor& x) {
  Tensor y = x;
  const auto& children = named_children();
  const auto child = [&](size_t i) { return i < children.size() ? children.item(i).second.get() : nullptr; };
  for (size_t i = 0; i < children.size(); ++i) {
    Module& m = *children.item(i).second;
    // A Conv2d followed by a BatchNorm2d, its output's only reader, runs as conv_batch_norm:
    // the conv's bias inside the batch norm's passes when fuse_conv_bias() is on, and a ReLU
    // after them fused as below.
    auto* conv = dynamic_cast<Conv2d*>(&m);
    auto* conv_bn = conv != nullptr ? dynamic_cast<BatchNorm2d*>(child(i + 1)) : nullptr;
    if (conv_bn != nullptr) {
      const bool relu = fuse_bn_relu() && dynamic_cast<ReLU*>(child(i + 2)) != nullptr;
      y = conv_batch_norm(*conv, *conv_bn, y, relu);
      i += relu ? 2 : 1;
      continue;
    }
    // A BatchNorm2d followed by a ReLU runs as one op when fuse_bn_relu() is on (Note [batch
    // norm + ReLU] in kernels/backend.h): the same values, the ReLU module skipped.
    auto* bn = fuse_bn_relu() ? dynamic_cast<BatchNorm2d*>(&m) : nullptr;
    if (bn != nullptr && dynamic_cast<ReLU*>(child(i + 1)) != nullptr) {
      y = bn->forward_relu(y);
      ++i;
      continue;
    }
    // A Linear followed by a ReLU or a Sigmoid runs as one op when fuse_linear_activation()
    // is on (Note [linear + activation] in kernels/backend.h): the same values, the
    // activation module skipped.
    auto* lin = fuse_linear_activation() ? dynamic_cast<Linear*>(&m) : nullptr;
    if (lin != nullptr) {
      const Module* next = child(i + 1);
      const Activation act = dynamic_cast<const ReLU*>(next) != nullptr      ? Activation::Relu
                             : dynamic_cast<const Sigmoid*>(next) != nullptr ? Activation::Sigmoid
                                                                             : Activation::None;
      if (act != Activation::None) {
        y = lin->forward_activation(y, act);
        ++i;
        continue;
      }
    }
    // A ReLU or a Sigmoid followed by a pooling module runs as one op when
    // fuse_activation_pool() is on (Note [activation + pooling] in kernels/backend.h).
    const Activation act = !fuse_activation_pool()                    ? Activation::None
                           : dynamic_cast<const ReLU*>(&m) != nullptr    ? Activation::Relu
                           : dynamic_cast<const Sigmoid*>(&m) != nullptr ? Activation::Sigmoid
                                                                        : Activation::None;
    if (act != Activation::None) {
      if (auto* avg = dynamic_cast<AvgPool2d*>(child(i + 1)); avg != nullptr) {
        y = avg->forward_activation(y, act);
        ++i;
        continue;
      }
      if (auto* max = dynamic_cast<MaxPool2d*>(child(i + 1)); max != nullptr) {
        y = max->forward_activation(y, act);
        ++i;
        continue;
      }
    }
    y = m.forward(y);
  }
  return y;
}

}  // namespace tandem::nn
