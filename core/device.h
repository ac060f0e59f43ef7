#pragma once
// Devices and the thread-local current device.
//
// A Device is `cpu:N` or `cuda:N`. `cpu` means `cpu:0`. Virtual CPU devices `cpu:1`,
// `cpu:2`, ... share host memory but are distinct devices: tensors on different ones may not
// be mixed in one op, and parallel code drives each from its own host thread, so the whole
// multi-device path runs and is tested without a GPU. There are kMaxCpuDevices of them,
// cpu:0 to cpu:63: a fixed bound (not the machine's core count), so a program that runs on one
// machine parses on every other, and a typo such as cpu:99999 is an error rather than a
// device nobody meant.
//
// The current device is thread-local (like CUDA's own model): DeviceGuard sets it for a scope
// and, for a CUDA device, also calls cudaSetDevice on this thread.
#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

enum class DeviceType : uint8_t { CPU, CUDA };

// Virtual CPU devices are cpu:0 .. cpu:(kMaxCpuDevices - 1).
inline constexpr int kMaxCpuDevices = 64;

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i) : type(t), index(i) {}

  static constexpr Device cpu(int i = 0) { return {DeviceType::CPU, i}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  // Parses "cpu", "cpu:N", "cuda", "cuda:N"; throws ValueError naming the text otherwise,
  // and for a CPU index of kMaxCpuDevices or more.
  static Device parse(const std::string& text);

  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;  // "cpu:0", "cuda:1"

  friend constexpr bool operator==(Device a, Device b) {
    return a.type == b.type && a.index == b.index;
  }
  friend constexpr bool operator!=(Device a, Device b) { return !(a == b); }
};

inline constexpr Device kCPU = Device::cpu(0);

// Parses a comma-separated list: "cuda:0,cuda:1" or "cpu:0,cpu:1". Throws ValueError on an
// empty list, a duplicate entry, or a mix of CPU and CUDA devices.
std::vector<Device> parse_device_list(const std::string& text);

// Number of CUDA devices visible; 0 when tandem was built without CUDA, when there is no
// driver, or when there is no device (never throws for those).
int cuda_device_count();
bool cuda_available();
// True when tandem was built with NCCL and at least one GPU is visible.
bool nccl_available();
// Throws DeviceError naming the device when it does not exist (e.g. cuda:3 on a 2-GPU machine,
// or cpu:N with N >= kMaxCpuDevices).
void check_device_exists(Device d);

// The current device of this thread (default cpu:0).
Device current_device();
// Sets the current device of this thread; for CUDA also cudaSetDevice.
void set_current_device(Device d);

class DeviceGuard {
 public:
  explicit DeviceGuard(Device d);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device prev_;
};

// Blocks the host until all work queued on the device (all its streams) has finished.
// A no-op for CPU devices (their work is synchronous).
void synchronize(Device d);
// Synchronizes every CUDA device.
void synchronize_all();

}  // namespace tandem
