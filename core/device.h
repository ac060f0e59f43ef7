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
// and, for a CUDA device, also calls cudaSetDevice on this thread (with the device's physical
// ordinal, Note [virtual CUDA devices]).
//
// Note [virtual CUDA devices]
// One GPU can stand in for several, so that the in-process multi-device code (communicators,
// ScratchTrainer with its CUDA graphs, DataParallel, pipeline stages) runs and is race-checked
// on a machine with one GPU. `cuda:N` names a *logical* CUDA device; a process-wide table maps
// it to a physical ordinal. Without a table the mapping is the identity. The spelling
// `--devices cuda:0*2` (parse_device_list) installs the table {cuda:0 -> GPU 0, cuda:1 -> GPU 0};
// `cuda:0*2,cuda:1*2` gives cuda:0..cuda:3 on GPUs 0, 0, 1, 1. A plain `cuda:0,cuda:0` stays an
// error: sharing a GPU is asked for, never an accident.
//   - physical_cuda_index(d) is what reaches the CUDA API wherever a device ordinal does
//     (cudaSetDevice, memory pools, peer copies and peer access, ncclCommInitAll).
//   - Each logical device has its own streams, cuBLAS/cuDNN handles, generator, worker thread
//     in parallel code, and memory accounting (allocated_bytes / max_allocated_bytes count
//     what was allocated for that logical device); the memory pool is the physical GPU's, so
//     the devices sharing a GPU share its memory and its compute.
//   - A copy between two logical devices on one GPU is an ordinary device-to-device copy;
//     peer access is not enabled between them (there is nothing to enable).
//   - cuda_device_count() counts logical devices (what `cuda:N` may name), like
//     torch.cuda.device_count() counts what CUDA_VISIBLE_DEVICES leaves;
//     physical_cuda_device_count() counts GPUs.
//   - NCCL refuses two ranks on one GPU, so the nccl communicator over devices that share a
//     GPU is refused, with a message that offers the ring and naive ones.
//   - The table is set before CUDA work: once a thread has made a logical device current, that
//     device stays on the same physical GPU for the life of the process (its streams, handles
//     and pool setup were made there), and set_virtual_cuda_devices refuses a table that would
//     move it. Adding devices that were never used, or dropping devices, is allowed.
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
// An entry `cuda:P*K` asks for K logical devices on physical GPU P (Note [virtual CUDA
// devices]): a list with such an entry names physical GPUs (a plain `cuda:P` is `cuda:P*1`),
// each at most once; it installs the table with set_virtual_cuda_devices and returns the
// logical devices cuda:0 .. cuda:(total - 1) in list order. ValueError naming the entry for a
// count that is not a number of at least 1 or for a CPU entry with a count; DeviceError when
// the table cannot be installed any more.
std::vector<Device> parse_device_list(const std::string& text);
// What parse_device_list reads, without installing anything: the devices, and the table
// (empty for a plain list).
struct DeviceListSpec {
  std::vector<Device> devices;
  std::vector<int> table;
};
DeviceListSpec parse_device_list_spec(const std::string& text);

// Virtual CUDA devices are cuda:0 .. cuda:(kMaxCudaDevices - 1).
inline constexpr int kMaxCudaDevices = 64;

// Installs the table of logical CUDA devices: logical device cuda:i runs on physical GPU
// physical[i]; an empty list restores the identity. The GPUs are checked where the devices are
// used (check_device_exists), so a table can be set on a machine without them. ValueError for
// a negative ordinal or more than kMaxCudaDevices entries; DeviceError naming the device when
// it would move a logical device that a thread has already made current to another GPU. Not
// to be called while other threads run CUDA work.
void set_virtual_cuda_devices(const std::vector<int>& physical);
// The installed table (empty: none, the identity).
std::vector<int> virtual_cuda_devices();
// The physical ordinal of a CUDA device: what reaches the CUDA API. DeviceError for a CPU
// device and for a logical index outside the installed table.
int physical_cuda_index(Device d);
// True when a and b are CUDA devices on the same physical GPU (also when a == b).
bool same_physical_device(Device a, Device b);

// Number of CUDA devices `cuda:N` may name: the logical devices of the installed table, else
// the GPUs. 0 when tandem was built without CUDA, when there is no driver, or when there is no
// device (never throws for those).
int cuda_device_count();
// Number of physical GPUs visible (the same zeros as above).
int physical_cuda_device_count();
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
