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
// cache of the cast weights within a scope (each linear casts its weight again, which costs
// one small elementwise kernel per call; PyTorch caches the casts of leaf parameters);
// bfloat16 is the only autocast dtype, as tandem has no float16.
//
// The state is thread-local like grad mode (autograd/grad_mode.h); parallel::DeviceWorkers
// gives each worker the caller's state for a run, as PyTorch's parallel_apply does.
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

// Under autocast, a float32 tensor cast to autocast_dtype() through the differentiable `to`
// (Note [autocast]); otherwise, and for undefined tensors and other dtypes, x itself.
Tensor autocast_input(const Tensor& x);
// Under autocast, a tensor of the autocast dtype cast up to float32 (the float32 list of Note
// [autocast]); otherwise x itself.
Tensor autocast_float32(const Tensor& x);

}  // namespace tandem
