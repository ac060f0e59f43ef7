#pragma once
// Optimizer: the base of SGD and Adam.
//
// An optimizer holds parameter handles (the same TensorImpls the module holds, so a later
// Module::to() is followed). step() is non-virtual: it turns autograd recording off and calls
// the virtual update() for every parameter that has a gradient; parameters without one are
// skipped (see Note [zero_grad sets to none] in nn/module.h). Updates are fused in-place
// kernels (kernels::sgd_step, kernels::adam_step) enqueued on the parameter's device: step()
// never synchronizes the host. Per-parameter state (momentum, Adam moments) is allocated
// lazily on the parameter's device at its first update.
//
// Note [flat optimizer step]: when the parameters are coalesced (back to back in one storage,
// e.g. after parallel::coalesce) and so are their gradients (a parallel::FlatBuffer), step()
// offers the whole model to update_flat() as two 1-D tensors: one fused kernel instead of one
// per parameter (ResNet-18: 62 launches become 1). SGD and Adam take it and keep their state
// flat too, as views per parameter (momentum_buffer(i) and friends still work); the math is
// elementwise, so the result is the same as parameter by parameter. Anything else (a parameter
// without a gradient, state on another device, Adam step counts that differ) takes the
// per-parameter path.
//
// Note [capturable optimizer steps]: PyTorch's capturable=True. A step replayed from a CUDA
// graph replays kernels with the arguments they were captured with (Note [graph-safe steps] in
// core/cuda_graph.h), so what changes between steps must not be a kernel argument. A
// capturable optimizer (the `capturable` option of SGDOptions, AdamOptions, AdamWOptions)
// keeps it in device memory instead:
//   - the learning rate, in a float64 [] tensor on every device that holds a parameter (and on
//     the host: lr()). set_lr() writes it with a fill enqueued on that device's current
//     stream -- no host sync -- so the next step, eager or replayed, reads the new value. It is
//     float64, not the parameter dtype, because the host path derives its constants from a
//     double lr: SGD casts it to the element type, Adam first computes lr / (1 - beta1^t) and
//     1 - lr * wd in double; from the same double the kernels compute the same constants.
//   - Adam's step count, a float32 [] tensor on the parameter's device, PyTorch's
//     state["step"] (exact up to 2^24 steps, as PyTorch's). A step is then two kernels:
//     kernels::adam_advance_step adds 1 and writes lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t)
//     and 1 - lr * wd in double into a float64 [3] buffer; kernels::adam_step reads them. The
//     flat path keeps one count (and buffer) for all parameters, their state_dict entries the
//     same tensor; a per-parameter step after it first gives each parameter its own copy.
// What comes out: on the CPU those values are read on the host and go through the very
// functions of the host path, so a capturable run equals a plain one bit for bit. On CUDA,
// SGD too (one double, cast alike); Adam's bias corrections use the device's pow, which can be
// a few ulp from the host's (Note [device Adam constants] in kernels/cuda/optim.cu): the
// constants agree to ~1e-12 relative, in float32 almost always to the bit, but not promised.
// step() synchronizes the host in neither mode. Parameters may sit on several devices (one
// learning-rate tensor each) or on the CPU. State made lazily at a parameter's first step
// (moments, counts, the learning rate of a device a parameter moved to) must exist before a
// capture begins: warm up first, as StepGraph does. Call set_lr() between replays, not inside
// the captured step (a captured fill would put the old value back at every replay).
//
// Note [the weight copy written by the update]: under autocast a training step reads the
// parameters as one bfloat16 copy (Note [autocast weight copies] in autograd/autocast.h), which
// would otherwise be refreshed by one cast of the whole parameter buffer at every step's start.
// set_weight_copy(copy) hands that copy to the optimizer: after every step(), copy holds the
// parameters cast to copy's dtype, element k of the coalesced parameter buffer (in params()
// order, as contiguous_span gives it) at element k of copy. On the flat path (Note [flat
// optimizer step]) SGD and Adam write it from the kernel that updates the parameters, which
// has each new value in a register anyway (SgdParams::copy_into, as apex's multi-tensor SGD
// writes fp16 model weights): no extra pass over the parameters, and the bits of a cast (the
// same conversion, rounded to nearest even). Where step() takes the per-parameter path, or a
// subclass's update_flat does not write it, step() refreshes the copy with one cast copy
// afterwards, so the contract holds either way; both are enqueued kernels on the parameters'
// stream, with no host sync and no allocation, so a captured step (Note [capturable optimizer
// steps]) keeps the copy current at every replay. Only step() keeps it: after any other change
// of the parameters (loading a checkpoint, an edit in place) the caller refreshes the copy
// before it reads it again.
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"  // StateDict

namespace tandem::nn::optim {

class Optimizer {
 public:
  // Throws ValueError for an undefined, non-floating, non-leaf or repeated parameter, or a
  // negative learning rate. capturable: Note [capturable optimizer steps].
  Optimizer(std::vector<Tensor> params, double lr, bool capturable = false);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  void step();
  // Clears the gradients of the parameters: undefined (default) or filled with zeros.
  void zero_grad(bool set_to_none = true);

  double lr() const { return lr_; }
  // The learning rate of the following steps. Capturable: also written into the device's
  // learning-rate tensors, stream-ordered (Note [capturable optimizer steps]).
  void set_lr(double lr);
  bool capturable() const { return capturable_; }
  const std::vector<Tensor>& params() const { return params_; }

  // Note [the weight copy written by the update]: from the next step() on, `copy` holds the
  // parameters cast after every step. copy: contiguous, of the parameters' total numel, of a
  // floating dtype other than theirs, on their device; the parameters back to back in one
  // buffer (parallel::coalesce). ValueError (naming both numbers for a wrong numel), DTypeError
  // or DeviceError otherwise; an undefined copy clears it. The copy is not refreshed here.
  void set_weight_copy(const Tensor& copy);
  const Tensor& weight_copy() const { return weight_copy_; }

  // Note [optimizer state names]: PyTorch's optimizer.state_dict()["state"], flattened with
  // dots: "state.<i>.<name>" for parameter i (its position in params()) and each of its state
  // entries, in PyTorch's order -- SGD "momentum_buffer"; Adam and AdamW "step" (a float32 []
  // tensor, as PyTorch stores it), "exp_avg", "exp_avg_sq". Only parameters that have state
  // appear (PyTorch creates it at a parameter's first step). The tensors are the live state
  // on the parameters' devices, not copies; "step" is a fresh CPU tensor, except in a
  // capturable optimizer, where it is the live count on the device (as PyTorch's; after the
  // flat path the one count all parameters share). The hyperparameters (PyTorch's
  // "param_groups") are not tensors and not included: the caller keeps them (lr()).
  StateDict state_dict() const;
  // Replaces the whole state with `state` (names as state_dict(); a parameter without entries
  // starts afresh). Checks everything before changing anything and names the first offending
  // tensor: a name that is not "state.<i>.<name>" with i < params().size() and a state name of
  // this optimizer, or a parameter with only some of its entries (ValueError); a tensor whose
  // shape (ShapeError) or dtype (DTypeError) does not match parameter i ("step": one value, a
  // non-negative integer). Values are copied onto each parameter's device; when the
  // parameters are coalesced, each kind of state is allocated flat (Note [flat optimizer step]).
  // Either kind of optimizer loads either kind's state (capturable or not: only where "step"
  // lives differs). Reads the "step" values on the host: it synchronizes, so call it outside
  // a capture.
  void load_state_dict(const StateDict& state);

 protected:
  // What state_dict() and load_state_dict() see of a subclass: its per-parameter state kinds
  // in PyTorch's order. A kind `like_param` is one tensor per parameter, like the parameter,
  // held in *state_slots(name) (undefined: no state yet); otherwise it is one number per
  // parameter (scalar_state / set_scalar_state). A parameter has state when its first
  // like_param slot is defined.
  struct StateKind {
    std::string name;
    bool like_param;
  };
  virtual std::vector<StateKind> state_kinds() const = 0;
  virtual std::vector<Tensor>* state_slots(const std::string& name) = 0;
  virtual double scalar_state(size_t /*index*/, const std::string& /*name*/) const { return 0.0; }
  virtual void set_scalar_state(size_t /*index*/, const std::string& /*name*/, double /*value*/) {}
  // A scalar state that lives in a tensor (capturable Adam's device "step"): state_dict()
  // returns that tensor instead of a CPU copy of scalar_state(). Undefined: a host number.
  virtual Tensor scalar_state_tensor(size_t /*index*/, const std::string& /*name*/) const {
    return Tensor();
  }
  // Called at the end of load_state_dict, once every slot and scalar state is set.
  virtual void state_loaded() {}

  // Updates params()[index] in place from grad (same shape; defined).
  virtual void update(size_t index, const Tensor& param, const Tensor& grad) = 0;
  // Note [flat optimizer step]: every parameter at once, `params` and `grads` the 1-D spans of
  // all parameters and all gradients (same length, device and dtype). Returns false (having
  // changed nothing) to decline; then step() updates parameter by parameter.
  virtual bool update_flat(const Tensor& params, const Tensor& grads) { return false; }
  // Whether an update_flat that returned true has also written weight_copy(), when defined,
  // with the updated `params` cast (Note [the weight copy written by the update]); false:
  // step() refreshes it with a cast.
  virtual bool update_flat_writes_weight_copy() const { return false; }
  // Per-parameter state for the flat path: `slots` (one per parameter) as consecutive views of
  // one zeroed buffer like `flat`, when every slot is undefined; the span of the slots when
  // they already are such views on flat's device; undefined otherwise.
  Tensor flat_state(std::vector<Tensor>& slots, const Tensor& flat) const;
  // The state tensor in `slot`, created as zeros like `param` when undefined, or moved to
  // param's device when the parameter has moved since.
  static const Tensor& state_like(Tensor& slot, const Tensor& param);
  // Capturable: the float64 [] learning rate on `device` that the kernels read, made (with
  // lr()) on first use for a device that held no parameter at construction.
  Tensor lr_tensor(Device device);

 private:
  // The flat path over flat_params, the parameters' contiguous_span (defined).
  bool step_flat(const Tensor& flat_params);
  // Checks `copy` against `span`, the parameters' contiguous_span (undefined: they are not back
  // to back); `op` names the caller in the errors.
  void check_weight_copy(const Tensor& copy, const Tensor& span, const char* op) const;
  // weight_copy_ = span cast, one kernel.
  void refresh_weight_copy(const Tensor& span) const;

  std::vector<Tensor> params_;
  double lr_;
  bool capturable_;
  std::vector<std::pair<Device, Tensor>> lr_tensors_;  // capturable: one per device, float64 []
  Tensor weight_copy_;  // Note [the weight copy written by the update]; undefined: none
};

}  // namespace tandem::nn::optim
