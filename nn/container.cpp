#include "nn/container.h"

#include <string>

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
  for (const auto& [name, m] : named_children()) y = m->forward(y);
  return y;
}

}  // namespace tandem::nn
