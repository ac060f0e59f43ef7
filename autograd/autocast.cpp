#include "autograd/autocast.h"

#include "autograd/ops.h"
#include "core/error.h"

namespace tandem {

namespace {
// Per host thread, like grad mode: one replica's thread never changes another's precision.
thread_local bool t_autocast_enabled = false;
thread_local DType t_autocast_dtype = kBFloat16;
}  // namespace

bool is_autocast_enabled() {
  return t_autocast_enabled;
}

DType autocast_dtype() {
  return t_autocast_dtype;
}

void set_autocast_enabled(bool enabled) {
  t_autocast_enabled = enabled;
}

void set_autocast_dtype(DType dtype) {
  TANDEM_CHECK(dtype == kBFloat16, DType, "autocast: the autocast dtype must be bfloat16, got ",
               dtype_name(dtype));
  t_autocast_dtype = dtype;
}

AutocastGuard::AutocastGuard(DType dtype, bool enabled)
    : prev_enabled_(t_autocast_enabled), prev_dtype_(t_autocast_dtype) {
  set_autocast_dtype(dtype);  // checks before anything changes
  set_autocast_enabled(enabled);
}

AutocastGuard::~AutocastGuard() {
  t_autocast_enabled = prev_enabled_;
  t_autocast_dtype = prev_dtype_;
}

Tensor autocast_input(const Tensor& x) {
  if (!t_autocast_enabled || !x.defined() || x.dtype() != kFloat32) return x;
  return to(x, t_autocast_dtype);
}

Tensor autocast_float32(const Tensor& x) {
  if (!t_autocast_enabled || !x.defined() || x.dtype() != t_autocast_dtype) return x;
  return to(x, kFloat32);
}

}  // namespace tandem
