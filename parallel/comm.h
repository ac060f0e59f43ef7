#pragma once
// Communicators: collective operations over the devices of one process.
//
// All three implementations share one contract, so they can be swapped and tested against
// each other:
//   - allreduce_sum(ts): ts[i] lives on devices()[i]; all have the same shape and dtype.
//     Afterwards every ts[i] holds the elementwise sum over i. In place.
//   - broadcast(ts, root): afterwards every ts[i] holds ts[root]'s values.
//   - reduce_sum(ts, root): afterwards ts[root] holds the sum; the others are unspecified
//     (DataParallel's backward: the replicas' gradients summed onto the main device).
//   - Stream-ordered: the operation runs after the work already queued on the *calling
//     thread's* current stream of each device, and work queued there afterwards sees the
//     result. Nothing synchronizes the host (on virtual CPU devices everything is simply
//     synchronous).
//   - One caller at a time (a communicator keeps per-call scratch state).
//
// NaiveCommunicator (comm_naive.cpp): copy everything to device 0, sum, copy back. Device 0's
//   link carries 2(n-1) full buffers while the others idle: simple, and slow for n > 2.
// RingCommunicator (comm_ring.cpp): reduce-scatter + all-gather around a ring of peer copies,
//   written with Tensor::copy_ and kernels, so it runs on virtual CPU devices and GPUs alike.
//   Bandwidth-optimal (see Note [ring allreduce cost] there).
// NcclCommunicator (comm_nccl.cpp): ncclCommInitAll for the process's GPUs, ncclAllReduce in
//   one group call. What you use on GPUs; the other two exist to be read and compared.
#include <memory>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace tandem::parallel {

class Communicator {
 public:
  // Throws for an invalid device list (see check_device_list).
  explicit Communicator(std::vector<Device> devices);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual void allreduce_sum(const std::vector<Tensor>& tensors) = 0;
  virtual void broadcast(const std::vector<Tensor>& tensors, size_t root) = 0;
  // The default copies every other tensor to the root's device and adds it there (the first
  // half of the naive allreduce); NCCL overrides it with ncclReduce.
  virtual void reduce_sum(const std::vector<Tensor>& tensors, size_t root);
  virtual std::string name() const = 0;

  const std::vector<Device>& devices() const { return devices_; }
  size_t size() const { return devices_.size(); }

 protected:
  // Throws (naming the communicator, op and the offending values) unless there is one
  // defined tensor per device, on that device, all of one shape and dtype.
  void check_tensors(const char* op, const std::vector<Tensor>& tensors) const;
  void check_root(const char* op, size_t root) const;

 private:
  std::vector<Device> devices_;
};

class NaiveCommunicator : public Communicator {
 public:
  using Communicator::Communicator;
  void allreduce_sum(const std::vector<Tensor>& tensors) override;
  void broadcast(const std::vector<Tensor>& tensors, size_t root) override;
  std::string name() const override { return "naive"; }
};

class RingCommunicator : public Communicator {
 public:
  explicit RingCommunicator(std::vector<Device> devices);
  void allreduce_sum(const std::vector<Tensor>& tensors) override;
  void broadcast(const std::vector<Tensor>& tensors, size_t root) override;
  std::string name() const override { return "ring"; }

 private:
  struct Ring;  // the state of one collective (comm_ring.cpp)
  std::vector<Stream> recv_streams_;  // per device: where incoming copies run
  std::vector<Event> ready_, received_;  // per device, reused every step
};

class NcclCommunicator : public Communicator {
 public:
  // NcclError when tandem was built without NCCL; DeviceError for CPU devices (use "naive"
  // or "ring" there) or devices that do not exist. Sets NCCL_NVLS_ENABLE=0 in the process
  // environment unless it is already set (NVLink multicast stays off).
  explicit NcclCommunicator(std::vector<Device> devices);
  ~NcclCommunicator() override;  // destroys the communicators (errors are only logged)
  void allreduce_sum(const std::vector<Tensor>& tensors) override;
  void broadcast(const std::vector<Tensor>& tensors, size_t root) override;
  void reduce_sum(const std::vector<Tensor>& tensors, size_t root) override;
  std::string name() const override { return "nccl"; }

 private:
  std::vector<void*> comms_;  // ncclComm_t per device
};

// "naive", "ring" or "nccl". ValueError for another name; the constructors' errors otherwise.
std::unique_ptr<Communicator> make_communicator(const std::string& name,
                                                const std::vector<Device>& devices);
// The names make_communicator accepts that work on `devices` in this build ("nccl" only for
// CUDA devices when tandem has NCCL).
std::vector<std::string> communicator_names(const std::vector<Device>& devices);

// Shared by the implementations: a contiguous 1-D view of t (t's own storage when t
// is contiguous, else a contiguous copy), and writing such a copy back into t.
Tensor flat_view(const Tensor& t);
void copy_back_if_needed(const Tensor& t, const Tensor& flat);

}  // namespace tandem::parallel
