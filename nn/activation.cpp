#include "nn/activation.h"

#include "autograd/ops.h"

namespace tandem::nn {

Tensor ReLU::forward_impl(const Tensor& x) {
  return relu(x);
}

Tensor Sigmoid::forward_impl(const Tensor& x) {
  return sigmoid(x);
}

}  // namespace tandem::nn
