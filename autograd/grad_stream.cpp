// Weight gradients on a second stream: Note [weight gradients on a second stream] in
// autograd/grad_stream.h.
#include "autograd/grad_stream.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>

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

// Note [the side stream's priority]: TANDEM_WGRAD_STREAM_BACKGROUND=1 sends every fork below
// the main stream, =0 none; unset, weight gradients of 2^30 multiply-adds or more.
std::atomic<int64_t>& background_macs() {
  static std::atomic<int64_t> macs{[] {
    const char* v = std::getenv("TANDEM_WGRAD_STREAM_BACKGROUND");
    if (v != nullptr && v[0] == '1') return int64_t{0};
    if (v != nullptr && v[0] == '0') return std::numeric_limits<int64_t>::max();
    return int64_t{1} << 30;
  }()};
  return macs;
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

Side& side_of(Device d, bool background) {
  thread_local std::vector<Side*>* sides = new std::vector<Side*>();
  const size_t at = static_cast<size_t>(d.index) * 2 + (background ? 1 : 0);
  if (sides->size() <= at) sides->resize(at + 1, nullptr);
  Side*& s = (*sides)[at];
  if (s == nullptr) {
    const StreamPriority priority = background ? StreamPriority::Background : StreamPriority::Normal;
    s = new Side{Stream::create(d, priority), Event(), Event(), Event()};
  }
  return *s;
}

// Whether s is one of d's side streams on this thread (made already).
bool is_side_stream(Device d, const Stream& s) {
  return side_of(d, false).stream == s || side_of(d, true).stream == s;
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

int64_t weight_grad_background_macs() { return background_macs().load(std::memory_order_relaxed); }
void set_weight_grad_background_macs(int64_t macs) { background_macs().store(macs, std::memory_order_relaxed); }

WeightGradStream::WeightGradStream(Device device, std::initializer_list<Tensor> keep, int64_t macs)
    : device_(device), background_(macs >= weight_grad_background_macs()) {
  if (t_scope == nullptr || !device.is_cuda() || !weight_grad_stream()) return;
  const Stream main = current_stream(device);
  if (is_side_stream(device, main)) return;  // already on one
  Side& side = side_of(device, background_);
  fork_stream(main, side.stream, side.fork);
  WeightGradStreamScope::Pending* pending = nullptr;
  for (auto& p : t_scope->devices_) {
    if (p.device == device && p.background == background_) pending = &p;
  }
  if (pending == nullptr) {
    pending = &t_scope->devices_.emplace_back(WeightGradStreamScope::Pending{device, background_, {}, {}});
  }
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
    Side& side = side_of(device_, background_);
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
    Side& side = side_of(p.device, p.background);
    const Stream main = current_stream(p.device);
    if (!is_side_stream(p.device, main)) side.done.wait(main);
  }
  devices_.clear();  // the kept tensors go now: their frees are ordered after the wait
}

void WeightGradStreamScope::release_marked() {
  for (Pending& p : devices_) {
    Side& side = side_of(p.device, p.background);
    const Stream main = current_stream(p.device);
    if (is_side_stream(p.device, main)) continue;
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
