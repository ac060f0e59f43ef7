#include "core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#endif

namespace tandem {

namespace {

constexpr int kMaxTrackedDevices = 64;
std::atomic<int64_t> g_cpu_bytes{0};
std::atomic<int64_t> g_cuda_bytes[kMaxTrackedDevices];
std::atomic<int64_t> g_cpu_peak{0};
std::atomic<int64_t> g_cuda_peak[kMaxTrackedDevices];

// Adds n to `bytes` and raises `peak` to the new value when it is higher.
void count_allocation(std::atomic<int64_t>& bytes, std::atomic<int64_t>& peak, int64_t n) {
  const int64_t now = bytes.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

DataPtr allocate_cpu(size_t nbytes) {
  // 64-byte alignment: whole cache lines, and what AVX-512 loads like.
  size_t rounded = (nbytes + 63) / 64 * 64;
  void* p = rounded ? std::aligned_alloc(64, rounded) : nullptr;
  TANDEM_CHECK(p || rounded == 0, Error, "out of host memory allocating ", nbytes, " bytes");
  count_allocation(g_cpu_bytes, g_cpu_peak, static_cast<int64_t>(nbytes));
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

void prepare_pool(int index) {  // a physical ordinal: the pool is the GPU's
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

// Note [allocation under graph capture] (allocator.h). The records of the streams being
// captured and the blocks of abandoned captures, under one lock; `g_capture_users` counts
// both, so that outside captures allocate() and free pay one relaxed atomic load.
std::mutex g_capture_mu;
std::vector<CaptureMemory*> g_capturing;
std::unordered_map<void*, size_t> g_abandoned;  // graph blocks whose frees are dropped
std::atomic<int> g_capture_users{0};

void free_cuda_block(Device d, cudaStream_t stream, void* q, size_t nbytes);
#endif

}  // namespace

#ifdef TANDEM_WITH_CUDA
class CaptureMemory {
 public:
  CaptureMemory(Device d, cudaStream_t s) : device(d), stream(s) {}
  ~CaptureMemory() {
    // The graph that could read these blocks is gone (CUDAGraph destroys its executable
    // first): free them now, in stream order.
    for (const auto& [q, nbytes] : retained) free_cuda_block(device, stream, q, nbytes);
  }
  Device device;
  cudaStream_t stream;
  std::vector<cudaStream_t> joined;  // streams forked from the captured one (capture_memory_join)
  bool capturing = true;
  std::unordered_map<void*, size_t> graph_blocks;  // allocated during the capture, still held
  std::vector<std::pair<void*, size_t>> retained;  // allocated before, released during it
  std::vector<std::shared_ptr<const void>> kept;   // capture_memory_keep
};

namespace {

CaptureMemory* record_of(cudaStream_t stream) {  // under g_capture_mu
  for (CaptureMemory* r : g_capturing) {
    if (r->stream == stream || std::find(r->joined.begin(), r->joined.end(), stream) != r->joined.end()) return r;
  }
  return nullptr;
}

void free_cuda_block(Device d, cudaStream_t stream, void* q, size_t nbytes) {
  DeviceGuard g(d);
  TANDEM_CUDA_CHECK_LOG(cudaFreeAsync(q, stream));
  g_cuda_bytes[d.index] -= static_cast<int64_t>(nbytes);
}

// The free of block q of `stream` while some capture is under way or was abandoned: true
// when it was taken care of here (kept for a graph, or dropped), false for an ordinary free.
bool free_during_captures(cudaStream_t stream, void* q, size_t nbytes, Device d) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (auto it = g_abandoned.find(q); it != g_abandoned.end()) {
    g_abandoned.erase(it);
    g_capture_users.fetch_sub(1, std::memory_order_relaxed);
    g_cuda_bytes[d.index] -= static_cast<int64_t>(nbytes);
    return true;
  }
  CaptureMemory* r = record_of(stream);
  if (r == nullptr) return false;
  if (r->graph_blocks.erase(q) > 0) {
    // The graph's own block: its free becomes a free node -- unless the capture has already
    // failed (an exception unwinding the captured code), when there is no graph to free it.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusInvalidated) {
      return false;
    }
    (void)cudaGetLastError();
    g_cuda_bytes[d.index] -= static_cast<int64_t>(nbytes);
    return true;
  }
  r->retained.emplace_back(q, nbytes);
  return true;
}

DataPtr allocate_cuda(Device d, size_t nbytes) {
  check_device_exists(d);
  TANDEM_CHECK(d.index < kMaxTrackedDevices, Device, "device ", d.str(), " index too large");
  DeviceGuard guard(d);
  prepare_pool(physical_cuda_index(d));
  if (nbytes == 0) return DataPtr(nullptr, [](void*) {});
  cudaStream_t stream = current_cuda_stream(d);
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, nbytes, stream);
  TANDEM_CHECK(err == cudaSuccess, Cuda, "out of memory on ", d.str(), " allocating ", nbytes,
               " bytes (", cudaGetErrorString(err), ")");
  count_allocation(g_cuda_bytes[d.index], g_cuda_peak[d.index], static_cast<int64_t>(nbytes));
  if (g_capture_users.load(std::memory_order_relaxed) != 0) {
    std::lock_guard<std::mutex> lock(g_capture_mu);
    if (CaptureMemory* r = record_of(stream)) r->graph_blocks.emplace(p, nbytes);
  }
  // See Note [stream-ordered free] in allocator.h: free on the allocating stream.
  return DataPtr(p, [d, stream, nbytes](void* q) {
    if (g_capture_users.load(std::memory_order_relaxed) != 0 &&
        free_during_captures(stream, q, nbytes, d)) {
      return;
    }
    free_cuda_block(d, stream, q, nbytes);
  });
}

}  // namespace
#endif

DataPtr allocate(Device d, size_t nbytes) {
  if (d.is_cpu()) return allocate_cpu(nbytes);
#ifdef TANDEM_WITH_CUDA
  return allocate_cuda(d, nbytes);
#else
  check_device_exists(d);  // throws: built without CUDA
  return nullptr;
#endif
}

std::shared_ptr<CaptureMemory> capture_memory_begin(Device d, void* stream) {
#ifdef TANDEM_WITH_CUDA
  auto s = static_cast<cudaStream_t>(stream);
  auto record = std::make_shared<CaptureMemory>(d, s);
  std::lock_guard<std::mutex> lock(g_capture_mu);
  TANDEM_CHECK(record_of(s) == nullptr, Value, "graph capture: a capture of this stream of ",
               d.str(), " is already under way");
  g_capturing.push_back(record.get());
  g_capture_users.fetch_add(1, std::memory_order_relaxed);
  return record;
#else
  TANDEM_THROW(Device, "graph capture needs a CUDA build (", d.str(), ")");
#endif
}

void capture_memory_join(Device d, void* stream, void* joined) {
#ifdef TANDEM_WITH_CUDA
  const auto s = static_cast<cudaStream_t>(stream), j = static_cast<cudaStream_t>(joined);
  std::lock_guard<std::mutex> lock(g_capture_mu);
  CaptureMemory* r = record_of(s);
  if (r == nullptr || record_of(j) != nullptr) return;
  TANDEM_CHECK(r->device == d, Device, "graph capture: a stream of ", d.str(), " joined a capture on ",
               r->device.str());
  r->joined.push_back(j);
#else
  (void)d, (void)stream, (void)joined;
#endif
}

bool capture_memory_keep(Device d, void* stream, std::shared_ptr<const void> keep) {
#ifdef TANDEM_WITH_CUDA
  std::lock_guard<std::mutex> lock(g_capture_mu);
  CaptureMemory* r = record_of(static_cast<cudaStream_t>(stream));
  if (r == nullptr || r->device != d) return false;
  if (std::find(r->kept.begin(), r->kept.end(), keep) == r->kept.end()) r->kept.push_back(std::move(keep));
  return true;
#else
  (void)d, (void)stream, (void)keep;
  return false;
#endif
}

size_t capture_memory_end(CaptureMemory& record) {
#ifdef TANDEM_WITH_CUDA
  std::lock_guard<std::mutex> lock(g_capture_mu);
  if (!record.capturing) return 0;
  record.capturing = false;
  std::erase(g_capturing, &record);
  g_capture_users.fetch_sub(1, std::memory_order_relaxed);
  size_t held = 0;
  for (const auto& [q, nbytes] : record.graph_blocks) held += nbytes;
  return held;
#else
  return 0;
#endif
}

// The blocks allocated during the record's capture that live tensors still hold (after
// capture_memory_end, their frees are ordinary cudaFreeAsync calls: right once a launch of the
// graph has made them real, Note [a refused capture's memory] in core/cuda_graph.h; otherwise
// capture_memory_abandon drops them). Declared where it is used, in core/cuda_graph.cpp.
std::vector<std::pair<void*, size_t>> capture_memory_held(const CaptureMemory& record) {
#ifdef TANDEM_WITH_CUDA
  std::lock_guard<std::mutex> lock(g_capture_mu);
  return {record.graph_blocks.begin(), record.graph_blocks.end()};
#else
  (void)record;
  return {};
#endif
}

void capture_memory_abandon(CaptureMemory& record) {
#ifdef TANDEM_WITH_CUDA
  capture_memory_end(record);
  std::lock_guard<std::mutex> lock(g_capture_mu);
  for (const auto& block : record.graph_blocks) {
    g_abandoned.insert(block);
    g_capture_users.fetch_add(1, std::memory_order_relaxed);
  }
  record.graph_blocks.clear();
#endif
}

size_t max_allocated_bytes(Device d) {
  if (d.is_cpu()) return static_cast<size_t>(g_cpu_peak.load());
  if (d.index < 0 || d.index >= kMaxTrackedDevices) return 0;
  return static_cast<size_t>(g_cuda_peak[d.index].load());
}

void reset_max_allocated_bytes(Device d) {
  if (d.is_cpu()) {
    g_cpu_peak = g_cpu_bytes.load();
  } else if (d.index >= 0 && d.index < kMaxTrackedDevices) {
    g_cuda_peak[d.index] = g_cuda_bytes[d.index].load();
  }
}

size_t allocated_bytes(Device d) {
  if (d.is_cpu()) return static_cast<size_t>(g_cpu_bytes.load());
  if (d.index < 0 || d.index >= kMaxTrackedDevices) return 0;
  return static_cast<size_t>(g_cuda_bytes[d.index].load());
}

}  // namespace tandem
