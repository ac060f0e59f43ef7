#pragma once
// The device API a multi-device program uses, in one place.
//
// core/device.h already has the primitives (Device, DeviceGuard, the thread-local current
// device, cuda_device_count, synchronize); this header re-exports them into
// tandem::parallel and adds what data-parallel code needs on top: device lists (built,
// validated), synchronizing a list, and peer access between GPUs.
//
// Virtual CPU devices (cpu:0, cpu:1, ...) are as many as asked for: each is driven by its own
// host thread in parallel code, so every multi-device path runs without a GPU. Virtual CUDA
// devices (several logical cuda:N on one GPU, `--devices cuda:0*2`) do the same on one GPU:
// Note [virtual CUDA devices] in core/device.h.
#include <string>
#include <vector>

#include "core/device.h"
#include "core/stream.h"

namespace tandem::parallel {

using ::tandem::current_device;
using ::tandem::cuda_available;
using ::tandem::cuda_device_count;
using ::tandem::Device;
using ::tandem::DeviceGuard;
using ::tandem::nccl_available;
using ::tandem::physical_cuda_device_count;
using ::tandem::physical_cuda_index;
using ::tandem::same_physical_device;
using ::tandem::set_virtual_cuda_devices;
using ::tandem::virtual_cuda_devices;
using ::tandem::set_current_device;
using ::tandem::synchronize;
using ::tandem::synchronize_all;

// Number of CUDA devices `cuda:N` may name: the visible GPUs, or the logical devices of an
// installed virtual table (0 without CUDA, driver or device; never throws). Like
// torch.cuda.device_count().
inline int device_count() { return cuda_device_count(); }

// cuda:0 .. cuda:n-1 (n = -1: every CUDA device, logical ones included). DeviceError when fewer
// than n exist.
std::vector<Device> cuda_devices(int n = -1);
// cpu:0 .. cpu:n-1 (virtual CPU devices). ValueError when n < 1.
std::vector<Device> cpu_devices(int n);
// cuda:0 .. cuda:n-1 when n GPUs are visible, otherwise cpu:0 .. cpu:n-1 (never a mix): n
// devices of one kind, so that multi-device code runs on any machine.
std::vector<Device> cuda_or_cpu_devices(int n);

// Throws (naming `who` and the list) unless `devices` is a usable device list: not empty, no
// device twice, not CPU and CUDA mixed (ValueError), every device exists (DeviceError).
void check_device_list(const std::vector<Device>& devices, const std::string& who);
// True when two devices of the list are logical CUDA devices on one GPU (`cuda:0*2`): the
// nccl communicator cannot serve such a list, the ring and naive ones can.
bool shares_a_gpu(const std::vector<Device>& devices);
// "[cpu:0, cpu:1]" for messages.
std::string devices_str(const std::vector<Device>& devices);

// Blocks the host until all queued work on each device has finished (no-op for CPU devices).
void synchronize(const std::vector<Device>& devices);

// Enables direct GPU-to-GPU access (NVLink / PCIe peer copies) between every pair of the CUDA
// devices in the list, for cudaMalloc memory and for the memory pools tandem allocates from
// (Note [peer access and memory pools]); already enabled pairs are fine. Communicators,
// ScratchTrainer and DataParallel call it for their devices. Returns true when every pair has it,
// false when some pair cannot (copies between those then go through the host, still correct).
// Pairs of logical devices on one GPU are skipped: they need no peer access.
// A no-op returning true for CPU devices and single devices.
bool enable_peer_access(const std::vector<Device>& devices);

}  // namespace tandem::parallel
