#include "parallel/device_api.h"

#include <algorithm>

#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace tandem::parallel {

std::string devices_str(const std::vector<Device>& devices) {
  std::string s = "[";
  for (size_t i = 0; i < devices.size(); ++i) s += (i ? ", " : "") + devices[i].str();
  return s + "]";
}

std::vector<Device> cuda_devices(int n) {
  const int visible = cuda_device_count();
  if (n < 0) n = visible;
  TANDEM_CHECK(n >= 1 && n <= visible, Device, "cuda_devices(", n, "): ", visible,
               virtual_cuda_devices().empty() ? " GPU" : " virtual CUDA device",
               visible == 1 ? "" : "s", " visible");
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) out.push_back(Device::cuda(i));
  return out;
}

std::vector<Device> cpu_devices(int n) {
  TANDEM_CHECK(n >= 1, Value, "cpu_devices(", n, "): need at least one device");
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) out.push_back(Device::cpu(i));
  return out;
}

std::vector<Device> cuda_or_cpu_devices(int n) {
  return cuda_device_count() >= n ? cuda_devices(n) : cpu_devices(n);
}

void check_device_list(const std::vector<Device>& devices, const std::string& who) {
  TANDEM_CHECK(!devices.empty(), Value, who, ": empty device list");
  for (size_t i = 0; i < devices.size(); ++i) {
    const Device d = devices[i];
    TANDEM_CHECK(d.type == devices[0].type, Value, who, ": device list ", devices_str(devices),
                 " mixes CPU and CUDA devices");
    TANDEM_CHECK(std::find(devices.begin(), devices.begin() + i, d) == devices.begin() + i, Value,
                 who, ": device list ", devices_str(devices), " has ", d.str(), " twice");
    check_device_exists(d);
  }
}

bool shares_a_gpu(const std::vector<Device>& devices) {
  for (size_t i = 0; i < devices.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (devices[i] != devices[j] && same_physical_device(devices[i], devices[j])) return true;
    }
  }
  return false;
}

void synchronize(const std::vector<Device>& devices) {
  for (Device d : devices) ::tandem::synchronize(d);
}

// Note [peer access and memory pools]
// cudaDeviceEnablePeerAccess covers memory from cudaMalloc only. tandem allocates from each
// device's default memory pool (cudaMallocAsync), whose memory a peer may touch only after
// cudaMemPoolSetAccess grants it; without that, cudaMemcpyPeerAsync between two pool blocks
// silently stages through the host at a tenth of NVLink's speed. So both are done here.
// Two logical devices on one GPU (Note [virtual CUDA devices] in core/device.h) need neither:
// their copies are ordinary device-to-device copies.
bool enable_peer_access(const std::vector<Device>& devices) {
  bool all = true;
#ifdef TANDEM_WITH_CUDA
  for (Device a : devices) {
    for (Device b : devices) {
      if (!a.is_cuda() || !b.is_cuda() || same_physical_device(a, b)) continue;
      const int pa = physical_cuda_index(a), pb = physical_cuda_index(b);
      int can = 0;
      TANDEM_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, pa, pb));
      if (!can) {
        all = false;
        continue;
      }
      DeviceGuard guard(a);
      cudaError_t e = cudaDeviceEnablePeerAccess(pb, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear the error state; already enabled is what we want
      } else {
        TANDEM_CUDA_CHECK(e);
      }
      // Device a may read and write b's pool memory.
      cudaMemPool_t pool;
      TANDEM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, pb));
      cudaMemAccessDesc access = {};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = pa;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      TANDEM_CUDA_CHECK(cudaMemPoolSetAccess(pool, &access, 1));
    }
  }
#else
  (void)devices;
#endif
  return all;
}

}  // namespace tandem::parallel
