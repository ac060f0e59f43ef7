#pragma once
// Losses.
#include "autograd/ops.h"

namespace tandem::nn {

// Mean cross-entropy of logits [N, C] against int64 class indices [N] (fused log-softmax).
using tandem::cross_entropy;

// Module-style functor: CrossEntropyLoss loss; Tensor l = loss(logits, target);
struct CrossEntropyLoss {
  Tensor operator()(const Tensor& logits, const Tensor& target) const {
    return cross_entropy(logits, target);
  }
  Tensor forward(const Tensor& logits, const Tensor& target) const {
    return cross_entropy(logits, target);
  }
};

}  // namespace tandem::nn
