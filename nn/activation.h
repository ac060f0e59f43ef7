#pragma once
// Elementwise activations.
#include "nn/module.h"

namespace tandem::nn {

class ReLU : public Cloneable<ReLU> {
 public:
  ReLU() = default;
  std::string name() const override { return "ReLU"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;
};

class Sigmoid : public Cloneable<Sigmoid> {
 public:
  Sigmoid() = default;
  std::string name() const override { return "Sigmoid"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;
};

}  // namespace tandem::nn
