// NCCL for the GPUs of one process: one communicator per device from ncclCommInitAll, and
// every collective as one group call that enqueues a piece on each device's current stream.
// Compare comm_ring.cpp: NCCL runs the same ring (or a tree) with fused kernels that move and
// add in one pass, over NVLink directly.
#include <cstdlib>

#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/device_api.h"

#ifdef TANDEM_WITH_NCCL
#include <nccl.h>

#include "core/cuda_check.h"
#include "parallel/nccl_types.h"
#endif

namespace tandem::parallel {

namespace {
void require_cuda_devices(const std::vector<Device>& devices) {
  for (Device d : devices) {
    TANDEM_CHECK(d.is_cuda(), Device, "nccl communicator: ", d.str(),
                 " is a CPU device; NCCL only runs on GPUs, use the \"naive\" or \"ring\" "
                 "communicator for CPU devices");
  }
}
}  // namespace

#ifdef TANDEM_WITH_NCCL

namespace {

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }

// Runs enqueue(i) for every device inside one ncclGroupStart/End, so NCCL launches the pieces
// together (calling them one by one from a single thread would deadlock). The group is always
// closed, even when a call fails; the first failure is reported.
template <typename Enqueue>
void group_call(const char* op, size_t n, Enqueue enqueue) {
  TANDEM_NCCL_CHECK(ncclGroupStart());
  ncclResult_t first = ncclSuccess;
  size_t failed = 0;
  for (size_t i = 0; i < n; ++i) {
    ncclResult_t r = enqueue(i);
    if (r != ncclSuccess && first == ncclSuccess) {
      first = r;
      failed = i;
    }
  }
  TANDEM_NCCL_CHECK(ncclGroupEnd());
  TANDEM_CHECK(first == ncclSuccess, Nccl, "nccl ", op, " on device ", failed, " failed: ",
               ncclGetErrorString(first));
}

}  // namespace

NcclCommunicator::NcclCommunicator(std::vector<Device> devices)
    : Communicator((require_cuda_devices(devices), std::move(devices))) {
  // NVLink multicast (NVLS) must stay off on the machines tandem targets; an explicit
  // setting in the environment wins.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<int> ids;
  for (Device d : this->devices()) ids.push_back(d.index);
  std::vector<ncclComm_t> comms(ids.size());
  TANDEM_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(ids.size()), ids.data()));
  comms_.assign(comms.begin(), comms.end());
}

NcclCommunicator::~NcclCommunicator() {
  for (void* c : comms_) {
    ncclResult_t r = ncclCommDestroy(as_comm(c));
    if (r != ncclSuccess) TANDEM_LOG_ERROR("ncclCommDestroy failed: ", ncclGetErrorString(r));
  }
}

void NcclCommunicator::allreduce_sum(const std::vector<Tensor>& ts) {
  check_tensors("allreduce_sum", ts);
  if (ts.size() == 1 || ts[0].numel() == 0) return;
  std::vector<Tensor> flat;
  for (const Tensor& t : ts) flat.push_back(flat_view(t));
  const ncclDataType_t type = nccl_type(ts[0].dtype());
  const size_t count = static_cast<size_t>(ts[0].numel());
  group_call("allreduce", ts.size(), [&](size_t i) {
    void* buf = flat[i].raw_data();
    return ncclAllReduce(buf, buf, count, type, ncclSum, as_comm(comms_[i]),
                         current_cuda_stream(devices()[i]));
  });
  for (size_t i = 0; i < ts.size(); ++i) copy_back_if_needed(ts[i], flat[i]);
}

void NcclCommunicator::broadcast(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("broadcast", ts);
  check_root("broadcast", root);
  if (ts.size() == 1 || ts[0].numel() == 0) return;
  std::vector<Tensor> flat;
  for (const Tensor& t : ts) flat.push_back(flat_view(t));
  const ncclDataType_t type = nccl_type(ts[0].dtype());
  const size_t count = static_cast<size_t>(ts[0].numel());
  group_call("broadcast", ts.size(), [&](size_t i) {
    void* buf = flat[i].raw_data();
    return ncclBroadcast(buf, buf, count, type, static_cast<int>(root), as_comm(comms_[i]),
                         current_cuda_stream(devices()[i]));
  });
  for (size_t i = 0; i < ts.size(); ++i) copy_back_if_needed(ts[i], flat[i]);
}

void NcclCommunicator::reduce_sum(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("reduce_sum", ts);
  check_root("reduce_sum", root);
  if (ts.size() == 1 || ts[0].numel() == 0) return;
  std::vector<Tensor> flat;
  for (const Tensor& t : ts) flat.push_back(flat_view(t));
  const ncclDataType_t type = nccl_type(ts[0].dtype());
  const size_t count = static_cast<size_t>(ts[0].numel());
  group_call("reduce", ts.size(), [&](size_t i) {
    void* buf = flat[i].raw_data();
    return ncclReduce(buf, buf, count, type, ncclSum, static_cast<int>(root), as_comm(comms_[i]),
                      current_cuda_stream(devices()[i]));
  });
  copy_back_if_needed(ts[root], flat[root]);
}

#else  // built without NCCL

NcclCommunicator::NcclCommunicator(std::vector<Device> devices)
    : Communicator((require_cuda_devices(devices), std::move(devices))) {
  TANDEM_THROW(Nccl, "nccl communicator: tandem was built without NCCL",
               cuda_available() ? " (rebuild with NCCL found by CMake)" : "",
               "; use the \"naive\" or \"ring\" communicator");
}

NcclCommunicator::~NcclCommunicator() = default;
void NcclCommunicator::allreduce_sum(const std::vector<Tensor>&) {}
void NcclCommunicator::broadcast(const std::vector<Tensor>&, size_t) {}
void NcclCommunicator::reduce_sum(const std::vector<Tensor>&, size_t) {}

#endif

}  // namespace tandem::parallel
