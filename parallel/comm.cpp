#include "parallel/comm.h"

#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/device_api.h"

namespace tandem::parallel {

Communicator::Communicator(std::vector<Device> devices) : devices_(std::move(devices)) {
  check_device_list(devices_, "communicator");
  enable_peer_access(devices_);  // peer copies over NVLink, not through the host
}

void Communicator::check_tensors(const char* op, const std::vector<Tensor>& ts) const {
  TANDEM_CHECK(ts.size() == devices_.size(), Value, op, " (", name(), "): ", ts.size(),
               " tensors for ", devices_.size(), " devices ", devices_str(devices_),
               "; pass one tensor per device");
  for (size_t i = 0; i < ts.size(); ++i) {
    TANDEM_CHECK(ts[i].defined(), Value, op, " (", name(), "): tensor ", i, " is undefined");
    TANDEM_CHECK(ts[i].device() == devices_[i], Device, op, " (", name(), "): tensor ", i,
                 " is on ", ts[i].device().str(), " but device ", i, " of the communicator is ",
                 devices_[i].str());
    TANDEM_CHECK(ts[i].shape() == ts[0].shape(), Shape, op, " (", name(), "): tensor ", i, " is ",
                 shape_str(ts[i].shape()), " but tensor 0 is ", shape_str(ts[0].shape()));
    TANDEM_CHECK(ts[i].dtype() == ts[0].dtype(), DType, op, " (", name(), "): tensor ", i, " is ",
                 dtype_name(ts[i].dtype()), " but tensor 0 is ", dtype_name(ts[0].dtype()));
  }
}

void Communicator::reduce_sum(const std::vector<Tensor>& ts, size_t root) {
  check_tensors("reduce_sum", ts);
  check_root("reduce_sum", root);
  const Device home = devices_[root];
  DeviceGuard guard(home);
  for (size_t i = 0; i < ts.size(); ++i) {
    if (i == root) continue;
    Tensor incoming = ts[i].to(home);  // [same shape] on the root's device
    kernels::binary_(BinaryOp::Add, ts[root], incoming);
  }
}

void Communicator::check_root(const char* op, size_t root) const {
  TANDEM_CHECK(root < devices_.size(), Value, op, " (", name(), "): root ", root,
               " out of range for ", devices_.size(), " devices");
}

std::unique_ptr<Communicator> make_communicator(const std::string& name,
                                                const std::vector<Device>& devices) {
  if (name == "naive") return std::make_unique<NaiveCommunicator>(devices);
  if (name == "ring") return std::make_unique<RingCommunicator>(devices);
  if (name == "nccl") return std::make_unique<NcclCommunicator>(devices);
  TANDEM_THROW(Value, "make_communicator: unknown communicator '", name,
               "'; expected naive, ring or nccl");
}

std::vector<std::string> communicator_names(const std::vector<Device>& devices) {
  std::vector<std::string> names = {"naive", "ring"};
  if (!devices.empty() && devices[0].is_cuda() && nccl_available() && !shares_a_gpu(devices))
    names.push_back("nccl");
  return names;
}

Tensor flat_view(const Tensor& t) {
  return t.is_contiguous() ? t.view({t.numel()}) : t.contiguous().view({t.numel()});
}

void copy_back_if_needed(const Tensor& t, const Tensor& flat) {
  if (!t.is_contiguous()) t.copy_(flat.view(t.shape()));
}

}  // namespace tandem::parallel
