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
#include "core/cuda_stream.h"
#include "parallel/nccl_types.h"
#endif

namespace tandem::parallel {

namespace {
void require_cuda_devices(const std::vector<Device>& devices) {
  for (size_t i = 0; i < devices.size(); ++i) {
    const Device d = devices[i];
    TANDEM_CHECK(d.is_cuda(), Device, "nccl communicator: ", d.str(),
                 " is a CPU device; NCCL only runs on GPUs, use the \"naive\" or \"ring\" "
                 "communicator for CPU devices");
    // NCCL refuses two ranks on one GPU ("invalid usage"); say so before it does.
    for (size_t j = 0; j < i; ++j) {
      TANDEM_CHECK(d == devices[j] || !same_physical_device(d, devices[j]), Device,
                   "nccl communicator: ", devices[j].str(), " and ", d.str(),
                   " are virtual devices on the same GPU ", physical_cuda_index(d),
                   ", and NCCL refuses two ranks on one GPU; use --comm ring or --comm naive "
                   "(the \"ring\" or \"naive\" communicator)");
    }
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
  for (Device d : this->devices()) ids.push_back(physical_cuda_index(d));
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

namespace {
// One NCCL collective over every device's tensor, in place: contiguous 1-D views (copies only
// for non-contiguous tensors, written back to `write_back` afterwards: every device, or only
// the root), one group call. enqueue(i, buf, count, type, comm, stream) calls NCCL for device i.
template <typename Enqueue>
void in_place_group_call(const char* op, const std::vector<Tensor>& ts, const std::vector<Device>& devices,
                         const std::vector<void*>& comms, int write_back, Enqueue enqueue) {
  if (ts.size() == 1 || ts[0].numel() == 0) return;
  std::vector<Tensor> flat;
  for (const Tensor& t : ts) flat.push_back(flat_view(t));
  const ncclDataType_t type = nccl_type(ts[0].dtype());
  const size_t count = static_cast<size_t>(ts[0].numel());
  group_call(op, ts.size(), [&](size_t i) {
    return enqueue(i, flat[i].raw_data(), count, type, as_comm(comms[i]), current_cuda_stream(devices[i]));
  });
  for (size_t i = 0; i < ts.size(); ++i) {
    if (write_back < 0 || static_cast<size_t>(write_back) == i) copy_back_if_needed(ts[i], flat[i]);
  }
}
}  // namespace

void NcclCommunicator::allreduce_sum(const std::vector<Tensor>& ts) {
  check_tensors("allreduce_sum", ts);
  in_place_group_call("allreduce", ts, devices(), comms_, -1,
                      [](size_t, void* buf, size_t n, ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
                        return ncclAllReduce(buf, buf, n, type, ncclSum, comm, s);
                      });
}

void NcclCommunicator::broadcast(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("broadcast", ts);
  check_root("broadcast", root);
  const int r = static_cast<int>(root);
  in_place_group_call("broadcast", ts, devices(), comms_, -1,
                      [r](size_t, void* buf, size_t n, ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
                        return ncclBroadcast(buf, buf, n, type, r, comm, s);
                      });
}

void NcclCommunicator::reduce_sum(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("reduce_sum", ts);
  check_root("reduce_sum", root);
  const int r = static_cast<int>(root);
  in_place_group_call("reduce", ts, devices(), comms_, r,
                      [r](size_t, void* buf, size_t n, ncclDataType_t type, ncclComm_t comm, cudaStream_t s) {
                        return ncclReduce(buf, buf, n, type, ncclSum, r, comm, s);
                      });
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
