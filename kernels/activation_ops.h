#pragma once
// The elementwise ops of each Activation, for the dispatcher's compositions (kernels/ops.cpp,
// kernels/ops_conv.cpp) where a backend has no fused kernel (Note [linear + activation] and
// Note [activation + pooling] in kernels/backend.h): the forward as a UnaryOp, and the backward
// from the activation's output as a BinaryOp of the output's gradient g and the output y.
// Activation::None has neither; the compositions skip it before asking.
#include "kernels/backend.h"

namespace tandem::kernels {

inline UnaryOp activation_forward_op(Activation act) {
  switch (act) {
    case Activation::Relu: return UnaryOp::Relu;
    case Activation::Sigmoid: return UnaryOp::Sigmoid;
    case Activation::None: break;
  }
  TANDEM_THROW(Value, "activation_forward_op: Activation::None has no op");
}

// ReluBackward(g, y) = g * (y > 0), SigmoidBackward(g, y) = g * y * (1 - y).
inline BinaryOp activation_backward_op(Activation act) {
  switch (act) {
    case Activation::Relu: return BinaryOp::ReluBackward;
    case Activation::Sigmoid: return BinaryOp::SigmoidBackward;
    case Activation::None: break;
  }
  TANDEM_THROW(Value, "activation_backward_op: Activation::None has no op");
}

}  // namespace tandem::kernels
