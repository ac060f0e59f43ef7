#include "autograd/grad_mode.h"

namespace tandem {

namespace {
// One flag per host thread: each replica thread in parallel code decides for itself whether
// it records history.
thread_local bool t_grad_enabled = true;
}  // namespace

bool grad_enabled() {
  return t_grad_enabled;
}
void set_grad_enabled(bool enabled) {
  t_grad_enabled = enabled;
}

}  // namespace tandem
