#pragma once
// DeviceWorkers: one persistent host thread per device.
//
// Data-parallel training drives every device from its own host thread, so that no device
// waits for another's kernel launches (and, on virtual CPU devices, so that the devices
// really compute at the same time). The threads are started once, in the constructor, and
// reused for every step: starting threads per step would cost more than a small step.
//
//   DeviceWorkers workers({Device::cuda(0), Device::cuda(1)});
//   workers.run([&](size_t rank) { losses[rank] = step(replicas[rank], shards[rank]); });
//
// For each run(), worker `rank`:
//   - has devices[rank] as its current device (DeviceGuard semantics, cudaSetDevice with the
//     device's physical ordinal on GPUs: two workers may share a GPU, Note [virtual CUDA
//     devices] in core/device.h);
//   - uses the caller's current stream of its device, so work it enqueues is ordered after
//     what the caller enqueued (e.g. the scatter of the batch) and before what the caller
//     enqueues afterwards (e.g. the allreduce);
//   - has the caller's grad mode (grad mode is thread-local; a run under NoGradGuard records
//     no history on any device) and autocast state (a run under AutocastGuard computes its
//     matrix products in bfloat16 on every device, autograd/autocast.h).
// run() returns when every worker has finished. An exception in a worker is rethrown to the
// caller, with the same tandem error type and the message prefixed by the worker's rank and
// device; if several workers fail, the first by rank is rethrown and the message says how
// many failed. run() may be called from any thread that is not one of the workers (a nested
// run would deadlock, so it throws), and calls from several threads are serialized.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/stream.h"

namespace tandem::parallel {

class DeviceWorkers {
 public:
  // Throws for an invalid device list (see check_device_list).
  explicit DeviceWorkers(std::vector<Device> devices);
  // Stops and joins the threads (waits for a run in progress).
  ~DeviceWorkers();
  DeviceWorkers(const DeviceWorkers&) = delete;
  DeviceWorkers& operator=(const DeviceWorkers&) = delete;

  void run(const std::function<void(size_t rank)>& fn);

  size_t size() const { return devices_.size(); }
  const std::vector<Device>& devices() const { return devices_; }
  // True on one of this object's worker threads.
  bool in_worker() const;

 private:
  void loop(size_t rank);

  std::vector<Device> devices_;
  std::vector<std::thread> threads_;

  std::mutex run_mu_;  // one run() at a time
  std::mutex mu_;      // guards everything below
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;  // bumped by every run(); workers wait for a new value
  bool stop_ = false;
  const std::function<void(size_t)>* job_ = nullptr;
  bool grad_enabled_ = true;
  bool autocast_enabled_ = false;
  DType autocast_dtype_ = kBFloat16;
  std::vector<Stream> streams_;             // the caller's current stream per device
  size_t pending_ = 0;                      // workers still running the current job
  std::vector<std::exception_ptr> errors_;  // per rank, for the current job
};

}  // namespace tandem::parallel
