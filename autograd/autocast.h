#pragma once
// Autocast: mixed precision for a scope, as torch.autocast(dtype=torch.bfloat16).
//
//   nn::Linear fc(512, 10);            // float32 parameters (the master weights)
//   {
//     AutocastGuard autocast;          // bfloat16
//     Tensor y = fc(x);                // x, weight and bias cast to bfloat16; y is bfloat16
//     Tensor loss = sum(to(y, kFloat32));
//     loss.backward();                 // fc.weight().grad() is float32
//   }
//
// Note [autocast]: inside the scope, the ops that gain the most from bfloat16 and lose the
// least (matrix products and convolutions: linear, matmul, conv2d) cast their float32 inputs
// to the autocast dtype with the differentiable cast `to`, and compute and return that dtype.
// Ops whose result needs float32's range and precision (log_softmax, cross_entropy: PyTorch's
// float32 list) cast bfloat16 inputs up to float32, so the loss is float32. Batch norm takes
// bfloat16 activations with its float32 parameters and statistics (mixed precision, as
// PyTorch's) and returns bfloat16; elementwise ops and pooling run in their inputs' dtype. Their backward runs
// in bfloat16 too, and each cast's backward turns the gradient back into float32, so
// parameters and their gradients stay float32 and the optimizer updates float32 master
// weights. Tensors of other dtypes are left alone: float64 is never cast down (as in
// PyTorch), bfloat16 is already there. Ops outside that list run in whatever dtype their
// inputs have; those without bfloat16 kernels throw a DTypeError naming the op, so a model
// whose bfloat16 activations reach one needs a cast (`to(y, kFloat32)`) before it.
//
// Differences from PyTorch: one state for all devices (PyTorch has one per device type); no
// cache of the cast weights within a scope by default (each linear casts its weight again,
// which costs one small elementwise kernel per call; PyTorch caches the casts of leaf
// parameters), but a whole model's casts as one kernel with AutocastWeights (below); bfloat16
// is the only autocast dtype, as tandem has no float16.
//
// The state is thread-local like grad mode (autograd/grad_mode.h); parallel::DeviceWorkers
// gives each worker the caller's state for a run, as PyTorch's parallel_apply does.
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace tandem {

bool is_autocast_enabled();
// The dtype of autocast's casts (bfloat16 unless set otherwise); meaningful when enabled.
DType autocast_dtype();
void set_autocast_enabled(bool enabled);
// Throws DTypeError for any dtype other than bfloat16.
void set_autocast_dtype(DType dtype);

// Turns autocast on (or, with enabled = false, off) for its scope on this thread and restores
// the previous state at its end; scopes nest.
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype = kBFloat16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

// Note [autocast weight copies]: under autocast every float32 weight and bias a convolution or
// a linear layer uses is cast in the forward, one kernel each (ResNet-18: 44 a step, most of
// them a few microseconds of a nearly idle GPU). AutocastWeights holds one bfloat16 copy of
// parameters that lie back to back in one buffer (a model's coalesced parameters,
// parallel::coalesce) and refreshes the whole copy with one cast. While an
// AutocastWeightsGuard installs it on this thread, autocast_input answers one of those
// parameters with its slice of the copy, still through the dtype conversion's autograd node
// (to_converted), so its gradient reaches the float32 parameter as before: the same values
// and gradients, bit for bit, with one kernel for the model instead of one per tensor.
//
// The copy holds the parameters as they were at the last refresh(). Whoever installs it
// refreshes it after every change of the parameters and before the forward that uses it (the
// one-device step, unless its optimizer keeps the copy: first thing in the step, inside its
// CUDA graph), and does not refresh it between a forward and that forward's backward (the
// backward reads the copy the forward saved, as it would read a parameter changed in place).
// An optimizer can keep the copy current instead: given copy() (Optimizer::set_weight_copy),
// its update writes each new value cast into it (Note [the weight copy written by the update]
// in nn/optim/optimizer.h), so after a step() the copy is what refresh() would make and the
// caller may skip refresh() until the parameters change some other way (a checkpoint loaded).
// The guard is per thread: device workers running a replica cast as before.
class AutocastWeights {
 public:
  // params: float32 tensors back to back in one buffer, in order (contiguous_span defined);
  // ValueError or DTypeError naming what is not.
  explicit AutocastWeights(const std::vector<Tensor>& params, DType dtype = kBFloat16);
  // A copy of params when they are what the constructor takes (float32, back to back in one
  // buffer), else none.
  static std::optional<AutocastWeights> if_fits(const std::vector<Tensor>& params);
  void refresh();  // one cast of the whole buffer into the copy, on its device's stream
  // The copy's slice for p (p itself one of the parameters), else an undefined tensor.
  Tensor lookup(const Tensor& p) const;
  DType dtype() const { return copy_.dtype(); }
  // The whole copy: [total numel] of dtype(), element k the cast of element k of the
  // parameters' buffer (what Optimizer::set_weight_copy takes).
  const Tensor& copy() const { return copy_; }

 private:
  std::vector<Tensor> params_, views_;
  Tensor flat_, copy_;
};

// Installs `weights` for autocast_input on this thread for its scope (null: none); nests.
class AutocastWeightsGuard {
 public:
  explicit AutocastWeightsGuard(const AutocastWeights* weights);
  ~AutocastWeightsGuard();
  AutocastWeightsGuard(const AutocastWeightsGuard&) = delete;
  AutocastWeightsGuard& operator=(const AutocastWeightsGuard&) = delete;

 private:
  const AutocastWeights* prev_;
};

// What a step does before its forward: refreshes `weights` (when there is one and `refresh`;
// false: the copy is known to be current, Note [the weight copy written by the update] in
// nn/optim/optimizer.h) and installs it for the returned guard's scope.
[[nodiscard]] AutocastWeightsGuard refresh_and_install(std::optional<AutocastWeights>& weights,
                                                       bool refresh = true);

// Under autocast, a float32 tensor cast to autocast_dtype() through the differentiable `to`
// (Note [autocast]), or its slice of the installed AutocastWeights copy (Note [autocast weight
// copies]); otherwise, and for undefined tensors and other dtypes, x itself.
Tensor autocast_input(const Tensor& x);
// Under autocast, a tensor of the autocast dtype cast up to float32 (the float32 list of Note
// [autocast]); otherwise x itself.
Tensor autocast_float32(const Tensor& x);

}  // namespace tandem
