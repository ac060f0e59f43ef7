// The CUDA backend instance, and memcpy between any two devices.
#include "kernels/cuda/cuda_backend.h"

#include <cstring>

#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#include "core/device.h"

namespace tandem {

// Each copy is enqueued on one stream and ordered only there:
// - CPU -> GPU: the destination's current stream. tandem's host memory is pageable, which the
//   driver stages before the call returns, so the host buffer may be reused at once.
// - GPU -> CPU: the source's current stream, then the host waits for that stream, so the
//   bytes are in place when the call returns.
// - GPU -> GPU (same or another device): the destination's current stream (a peer copy for
//   two devices; it goes through NVLink when peer access is enabled, through the host
//   otherwise). Ordering against the source device's stream is the caller's business:
//   Tensor::copy_ does it with events (Note [cross-device ordering] in kernels/tensor_methods.cpp).
void CudaBackend::memcpy(void* dst, Device dst_device, const void* src, Device src_device,
                         size_t nbytes) {
  if (nbytes == 0 || (dst == src && dst_device == src_device)) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  if (src_device.is_cpu()) {
    DeviceGuard guard(dst_device);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice,
                                      current_cuda_stream(dst_device)));
    return;
  }
  if (dst_device.is_cpu()) {
    DeviceGuard guard(src_device);
    cudaStream_t stream = current_cuda_stream(src_device);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  DeviceGuard guard(dst_device);
  cudaStream_t stream = current_cuda_stream(dst_device);
  // Two logical devices on one GPU copy like one device (Note [virtual CUDA devices]).
  const int dst_gpu = physical_cuda_index(dst_device), src_gpu = physical_cuda_index(src_device);
  if (dst_gpu == src_gpu) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    TANDEM_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_gpu, src, src_gpu, nbytes, stream));
  }
}

Backend& cuda_backend() {
  // Stateless (handles and plans are per thread), so one instance serves every thread.
  static CudaBackend backend;
  return backend;
}

}  // namespace tandem
