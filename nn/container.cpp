#include "nn/container.h"

#include <string>

#include "kernels/backend.h"
#include "nn/activation.h"
#include "nn/batchnorm.h"

namespace tandem::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) push_back(m);
}

Sequential::Sequential(const std::vector<std::shared_ptr<Module>>& modules) {
  for (const auto& m : modules) push_back(m);
}

Sequential& Sequential::push_back(std::shared_ptr<Module> m) {
  register_module(std::to_string(size()), std::move(m));
  return *this;
}

Tensor Sequential::forward_impl(const Tensor& x) {
  Tensor y = x;
  const auto& children = named_children();
  for (size_t i = 0; i < children.size(); ++i) {
    Module& m = *children.item(i).second;
    // A BatchNorm2d followed by a ReLU runs as one op when fuse_bn_relu() is on (Note [batch
    // norm + ReLU] in kernels/backend.h): the same values, the ReLU module skipped.
    auto* bn = fuse_bn_relu() && i + 1 < children.size() ? dynamic_cast<BatchNorm2d*>(&m) : nullptr;
    if (bn != nullptr && dynamic_cast<ReLU*>(children.item(i + 1).second.get()) != nullptr) {
      y = bn->forward_relu(y);
      ++i;
      continue;
    }
    y = m.forward(y);
  }
  return y;
}

}  // namespace tandem::nn
