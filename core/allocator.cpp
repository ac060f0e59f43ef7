#include "core/allocator.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace tandem {

namespace {

constexpr int kMaxTrackedDevices = 64;
std::atomic<int64_t> g_cpu_bytes{0};
std::atomic<int64_t> g_cuda_bytes[kMaxTrackedDevices];

DataPtr allocate_cpu(size_t nbytes) {
  // 64-byte alignment: whole cache lines, and what AVX-512 loads like.
  size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
  TANDEM_CHECK(p || rounded == 0, Error, "out of host memory allocating ", nbytes, " bytes");
  g_cpu_bytes += static_cast<int64_t>(nbytes);
  return DataPtr(p, [nbytes](void* q) {
    std::free(q);
    g_cpu_bytes -= static_cast<int64_t>(nbytes);
  });
}

#ifdef TANDEM_WITH_CUDA
// Raises the release threshold of the device's default pool once, so memory freed with
// cudaFreeAsync stays cached in the pool rather than returning to the driver at every sync.
// Runs on every allocation: the common case is one atomic load, no lock.
std::atomic<bool> g_pool_ready[kMaxTrackedDevices];

void prepare_pool(int index) {
  if (g_pool_ready[index].load(std::memory_order_acquire)) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_pool_ready[index].load(std::memory_order_relaxed)) return;
  cudaMemPool_t pool;
  TANDEM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, index));
  uint64_t threshold = UINT64_MAX;
  TANDEM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  g_pool_ready[index].store(true, std::memory_order_release);
}

DataPtr allocate_cuda(Device d, size_t nbytes) {
  check_device_exists(d);
  TANDEM_CHECK(d.index < kMaxTrackedDevices, Device, "device ", d.str(), " index too large");
  DeviceGuard guard(d);
  prepare_pool(d.index);
  if (nbytes == 0) return DataPtr(nullptr, [](void*) {});
  cudaStream_t stream = current_cuda_stream(d);
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, nbytes, stream);
  TANDEM_CHECK(err == cudaSuccess, Cuda, "out of memory on ", d.str(), " allocating ", nbytes,
               " bytes (", cudaGetErrorString(err), ")");
  g_cuda_bytes[d.index] += static_cast<int64_t>(nbytes);
  // See Note [stream-ordered free] in allocator.h: free on the allocating stream.
  return DataPtr(p, [d, stream, nbytes](void* q) {
    DeviceGuard g(d);
    TANDEM_CUDA_CHECK_LOG(cudaFreeAsync(q, stream));
    g_cuda_bytes[d.index] -= static_cast<int64_t>(nbytes);
  });
}
#endif

}  // namespace

DataPtr allocate(Device d, size_t nbytes) {
  if (d.is_cpu()) return allocate_cpu(nbytes);
#ifdef TANDEM_WITH_CUDA
  return allocate_cuda(d, nbytes);
#else
  check_device_exists(d);  // throws: built without CUDA
  return nullptr;
#endif
}

size_t allocated_bytes(Device d) {
  if (d.is_cpu()) return static_cast<size_t>(g_cpu_bytes.load());
  if (d.index < 0 || d.index >= kMaxTrackedDevices) return 0;
  return static_cast<size_t>(g_cuda_bytes[d.index].load());
}

}  // namespace tandem
