// The dispatcher, the in-place optimizer steps (SGD, Adam and its capturable step count).
// Same rules as ops.cpp.
#include "kernels/ops.h"

#include "kernels/ops_checks.h"

namespace tandem::kernels {

namespace {

using internal::check_floating;
using internal::check_in_place;
using internal::check_shape;

void check_optim_arg(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  check_same_device(op, {&param, &t});
  check_same_dtype(op, {&param, &t});
  check_shape(op, t, param.shape(), name);
}

// The optimizer kernels run over raw memory, so a gradient or state tensor must be laid out as
// its parameter is (same_layout). `t` laid out as the in-place tensor `param` (contiguous or channels-last, check_in_place).
Tensor layout_of(const Tensor& t, const Tensor& param) {
  if (same_layout(t, param)) return t;
  return t.contiguous(param.is_contiguous() ? MemoryFormat::Contiguous : MemoryFormat::ChannelsLast);
}

void check_state_layout(const char* op, const Tensor& param, const Tensor& t, const char* name) {
  TANDEM_CHECK(same_layout(param, t), Value, op, ": ", name, " ", shape_str(t.shape()),
               " is laid out differently from its parameter (memory format)");
}

// A device-resident scalar input of a capturable optimizer step: `numel` contiguous values of
// `dtype` on `device`.
void check_step_input(const char* op, const Tensor& t, DType dtype, int64_t numel, Device device,
                      const char* name) {
  TANDEM_CHECK(t.defined(), Value, op, ": ", name, " is undefined");
  TANDEM_CHECK(t.dtype() == dtype, DType, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
               dtype_name(t.dtype()));
  TANDEM_CHECK(t.numel() == numel && t.is_contiguous(), Shape, op, ": ", name, " must be ", numel,
               " contiguous value", numel == 1 ? "" : "s", ", got ", shape_str(t.shape()));
  TANDEM_CHECK(t.device() == device, Device, op, ": ", name, " is on ", t.device().str(),
               ", the step runs on ", device.str());
}

// SgdParams::copy_into / AdamParams::copy_into: the kernels write element i of the parameter's
// memory to element i of the copy's, so the copy is laid out as the parameter, or both are
// contiguous (a 1-D copy of a contiguous parameter, the flat step's).
void check_copy_into(const char* op, const Tensor& param, const Tensor& copy) {
  if (!copy.defined()) return;
  TANDEM_CHECK(is_floating(copy.dtype()) && copy.dtype() != param.dtype(), DType, op,
               ": copy_into must be of a floating dtype other than the parameter's ",
               dtype_name(param.dtype()), ", got ", dtype_name(copy.dtype()));
  TANDEM_CHECK(copy.numel() == param.numel() &&
                   (same_layout(copy, param) || (copy.is_contiguous() && param.is_contiguous())),
               Shape, op, ": copy_into ", shape_str(copy.shape()),
               " must hold the parameter's ", param.numel(),
               " values laid out as the parameter ", shape_str(param.shape()),
               " (or both contiguous)");
  TANDEM_CHECK(copy.device() == param.device(), Device, op, ": copy_into is on ",
               copy.device().str(), ", the parameter on ", param.device().str());
}

}  // namespace

// ---- optimizer steps --------------------------------------------------------------------

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf,
              const SgdParams& p) {
  const char* op = "sgd_step";
  check_same_device(op, {&param});
  check_floating(op, param);
  check_optim_arg(op, param, grad, "grad");
  check_in_place(op, param, "param");
  TANDEM_CHECK(p.lr >= 0 && p.momentum >= 0 && p.weight_decay >= 0, Value, op,
               ": lr, momentum and weight_decay must be >= 0, got ", p.lr, ", ", p.momentum, ", ",
               p.weight_decay);
  TANDEM_CHECK(!p.nesterov || (p.momentum > 0 && p.dampening == 0), Value, op,
               ": nesterov needs momentum > 0 and dampening 0");
  if (p.momentum != 0) {
    TANDEM_CHECK(momentum_buf.defined(), Value, op, ": momentum ", p.momentum,
                 " needs a momentum buffer");
    check_optim_arg(op, param, momentum_buf, "momentum_buf");
    check_in_place(op, momentum_buf, "momentum_buf");
    check_state_layout(op, param, momentum_buf, "momentum_buf");
  }
  if (p.lr_tensor.defined())
    check_step_input(op, p.lr_tensor, kFloat64, 1, param.device(), "lr_tensor");
  check_copy_into(op, param, p.copy_into);
  backend_for(param.device()).sgd_step(param, layout_of(grad, param), momentum_buf, p);
}

void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               const AdamParams& p) {
  const char* op = "adam_step";
  check_same_device(op, {&param});
  check_floating(op, param);
  check_optim_arg(op, param, grad, "grad");
  check_optim_arg(op, param, m, "m");
  check_optim_arg(op, param, v, "v");
  check_in_place(op, param, "param");
  check_in_place(op, m, "m");
  check_in_place(op, v, "v");
  check_state_layout(op, param, m, "m");
  check_state_layout(op, param, v, "v");
  if (p.consts.defined()) {
    check_step_input(op, p.consts, kFloat64, 3, param.device(), "consts");
  } else {
    TANDEM_CHECK(p.step >= 1, Value, op, ": step is 1-based, got ", p.step);
  }
  TANDEM_CHECK(p.beta1 >= 0 && p.beta1 < 1 && p.beta2 >= 0 && p.beta2 < 1, Value, op,
               ": betas must be in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  check_copy_into(op, param, p.copy_into);
  backend_for(param.device()).adam_step(param, layout_of(grad, param), m, v, p);
}

void adam_advance_step(const Tensor& step, const Tensor& lr, const Tensor& consts,
                       const AdamParams& p) {
  const char* op = "adam_advance_step";
  TANDEM_CHECK(step.defined(), Value, op, ": step is undefined");
  const Device d = step.device();
  check_step_input(op, step, kFloat32, 1, d, "step");
  check_step_input(op, lr, kFloat64, 1, d, "lr");
  check_step_input(op, consts, kFloat64, 3, d, "consts");
  TANDEM_CHECK(p.beta1 >= 0 && p.beta1 < 1 && p.beta2 >= 0 && p.beta2 < 1, Value, op,
               ": betas must be in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  TANDEM_CHECK(p.weight_decay >= 0, Value, op, ": weight_decay must be >= 0, got ", p.weight_decay);
  backend_for(d).adam_advance_step(step, lr, consts, p);
}

}  // namespace tandem::kernels
