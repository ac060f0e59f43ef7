#pragma once
// Linear (fully connected) and Flatten.
#include "core/generator.h"
#include "kernels/backend.h"
#include "nn/module.h"

namespace tandem::nn {

// y = x @ weight^T + bias. x [N, in], weight [out, in], bias [out]; y [N, out].
// Initialized like PyTorch (init::default_layer_init_), drawing from `gen`.
class Linear : public Cloneable<Linear> {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         Generator& gen = default_generator());

  const Tensor& weight() const { return parameter("weight"); }  // [out, in]
  Tensor bias() const { return find_parameter("bias"); }        // [out] or undefined
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  // Redraws weight and bias with PyTorch's default initialization.
  void reset_parameters(Generator& gen = default_generator());
  // act(forward(x)) as one op (autograd's linear_activation): the same values and gradients.
  // What a Sequential runs for a Linear followed by a ReLU or a Sigmoid when
  // fuse_linear_activation() is on (kernels/backend.h).
  Tensor forward_activation(const Tensor& x, Activation act);

  std::string name() const override { return "Linear"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  int64_t in_, out_;
};

// [N, d1, d2, ...] -> [N, d1 * d2 * ...] (dims from start_dim on are merged).
class Flatten : public Cloneable<Flatten> {
 public:
  explicit Flatten(int64_t start_dim = 1) : start_dim_(start_dim) {}
  std::string name() const override { return "Flatten"; }
  std::string extra_repr() const override;

 protected:
  Tensor forward_impl(const Tensor& x) override;

 private:
  int64_t start_dim_;
};

}  // namespace tandem::nn
