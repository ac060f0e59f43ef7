#pragma once
// Streams and events: the ordering primitives every device op is built on.
//
// Every op enqueues its work on the *current stream* of its device. The current stream is
// thread-local per device and defaults to the device's default stream: one non-blocking
// stream per CUDA device that tandem creates on first use (never CUDA's legacy stream 0, which
// would serialize with everything and cannot be captured into a graph). StreamGuard switches
// it for a scope, e.g. to run communication on its own stream.
//
// On CPU devices work is synchronous on the calling thread: a CPU stream has a null handle,
// and a CPU event records a host timestamp, so timing and ordering code is the same on both.
#include <chrono>
#include <cstdint>

#include "core/device.h"

namespace tandem {

// Note [stream priorities]: where two streams of a device both have blocks ready to run, the
// GPU starts those of the higher-priority stream first. tandem uses three levels: the default
// streams, and streams created without asking for more, are Normal; a process group's
// communication stream may be High (its collectives then cut in); Background is below the
// default streams, for work that should only fill what they leave idle -- a backward pass's
// weight gradients, which nothing waits for until the step's end, where asked for (Note [weight
// gradients on a second stream] in autograd/grad_stream.h). A CUDA graph keeps each captured kernel's priority
// (core/cuda_graph.cpp instantiates with per-node priorities). Where the device offers fewer
// levels, neighbouring ones coincide.
enum class StreamPriority { Background, Normal, High };

class Stream {
 public:
  Stream() = default;
  Stream(Device device, void* handle) : device_(device), handle_(handle) {}

  // The default stream of a device (created on first use for CUDA).
  static Stream default_stream(Device d);
  // A new stream on d, owned by tandem for the life of the process (pooled).
  static Stream create(Device d, StreamPriority priority = StreamPriority::Normal);
  static Stream create(Device d, bool high_priority) {
    return create(d, high_priority ? StreamPriority::High : StreamPriority::Normal);
  }

  Device device() const { return device_; }
  void* handle() const { return handle_; }  // cudaStream_t; nullptr on CPU
  void synchronize() const;  // host waits for this stream
  bool query() const;        // true when all queued work is done

  friend bool operator==(const Stream& a, const Stream& b) {
    return a.device_ == b.device_ && a.handle_ == b.handle_;
  }

 private:
  Device device_{};
  void* handle_ = nullptr;
};

// Current stream of device d on this thread.
Stream current_stream(Device d);
void set_current_stream(Stream s);

class StreamGuard {
 public:
  explicit StreamGuard(Stream s);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream prev_;
};

// A point in a stream. record() marks it, wait() makes another stream wait for it without
// blocking the host, synchronize() blocks the host, elapsed_ms() times between two events.
class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream s);
  void record() { record(current_stream(device_)); }  // on the current stream of the last device
  void wait(Stream s) const;  // s waits for this event (no host sync)
  void synchronize() const;
  bool query() const;
  // Milliseconds from this event to `end`. Both must have been recorded with timing enabled
  // on the same device; synchronizes on `end`.
  float elapsed_ms(const Event& end) const;
  Device device() const { return device_; }
  bool recorded() const { return recorded_; }

 private:
  void* handle_ = nullptr;  // cudaEvent_t, created lazily for the device it is recorded on
  Device device_{};
  bool timing_ = false;
  bool recorded_ = false;
  std::chrono::steady_clock::time_point host_time_{};
};

}  // namespace tandem
