#include "core/device.h"

#include <algorithm>
#include <atomic>
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

namespace {

// The table of Note [virtual CUDA devices]. Read on every set_current_device, so lock-free:
// entries are written before the size (release) and read after it (acquire). Writers hold
// g_table_mu. g_bound[i] is 1 + the GPU that logical device i was first made current on, 0 while
// it has not been.
std::mutex g_table_mu;
std::atomic<int> g_table_size{0};  // 0: no table, the identity
std::atomic<int> g_table[kMaxCudaDevices];
std::atomic<int> g_bound[kMaxCudaDevices];

std::string table_str(const std::vector<int>& physical) {
  std::string s = "[";
  for (size_t i = 0; i < physical.size(); ++i) s += (i ? ", " : "") + std::to_string(physical[i]);
  return s + "]";
}

// Parses the K of "cuda:P*K" (item is the whole entry, text the whole list, for messages).
int parse_copies(const std::string& count, const std::string& item, const std::string& text) {
  TANDEM_CHECK(!count.empty() && std::all_of(count.begin(), count.end(), ::isdigit) && count.size() < 4,
               Value, "bad device list '", text, "': in '", item,
               "' the count after '*' must be a number (cuda:0*2: two devices on GPU 0)");
  const int k = std::stoi(count);
  TANDEM_CHECK(k >= 1, Value, "bad device list '", text, "': in '", item,
               "' the count after '*' must be at least 1");
  return k;
}

}  // namespace

std::vector<Device> parse_device_list(const std::string& text) {
  DeviceListSpec spec = parse_device_list_spec(text);
  if (!spec.table.empty()) set_virtual_cuda_devices(spec.table);
  return spec.devices;
}

DeviceListSpec parse_device_list_spec(const std::string& text) {
  std::vector<Device> out;
  std::vector<int> copies;  // per entry of `out`
  bool shared = false;      // some entry has a count: Note [virtual CUDA devices]
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove_if(item.begin(), item.end(), ::isspace), item.end());
    TANDEM_CHECK(!item.empty(), Value, "bad device list '", text, "': empty entry");
    int k = 1;
    std::string name = item;
    if (auto star = item.find('*'); star != std::string::npos) {
      name = item.substr(0, star);
      k = parse_copies(item.substr(star + 1), item, text);
      shared = true;
    }
    Device d = Device::parse(name);
    TANDEM_CHECK(d.is_cuda() || name == item, Value, "bad device list '", text, "': '", item,
                 "': only a GPU is shared by several devices with '*' (virtual CPU devices are as "
                 "many as asked for: cpu:0,cpu:1)");
    TANDEM_CHECK(std::find(out.begin(), out.end(), d) == out.end(), Value, "bad device list '",
                 text, "': ", d.str(), " appears twice",
                 d.is_cuda() ? "; to run several devices on one GPU write " + d.str() + "*2" : "");
    TANDEM_CHECK(out.empty() || out.front().type == d.type, Value, "bad device list '", text,
                 "': CPU and CUDA devices cannot be mixed");
    out.push_back(d);
    copies.push_back(k);
  }
  TANDEM_CHECK(!out.empty(), Value, "bad device list '", text, "': no devices");
  if (!shared) return {out, {}};
  std::vector<int> physical;
  for (size_t i = 0; i < out.size(); ++i) physical.insert(physical.end(), copies[i], out[i].index);
  TANDEM_CHECK(physical.size() <= static_cast<size_t>(kMaxCudaDevices), Value, "bad device list '",
               text, "': ", physical.size(), " devices; at most ", kMaxCudaDevices);
  std::vector<Device> logical;
  for (size_t i = 0; i < physical.size(); ++i) logical.push_back(Device::cuda(static_cast<int>(i)));
  return {logical, physical};
}

void set_virtual_cuda_devices(const std::vector<int>& physical) {
  TANDEM_CHECK(physical.size() <= static_cast<size_t>(kMaxCudaDevices), Value,
               "set_virtual_cuda_devices: ", physical.size(), " devices; at most ", kMaxCudaDevices);
  for (int p : physical) {
    TANDEM_CHECK(p >= 0 && p < kMaxCudaDevices, Value, "set_virtual_cuda_devices(",
                 table_str(physical), "): GPU ", p, " is not a GPU ordinal");
  }
  std::lock_guard<std::mutex> lock(g_table_mu);
  for (int i = 0; i < kMaxCudaDevices; ++i) {
    const int was = g_bound[i].load(std::memory_order_relaxed) - 1;
    if (was < 0) continue;
    // Dropping a used device is fine (it can no longer be named); moving it is not.
    // Without a table cuda:i is GPU i where that GPU exists.
    const int now = physical.empty() ? (i < physical_cuda_device_count() ? i : -1)
                                     : (i < static_cast<int>(physical.size()) ? physical[i] : -1);
    TANDEM_CHECK(now < 0 || now == was, Device, "set_virtual_cuda_devices(", table_str(physical),
                 "): cuda:", i, " already runs on GPU ", was, " and cannot move to GPU ", now,
                 "; virtual CUDA devices must be set before any CUDA work on the devices they "
                 "change (at program start, e.g. --devices cuda:0*2)");
  }
  for (size_t i = 0; i < physical.size(); ++i) g_table[i].store(physical[i], std::memory_order_relaxed);
  g_table_size.store(static_cast<int>(physical.size()), std::memory_order_release);
}

std::vector<int> virtual_cuda_devices() {
  std::lock_guard<std::mutex> lock(g_table_mu);
  std::vector<int> out;
  for (int i = 0; i < g_table_size.load(std::memory_order_relaxed); ++i) out.push_back(g_table[i].load());
  return out;
}

int physical_cuda_index(Device d) {
  TANDEM_CHECK(d.is_cuda(), Device, "physical_cuda_index: ", d.str(), " is not a CUDA device");
  const int n = g_table_size.load(std::memory_order_acquire);
  if (n == 0) return d.index;
  TANDEM_CHECK(d.index >= 0 && d.index < n, Device, "device ", d.str(),
               " does not exist: the virtual CUDA devices are cuda:0 to cuda:", n - 1);
  return g_table[d.index].load(std::memory_order_relaxed);
}

bool same_physical_device(Device a, Device b) {
  return a.is_cuda() && b.is_cuda() && physical_cuda_index(a) == physical_cuda_index(b);
}

int physical_cuda_device_count() {
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

int cuda_device_count() {
  const int gpus = physical_cuda_device_count();
  const int table = g_table_size.load(std::memory_order_acquire);
  return gpus == 0 || table == 0 ? gpus : table;
}

bool cuda_available() { return physical_cuda_device_count() > 0; }

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
    if (g_table_size.load(std::memory_order_acquire) == 0) {
      TANDEM_CHECK(d.index < n, Device, "device ", d.str(), " does not exist: this machine has ", n,
                   " GPU", n == 1 ? "" : "s");
    } else {
      const int p = physical_cuda_index(d);  // throws for a device outside the table
      const int gpus = physical_cuda_device_count();
      TANDEM_CHECK(p < gpus, Device, "device ", d.str(), " is virtual on GPU ", p,
                   ", which does not exist: this machine has ", gpus, " GPU", gpus == 1 ? "" : "s");
    }
  }
}

namespace {
thread_local Device tls_device = kCPU;
}

Device current_device() { return tls_device; }

void set_current_device(Device d) {
  if (d.is_cuda()) {
    const int p = physical_cuda_index(d);
#ifdef TANDEM_WITH_CUDA
    TANDEM_CUDA_CHECK(cudaSetDevice(p));
#endif
    // From here on the device's streams, handles and pool live on GPU p: it is bound there
    // (Note [virtual CUDA devices]).
    if (d.index >= 0 && d.index < kMaxCudaDevices) {
      int none = 0;
      g_bound[d.index].compare_exchange_strong(none, p + 1, std::memory_order_relaxed);
    }
  }
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
