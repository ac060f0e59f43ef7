#include "kernels/cuda/handles.h"

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_stream.h"

namespace tandem::gpu {
namespace {

// cuBLAS on Hopper recommends a 32 MiB workspace.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

struct HandleSet {
  cublasHandle_t cublas = nullptr;
  cudnnHandle_t cudnn = nullptr;
  std::unordered_map<cudaStream_t, void*> cublas_workspace;  // one per stream, never freed
};

// Handle sets not owned by any live thread, per device index (see Note [handle lifetime]).
// Deliberately leaked so that it outlives every thread_local destructor.
struct HandlePool {
  std::mutex mu;
  std::vector<std::vector<HandleSet*>> free;

  HandleSet* take(int device) {
    std::lock_guard<std::mutex> lock(mu);
    if (device < static_cast<int>(free.size()) && !free[device].empty()) {
      HandleSet* h = free[device].back();
      free[device].pop_back();
      return h;
    }
    return new HandleSet();
  }
  void give(int device, HandleSet* h) {
    std::lock_guard<std::mutex> lock(mu);
    if (device >= static_cast<int>(free.size())) free.resize(device + 1);
    free[device].push_back(h);
  }
};

HandlePool& pool() {
  static HandlePool* p = new HandlePool();
  return *p;
}

// The handle sets this thread holds, by device index; returned to the pool at thread exit.
struct ThreadHandles {
  std::vector<HandleSet*> by_device;
  ~ThreadHandles() {
    for (size_t d = 0; d < by_device.size(); ++d) {
      if (by_device[d] != nullptr) pool().give(static_cast<int>(d), by_device[d]);
    }
  }
  HandleSet& get(Device d) {
    TANDEM_CHECK(d.is_cuda(), Device, "cuBLAS/cuDNN handle requested for ", d.str());
    if (d.index >= static_cast<int>(by_device.size())) by_device.resize(d.index + 1, nullptr);
    HandleSet*& h = by_device[d.index];
    if (h == nullptr) h = pool().take(d.index);
    return *h;
  }
};

thread_local ThreadHandles tls_handles;

}  // namespace

cublasHandle_t cublas_handle(Device d) {
  HandleSet& h = tls_handles.get(d);
  if (h.cublas == nullptr) {
    TANDEM_CUBLAS_CHECK(cublasCreate(&h.cublas));
    TANDEM_CUBLAS_CHECK(cublasSetMathMode(h.cublas, CUBLAS_DEFAULT_MATH));
    TANDEM_CUBLAS_CHECK(cublasSetPointerMode(h.cublas, CUBLAS_POINTER_MODE_HOST));
  }
  cudaStream_t stream = current_cuda_stream(d);
  // cublasSetStream resets the workspace to cuBLAS's own, so set ours again after it.
  TANDEM_CUBLAS_CHECK(cublasSetStream(h.cublas, stream));
  // The workspace is library state, not a tensor: it comes straight from the device's
  // stream-ordered pool rather than allocate(), so allocated_bytes() still counts only tensors.
  // Made on first use on a stream: run a step eagerly before capturing it into a CUDA graph.
  void*& ws = h.cublas_workspace[stream];
  if (ws == nullptr) TANDEM_CUDA_CHECK(cudaMallocAsync(&ws, kCublasWorkspaceBytes, stream));
  TANDEM_CUBLAS_CHECK(cublasSetWorkspace(h.cublas, ws, kCublasWorkspaceBytes));
  return h.cublas;
}

cudnnHandle_t cudnn_handle(Device d) {
  HandleSet& h = tls_handles.get(d);
  if (h.cudnn == nullptr) TANDEM_CUDNN_CHECK(cudnnCreate(&h.cudnn));
  TANDEM_CUDNN_CHECK(cudnnSetStream(h.cudnn, current_cuda_stream(d)));
  return h.cudnn;
}

}  // namespace tandem::gpu
