#pragma once
// The activations of the fused kernels (Note [linear + activation] and Note [activation +
// pooling] in kernels/backend.h), with the elementwise kernels' arithmetic: activate is
// UnaryOp::Relu / Sigmoid, activation_grad is BinaryOp::ReluBackward / SigmoidBackward of the
// output's gradient g and the activation's output y. float32 and float64.
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"

namespace tandem::gpu {

template <typename T, Activation A>
__device__ T activate(T z) {
  if constexpr (A == Activation::Relu) return z > T(0) ? z : T(0);
  if constexpr (A == Activation::Sigmoid) return T(1) / (T(1) + d_exp(-z));
  return z;
}

template <typename T, Activation A>
__device__ T activation_grad(T g, T y) {
  if constexpr (A == Activation::Relu) return y > T(0) ? g : T(0);
  if constexpr (A == Activation::Sigmoid) return g * y * (T(1) - y);
  return g;
}

// Calls fn(std::integral_constant<Activation, act>) for the runtime act.
template <typename Fn>
void dispatch_activation(Activation act, Fn&& fn) {
  switch (act) {
    case Activation::None: return fn(std::integral_constant<Activation, Activation::None>{});
    case Activation::Relu: return fn(std::integral_constant<Activation, Activation::Relu>{});
    case Activation::Sigmoid: return fn(std::integral_constant<Activation, Activation::Sigmoid>{});
  }
}

}  // namespace tandem::gpu
