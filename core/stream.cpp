#include "core/stream.h"

#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace tandem {

namespace {

#ifdef TANDEM_WITH_CUDA
// The CUDA priority of a level (Note [stream priorities]) on the current device: lower numbers
// run first; Normal is one above the lowest, leaving the lowest to Background.
int cuda_priority(StreamPriority p) {
  int lowest = 0, greatest = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &greatest));
  switch (p) {
    case StreamPriority::Background: return lowest;
    case StreamPriority::High: return greatest;
    case StreamPriority::Normal: break;
  }
  return greatest < lowest ? lowest - 1 : lowest;
}

// Default streams, one per device, created on first use and kept for the process lifetime
// (destroying streams at exit races with other static destructors; the driver reclaims them).
std::mutex g_stream_mu;
std::vector<cudaStream_t> g_default_streams;

cudaStream_t default_cuda_stream(int index) {
  std::lock_guard<std::mutex> lock(g_stream_mu);
  if (static_cast<int>(g_default_streams.size()) <= index) g_default_streams.resize(index + 1, nullptr);
  if (!g_default_streams[index]) {
    DeviceGuard g(Device::cuda(index));
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, cuda_priority(StreamPriority::Normal)));
    g_default_streams[index] = s;
  }
  return g_default_streams[index];
}
#endif

// Thread-local current stream per CUDA device; absent = the default stream.
thread_local std::map<int, void*> tls_streams;

}  // namespace

Stream Stream::default_stream(Device d) {
#ifdef TANDEM_WITH_CUDA
  if (d.is_cuda()) {
    check_device_exists(d);
    return Stream(d, default_cuda_stream(d.index));
  }
#endif
  check_device_exists(d);
  return Stream(d, nullptr);
}

Stream Stream::create(Device d, StreamPriority priority) {
#ifdef TANDEM_WITH_CUDA
  if (d.is_cuda()) {
    check_device_exists(d);
    DeviceGuard g(d);
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, cuda_priority(priority)));
    return Stream(d, s);
  }
#endif
  (void)priority;
  return Stream(d, nullptr);
}

void Stream::synchronize() const {
#ifdef TANDEM_WITH_CUDA
  if (device_.is_cuda()) {
    DeviceGuard g(device_);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
  }
#endif
}

bool Stream::query() const {
#ifdef TANDEM_WITH_CUDA
  if (device_.is_cuda()) {
    cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(handle_));
    if (e == cudaErrorNotReady) return false;
    TANDEM_CUDA_CHECK(e);
  }
#endif
  return true;
}

Stream current_stream(Device d) {
  if (d.is_cuda()) {
    auto it = tls_streams.find(d.index);
    if (it != tls_streams.end()) return Stream(d, it->second);
    // Every op asks for its stream several times; the default streams never change once
    // created, so each thread remembers them instead of taking the global lock each time
    // (device worker threads would otherwise contend for it on every launch).
    thread_local std::vector<void*> defaults;
    if (d.index >= 0 && d.index < static_cast<int>(defaults.size()) && defaults[d.index]) {
      return Stream(d, defaults[d.index]);
    }
    Stream s = Stream::default_stream(d);
    if (static_cast<int>(defaults.size()) <= d.index) defaults.resize(d.index + 1, nullptr);
    defaults[d.index] = s.handle();
    return s;
  }
  return Stream::default_stream(d);
}

void set_current_stream(Stream s) {
  if (s.device().is_cuda()) tls_streams[s.device().index] = s.handle();
}

StreamGuard::StreamGuard(Stream s) : prev_(current_stream(s.device())) { set_current_stream(s); }
StreamGuard::~StreamGuard() { set_current_stream(prev_); }

// ---- events ------------------------------------------------------------------------------

Event::Event(bool enable_timing) : timing_(enable_timing) {}

Event::~Event() {
#ifdef TANDEM_WITH_CUDA
  if (handle_) TANDEM_CUDA_CHECK_LOG(cudaEventDestroy(static_cast<cudaEvent_t>(handle_)));
#endif
}

Event::Event(Event&& o) noexcept { *this = std::move(o); }

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
#ifdef TANDEM_WITH_CUDA
    if (handle_) TANDEM_CUDA_CHECK_LOG(cudaEventDestroy(static_cast<cudaEvent_t>(handle_)));
#endif
    handle_ = o.handle_;
    device_ = o.device_;
    timing_ = o.timing_;
    recorded_ = o.recorded_;
    host_time_ = o.host_time_;
    o.handle_ = nullptr;
    o.recorded_ = false;
  }
  return *this;
}

void Event::record(Stream s) {
#ifdef TANDEM_WITH_CUDA
  if (s.device().is_cuda()) {
    DeviceGuard g(s.device());
    if (handle_ && device_ != s.device()) {
      TANDEM_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(handle_)));
      handle_ = nullptr;
    }
    if (!handle_) {
      cudaEvent_t e;
      TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing_ ? cudaEventDefault : cudaEventDisableTiming));
      handle_ = e;
    }
    TANDEM_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), static_cast<cudaStream_t>(s.handle())));
  }
#endif
  device_ = s.device();
  host_time_ = std::chrono::steady_clock::now();
  recorded_ = true;
}

void Event::wait(Stream s) const {
  if (!recorded_) return;  // like CUDA: waiting on a never-recorded event is a no-op
#ifdef TANDEM_WITH_CUDA
  if (device_.is_cuda() && s.device().is_cuda()) {
    DeviceGuard g(s.device());
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.handle()),
                                          static_cast<cudaEvent_t>(handle_), 0));
    return;
  }
  // A CPU stream waiting for a CUDA event: CPU work is synchronous, so block the host.
  if (device_.is_cuda()) synchronize();
#endif
}

void Event::synchronize() const {
#ifdef TANDEM_WITH_CUDA
  if (recorded_ && device_.is_cuda()) TANDEM_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
#endif
}

bool Event::query() const {
#ifdef TANDEM_WITH_CUDA
  if (recorded_ && device_.is_cuda()) {
    cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
    if (e == cudaErrorNotReady) return false;
    TANDEM_CUDA_CHECK(e);
  }
#endif
  return true;
}

float Event::elapsed_ms(const Event& end) const {
  TANDEM_CHECK(recorded_ && end.recorded_, Value, "Event::elapsed_ms: both events must be recorded");
  TANDEM_CHECK(device_ == end.device_, Device, "Event::elapsed_ms: events on ", device_.str(), " and ",
               end.device_.str());
#ifdef TANDEM_WITH_CUDA
  if (device_.is_cuda()) {
    TANDEM_CHECK(timing_ && end.timing_, Value, "Event::elapsed_ms: events need enable_timing");
    end.synchronize();
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(handle_),
                                           static_cast<cudaEvent_t>(end.handle_)));
    return ms;
  }
#endif
  return std::chrono::duration<float, std::milli>(end.host_time_ - host_time_).count();
}

}  // namespace tandem
