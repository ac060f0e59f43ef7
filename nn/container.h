#pragma once
// Sequential: children applied in order, named "0", "1", ... (a BatchNorm2d and the ReLU after
// it as one op when fuse_bn_relu() is on: Note [batch norm + ReLU] in kernels/backend.h; a
// Conv2d's bias added inside the BatchNorm2d after it when fuse_conv_bias() is on:
// nn::conv_batch_norm).
#include <initializer_list>
#include <memory>
#include <vector>

#include "nn/module.h"

namespace tandem::nn {

class Sequential : public Cloneable<Sequential> {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  explicit Sequential(const std::vector<std::shared_ptr<Module>>& modules);

  // Appends m under the name of its index.
  Sequential& push_back(std::shared_ptr<Module> m);
  size_t size() const { return named_children().size(); }

  // A child's handle: a shared_ptr that can also be called, so `(*seq)[i](x)` reads like
  // PyTorch's `seq[i](x)` (and `(*seq)[i]->name()` still works).
  struct ModulePtr : std::shared_ptr<Module> {
    Tensor operator()(const Tensor& x) const { return (**this)(x); }
  };
  // The i-th module; ValueError when out of range.
  ModulePtr operator[](size_t i) const { return {named_children().item(i).second}; }
  // The i-th module, callable directly: seq->at(i)(x). ValueError when out of range.
  Module& at(size_t i) const { return *(*this)[i]; }
  // The i-th module as an M; ValueError when out of range or of another type.
  template <typename M>
  M& at(size_t i) const {
    auto* m = dynamic_cast<M*>((*this)[i].get());
    TANDEM_CHECK(m != nullptr, Value, "Sequential: module ", i, " is a ", (*this)[i]->name(),
                 ", not the requested type");
    return *m;
  }

  std::string name() const override { return "Sequential"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;
};

}  // namespace tandem::nn
