#include "parallel/workers.h"

#include <cstdlib>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "core/error.h"
#include "kernels/backend.h"
#include "parallel/device_api.h"

namespace tandem::parallel {

namespace {

thread_local const DeviceWorkers* t_owner = nullptr;  // the pool this thread works for

// Rethrows `e` as the same tandem error type with `prefix` in front of its message, so a
// caller can still catch ShapeError etc. and see which device failed. Anything else becomes
// a tandem::Error.
void rethrow_with_prefix(std::exception_ptr e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) { x.rethrow_with_prefix(prefix);
  } catch (const std::exception& x) { throw Error(prefix + x.what());
  } catch (...) { throw Error(prefix + "unknown exception");
  }
}

}  // namespace

DeviceWorkers::DeviceWorkers(std::vector<Device> devices) : devices_(std::move(devices)) {
  check_device_list(devices_, "DeviceWorkers");
  // Note [one BLAS thread per virtual device] in kernels/backend.h.
  if (devices_.size() > 1 && devices_.front().is_cpu() && std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    set_cpu_blas_threads(1);
  }
  for (size_t rank = 0; rank < devices_.size(); ++rank) {
    streams_.push_back(current_stream(devices_[rank]));
  }
  errors_.resize(devices_.size());
  threads_.reserve(devices_.size());
  for (size_t rank = 0; rank < devices_.size(); ++rank) {
    threads_.emplace_back([this, rank] { loop(rank); });
  }
}

DeviceWorkers::~DeviceWorkers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

bool DeviceWorkers::in_worker() const { return t_owner == this; }

void DeviceWorkers::loop(size_t rank) {
  t_owner = this;
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    const auto* job = job_;
    const bool grad = grad_enabled_;
    const bool autocast = autocast_enabled_;
    const DType autocast_dt = autocast_dtype_;
    const Stream stream = streams_[rank];
    lock.unlock();

    std::exception_ptr error;
    try {
      // The device stays current between runs: set it only the first time.
      if (current_device() != devices_[rank]) set_current_device(devices_[rank]);
      set_grad_enabled(grad);
      set_autocast_dtype(autocast_dt);
      set_autocast_enabled(autocast);
      StreamGuard stream_guard(stream);
      (*job)(rank);
    } catch (...) {
      error = std::current_exception();
    }

    lock.lock();
    errors_[rank] = error;
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

void DeviceWorkers::run(const std::function<void(size_t rank)>& fn) {
  TANDEM_CHECK(!in_worker(), Error, "DeviceWorkers::run called from one of its own workers (",
               current_device().str(), "): a nested run would deadlock");
  std::lock_guard<std::mutex> run_lock(run_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  grad_enabled_ = grad_enabled();
  autocast_enabled_ = is_autocast_enabled();
  autocast_dtype_ = autocast_dtype();
  for (size_t rank = 0; rank < devices_.size(); ++rank) {
    streams_[rank] = current_stream(devices_[rank]);
    errors_[rank] = nullptr;
  }
  pending_ = devices_.size();
  ++generation_;
  start_cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;

  size_t failed = 0, first = 0;
  for (size_t rank = errors_.size(); rank-- > 0;) {
    if (errors_[rank]) {
      ++failed;
      first = rank;
    }
  }
  if (failed == 0) return;
  std::exception_ptr error = errors_[first];
  errors_.assign(errors_.size(), nullptr);
  lock.unlock();
  std::string prefix = detail::str("worker ", first, " (", devices_[first].str(), ")");
  if (failed > 1) prefix += detail::str(" and ", failed - 1, " more of ", devices_.size());
  rethrow_with_prefix(error, prefix + " failed: ");
}

}  // namespace tandem::parallel
