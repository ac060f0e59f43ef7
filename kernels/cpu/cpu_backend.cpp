// The CPU backend instance and the device -> backend map.
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"

namespace tandem {

namespace cpu {

// Every virtual CPU device shares host memory, so a copy between cpu:i and cpu:j is a plain
// memcpy. Anything touching a GPU belongs to the CUDA backend.
void CpuBackend::memcpy(void* dst, Device dst_device, const void* src, Device src_device,
                        size_t nbytes) {
  TANDEM_CHECK(dst_device.is_cpu() && src_device.is_cpu(), Device,
               "cpu backend memcpy: cannot copy from ", src_device.str(), " to ", dst_device.str(),
               "; copies involving a GPU go through the CUDA backend");
  if (nbytes > 0 && dst != src) std::memcpy(dst, src, nbytes);
}

}  // namespace cpu

Backend& cpu_backend() {
  // Stateless, so one instance serves every thread and every virtual CPU device.
  static cpu::CpuBackend backend;
  return backend;
}

#ifndef TANDEM_WITH_CUDA
Backend& cuda_backend() {
  TANDEM_THROW(Device, "tandem was built without CUDA support");
}
#endif

Backend& backend_for(Device d) {
  return d.is_cuda() ? cuda_backend() : cpu_backend();
}

}  // namespace tandem
