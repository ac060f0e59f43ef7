#pragma once
// Thread-local grad mode. NoGradGuard turns recording off for a scope on this thread only,
// so one replica's evaluation never changes another thread's training.
namespace tandem {

bool grad_enabled();
void set_grad_enabled(bool enabled);

// Sets grad mode to `enabled` for a scope on this thread and restores it after (libtorch's
// AutoGradMode): AutoGradMode on(true) records gradients even under an outer NoGradGuard.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) : prev_(grad_enabled()) { set_grad_enabled(enabled); }
  ~AutoGradMode() { set_grad_enabled(prev_); }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

class NoGradGuard : public AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};

}  // namespace tandem
