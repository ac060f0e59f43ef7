#pragma once
// FlatBuffer: the gradients of many parameters in one contiguous buffer.
//
// A model has dozens of parameters; allreducing each gradient separately pays a collective's
// fixed cost (a kernel launch, a NCCL group, a ring's 2(n-1) steps) dozens of times per step.
// Instead each replica keeps one flat buffer [total] per device and makes each parameter's
// .grad a view into it, so backward accumulates straight into the buffer (autograd adds into
// an existing .grad in place) and one allreduce_sum covers the whole model:
//
//   FlatBuffer grads(replica.parameters());   // once
//   grads.zero_(); grads.attach();            // each step, before backward
//   loss.backward();
//   grads.collect();                          // each step, after backward
//   comm.allreduce_sum({grads0.flat(), grads1.flat(), ...});
//
// zero_() is one fill for the whole model. The parameters must be on one device and of one
// dtype (ValueError/DeviceError/DTypeError naming the parameter otherwise).
#include <vector>

#include "core/tensor.h"

namespace tandem::parallel {

// The number of elements of `tensors` together, after checking that they are defined and share
// one device and dtype (ValueError/DeviceError/DTypeError "<who>: <noun> k ..." otherwise).
int64_t checked_flat_numel(const std::vector<Tensor>& tensors, const char* who, const char* noun);

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // A zeroed buffer sized for `params` (views follow the order of `params`).
  explicit FlatBuffer(std::vector<Tensor> params);

  const Tensor& flat() const { return flat_; }  // [total]
  const std::vector<Tensor>& views() const { return views_; }  // views_[k]: params[k]'s shape
  const std::vector<Tensor>& params() const { return params_; }
  int64_t numel() const { return flat_.defined() ? flat_.numel() : 0; }

  // Sets params[k].grad to views()[k] (cheap; doing it every step also undoes a
  // zero_grad() that set the gradients to none).
  void attach() const;
  // After backward: a parameter whose .grad is no longer its view (something replaced it)
  // gets its gradient copied into the view and the view reattached, so flat() always holds
  // every gradient. A parameter without a gradient keeps zeros.
  void collect() const;
  // Makes the gradients undefined again (the buffer is kept).
  void detach() const;
  // Fills the buffer with zeros, and marks each attached gradient zero for autograd, so the
  // next backward may write gradients straight into the buffer rather than add them to it
  // (Note [gradients written in place] in autograd/node.h).
  void zero_() const;

 private:
  std::vector<Tensor> params_;
  Tensor flat_;
  std::vector<Tensor> views_;
};

}  // namespace tandem::parallel
