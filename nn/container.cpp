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

namespace {

// The activation of module a when a pooling module p follows it and fuse_activation_pool() is on
// (a ReLU or a Sigmoid); Activation::None otherwise.
Activation activation_before_pool(const Module* a, const Module* p) {
  if (!fuse_activation_pool() || a == nullptr ||
      (dynamic_cast<const AvgPool2d*>(p) == nullptr && dynamic_cast<const MaxPool2d*>(p) == nullptr)) {
    return Activation::None;
  }
  return dynamic_cast<const ReLU*>(a) != nullptr      ? Activation::Relu
         : dynamic_cast<const Sigmoid*>(a) != nullptr ? Activation::Sigmoid
                                                      : Activation::None;
}

// pool(act(z + conv_bias)) through pooling module p (an AvgPool2d or a MaxPool2d).
Tensor pool_activation(Module& p, const Tensor& z, Activation act, const Tensor& conv_bias) {
  if (auto* avg = dynamic_cast<AvgPool2d*>(&p); avg != nullptr) return avg->forward_activation(z, act, conv_bias);
  return dynamic_cast<MaxPool2d&>(p).forward_activation(z, act, conv_bias);
}

}  // namespace

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
    // fuse_activation_pool() is on (Note [activation + pooling] in kernels/backend.h); a Conv2d
    // with a bias before them leaves its bias for that op to add when fuse_conv_bias() is on too
    // (Note [conv bias in activation + pooling] in kernels/ops.h).
    const Activation act = activation_before_pool(&m, child(i + 1));
    if (act != Activation::None) {
      y = pool_activation(*child(i + 1), y, act, Tensor());
      ++i;
      continue;
    }
    const Activation conv_act = conv != nullptr && conv->bias().defined() && fuse_conv_bias()
                                    ? activation_before_pool(child(i + 1), child(i + 2))
                                    : Activation::None;
    if (conv_act != Activation::None) {
      y = pool_activation(*child(i + 2), conv->forward_bias_deferred(y), conv_act, conv->bias());
      i += 2;
      continue;
    }
    y = m.forward(y);
  }
  return y;
}

}  // namespace tandem::nn
