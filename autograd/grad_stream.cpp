// Weight gradients on a second stream: Note [weight gradients on a second stream] in
// autograd/grad_stream.h.
#include "autograd/grad_stream.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "core/cuda_graph.h"

namespace tandem::autograd {

namespace {

std::atomic<bool>& flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TANDEM_WGRAD_STREAM");
    return v == nullptr || v[0] == '\0' || v[0] == '1';
  }()};
  return on;
}

std::atomic<int64_t> g_forks{0};

// The side stream's priority (Note [stream priorities]): Normal, the main stream's, unless
// TANDEM_WGRAD_STREAM_BACKGROUND=1; read when a thread first forks on a device.
StreamPriority side_priority() {
  const char* v = std::getenv("TANDEM_WGRAD_STREAM_BACKGROUND");
  return v != nullptr && v[0] == '1' ? StreamPriority::Background : StreamPriority::Normal;
}

// A thread's side stream of one device and its two events: the fork (recorded on the main
// stream, waited for by the side stream) and the end of the side stream's last work (waited
// for by the join). An event may be recorded again once its waits are enqueued, so two are
// enough. Kept for the life of the process, as streams are: destroying them at exit would
// race with the runtime's own teardown.
struct Side {
  Stream stream;
  Event fork;
  Event done;
  Event mark;  // the side stream's work up to the last release point (release_weight_grad_inputs)
};

Side& side_of(Device d) {
  thread_local std::vector<Side*>* sides = new std::vector<Side*>();
  if (static_cast<int>(sides->size()) <= d.index) sides->resize(d.index + 1, nullptr);
  Side*& s = (*sides)[d.index];
  if (s == nullptr) s = new Side{Stream::create(d, side_priority()), Event(), Event(), Event()};
  return *s;
}

thread_local WeightGradStreamScope* t_scope = nullptr;

std::atomic<bool>& lagged_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TANDEM_WGRAD_LAGGED_RELEASE");
    return v == nullptr || v[0] == '\0' || v[0] == '1';
  }()};
  return on;
}

std::atomic<bool>& after_input_flag() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("TANDEM_WGRAD_AFTER_DGRAD");
    return v != nullptr && v[0] == '1';
  }()};
  return on;
}

}  // namespace

bool weight_grad_after_input_grad() { return after_input_flag().load(std::memory_order_relaxed); }
void set_weight_grad_after_input_grad(bool on) { after_input_flag().store(on, std::memory_order_relaxed); }

bool weight_grad_lagged_release() { return lagged_flag().load(std::memory_order_relaxed); }
void set_weight_grad_lagged_release(bool on) { lagged_flag().store(on, std::memory_order_relaxed); }

bool weight_grad_stream() { return flag().load(std::memory_order_relaxed); }
void set_weight_grad_stream(bool on) { flag().store(on, std::memory_order_relaxed); }
int64_t weight_grad_stream_forks() { return g_forks.load(std::memory_order_relaxed); }

WeightGradStream::WeightGradStream(Device device, std::initializer_list<Tensor> keep) : device_(device) {
  if (t_scope == nullptr || !device.is_cuda() || !weight_grad_stream()) return;
  Side& side = side_of(device);
  const Stream main = current_stream(device);
  if (main == side.stream) return;  // already on it
  fork_stream(main, side.stream, side.fork);
  WeightGradStreamScope::Pending* pending = nullptr;
  for (auto& p : t_scope->devices_) {
    if (p.device == device) pending = &p;
  }
  if (pending == nullptr) pending = &t_scope->devices_.emplace_back(WeightGradStreamScope::Pending{device, {}, {}});
  pending->keep.insert(pending->keep.end(), keep.begin(), keep.end());
  prev_ = main;
  set_current_stream(side.stream);
  forked_ = true;
  g_forks.fetch_add(1, std::memory_order_relaxed);
}

WeightGradStream::~WeightGradStream() {
  if (!forked_) return;
  set_current_stream(prev_);
  try {
    Side& side = side_of(device_);
    side.done.record(side.stream);
  } catch (const std::exception& e) {  // the device is broken; the next call on it reports it
    std::fprintf(stderr, "tandem: the weight-gradient stream's end could not be recorded: %s\n", e.what());
  }
}

void join_weight_grad_streams() {
  if (t_scope != nullptr && t_scope->pending()) t_scope->join();
}

void release_weight_grad_inputs() {
  if (t_scope == nullptr || !t_scope->pending()) return;
  if (weight_grad_lagged_release()) {
    t_scope->release_marked();
  } else {
    t_scope->join();
  }
}

WeightGradStreamScope::WeightGradStreamScope() : prev_(t_scope) { t_scope = this; }

WeightGradStreamScope::~WeightGradStreamScope() {
  try {
    join();
  } catch (const std::exception& e) {  // unwinding already, or a broken device
    std::fprintf(stderr, "tandem: joining the weight-gradient stream failed: %s\n", e.what());
  }
  t_scope = prev_;
}

void WeightGradStreamScope::join() {
  for (const Pending& p : devices_) {
    Side& side = side_of(p.device);
    const Stream main = current_stream(p.device);
    if (main != side.stream) side.done.wait(main);
  }
  devices_.clear();  // the kept tensors go now: their frees are ordered after the wait
}

void WeightGradStreamScope::release_marked() {
  for (Pending& p : devices_) {
    Side& side = side_of(p.device);
    const Stream main = current_stream(p.device);
    if (main == side.stream) continue;
    if (!p.marked.empty()) {
      side.mark.wait(main);  // the side stream's work up to the last mark, which read these
      p.marked.clear();      // their frees are ordered after the wait
    }
    if (!p.keep.empty()) {  // no scope is open: every kernel reading them is enqueued
      side.mark.record(side.stream);
      p.marked = std::move(p.keep);
      p.keep.clear();
    }
  }
}

}  // namespace tandem::autograd
