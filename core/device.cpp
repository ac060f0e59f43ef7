#include "core/device.h"

#include <algorithm>
#include <cctype>
#include <mutex>
#include <sstream>

#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace tandem {

Device Device::parse(const std::string& text) {
  std::string s = text;
  std::string kind = s, idx;
  if (auto colon = s.find(':'); colon != std::string::npos) {
    kind = s.substr(0, colon);
    idx = s.substr(colon + 1);
    TANDEM_CHECK(!idx.empty() && std::all_of(idx.begin(), idx.end(), ::isdigit) && idx.size() < 6,
                 Value, "bad device '", text, "': the index after ':' must be a number");
  }
  int index = idx.empty() ? 0 : std::stoi(idx);
  if (kind == "cpu") {
    TANDEM_CHECK(index < kMaxCpuDevices, Value, "bad device '", text, "': virtual CPU devices are cpu:0 to cpu:",
                 kMaxCpuDevices - 1);
    return Device::cpu(index);
  }
  if (kind == "cuda" || kind == "gpu") return Device::cuda(index);
  TANDEM_THROW(Value, "bad device '", text, "': expected cpu, cpu:N, cuda or cuda:N");
}

std::string Device::str() const {
  return (is_cpu() ? "cpu:" : "cuda:") + std::to_string(index);
}

std::vector<Device> parse_device_list(const std::string& text) {
  std::vector<Device> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    TANDEM_CHECK(!item.empty(), Value, "bad device list '", text, "': empty entry");
    Device d = Device::parse(item);
    TANDEM_CHECK(std::find(out.begin(), out.end(), d) == out.end(), Value, "bad device list '",
                 text, "': ", d.str(), " appears twice");
    TANDEM_CHECK(out.empty() || out.front().type == d.type, Value, "bad device list '", text,
                 "': CPU and CUDA devices cannot be mixed");
    out.push_back(d);
  }
  TANDEM_CHECK(!out.empty(), Value, "bad device list '", text, "': no devices");
  return out;
}

int cuda_device_count() {
#ifdef TANDEM_WITH_CUDA
  static int count = [] {
    int n = 0;
    // No driver (cudaErrorInsufficientDriver) or no device both mean "zero GPUs".
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error state
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

bool nccl_available() {
#if defined(TANDEM_WITH_CUDA) && defined(TANDEM_WITH_NCCL)
  return cuda_available();
#else
  return false;
#endif
}

void check_device_exists(Device d) {
  TANDEM_CHECK(d.index >= 0, Device, "device ", d.str(), " has a negative index");
  TANDEM_CHECK(!d.is_cpu() || d.index < kMaxCpuDevices, Device, "device ", d.str(),
               " does not exist: virtual CPU devices are cpu:0 to cpu:", kMaxCpuDevices - 1);
  if (d.is_cuda()) {
    int n = cuda_device_count();
    TANDEM_CHECK(n > 0, Device, "device ", d.str(), " was asked for but no GPU is available",
#ifdef TANDEM_WITH_CUDA
                 " (no CUDA driver or device on this machine)"
#else
                 " (tandem was built without CUDA)"
#endif
    );
    TANDEM_CHECK(d.index < n, Device, "device ", d.str(), " does not exist: this machine has ", n,
                 " GPU", n == 1 ? "" : "s");
  }
}

namespace {
thread_local Device tls_device = kCPU;
}

Device current_device() { return tls_device; }

void set_current_device(Device d) {
#ifdef TANDEM_WITH_CUDA
  if (d.is_cuda()) TANDEM_CUDA_CHECK(cudaSetDevice(d.index));
#endif
  tls_device = d;
}

DeviceGuard::DeviceGuard(Device d) : prev_(tls_device) {
  if (d != prev_) set_current_device(d);
}

DeviceGuard::~DeviceGuard() {
  if (tls_device != prev_) {
    try {
      set_current_device(prev_);
    } catch (const std::exception& e) {
      TANDEM_LOG_ERROR("DeviceGuard: ", e.what());
    }
  }
}

void synchronize(Device d) {
#ifdef TANDEM_WITH_CUDA
  if (d.is_cuda()) {
    DeviceGuard g(d);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
  }
#else
  (void)d;
#endif
}

void synchronize_all() {
  for (int i = 0; i < cuda_device_count(); ++i) synchronize(Device::cuda(i));
}

}  // namespace tandem
