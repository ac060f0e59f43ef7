// Row gather (index_select along dim 0) and its adjoint, the row scatter-add.
//
// The CPU checks indices on the host; here that would need a device-to-host copy, so an index
// outside [0, rows) traps the kernel instead (see cuda_backend.h).
//
// index_add uses atomicAdd because several i may name the same row. For floating types the
// order of those additions varies from run to run, so results can differ in the last bits:
// index_add is the nondeterministic op of this backend (Note [deterministic reductions] in
// common.cuh). Integer sums are exact whatever the order.
#include <cstdint>

#include "core/device.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tandem {

namespace gpu {
namespace {

// out [M, D] = x [rows, D] gathered by index [M].
template <typename T>
__global__ void index_select_kernel(const T* x, const int64_t* index, T* out, int64_t total,
                                    int64_t d, int64_t rows) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t m = i / d, j = i - m * d;
    const int64_t r = index[m];
    if (r < 0 || r >= rows) __trap();  // index out of range
    out[i] = x[r * d + j];
  }
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int64_t* p, int64_t v) {
  // Two's complement: an unsigned add is the signed add.
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
// No 8-bit atomics: compare-and-swap the aligned 32-bit word that holds the byte.
__device__ __forceinline__ void atomic_add(uint8_t* p, uint8_t v) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t{3});
  const unsigned int shift = static_cast<unsigned int>(addr & 3) * 8;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const unsigned int byte = ((assumed >> shift) + v) & 0xffu;
    old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (byte << shift));
  } while (assumed != old);
}

// bfloat16: compare-and-swap of the 16-bit element, the sum computed in float and rounded.
__device__ __forceinline__ void atomic_add(BFloat16* p, BFloat16 v) {
  unsigned short* addr = reinterpret_cast<unsigned short*>(p);
  unsigned short old = *addr, assumed;
  do {
    assumed = old;
    const BFloat16 sum(static_cast<float>(BFloat16::from_bits(assumed)) + static_cast<float>(v));
    old = atomicCAS(addr, assumed, static_cast<unsigned short>(sum.bits));
  } while (assumed != old);
}

// out [rows, D] += src [M, D] scattered by index [M].
template <typename T>
__global__ void index_add_kernel(const T* src, const int64_t* index, T* out, int64_t total,
                                 int64_t d, int64_t rows) {
  wait_for_previous_grid();  // Note [programmatic dependent launch] in common.cuh
  let_next_grid_launch();
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t m = i / d, j = i - m * d;
    const int64_t r = index[m];
    if (r < 0 || r >= rows) __trap();  // index out of range
    atomic_add(out + r * d + j, src[i]);
  }
}

}  // namespace
}  // namespace gpu

void CudaBackend::index_select(const Tensor& x, const Tensor& index, const Tensor& out) {
  const int64_t rows = x.size(0);
  const int64_t d = rows == 0 ? 0 : x.numel() / rows;
  TANDEM_CHECK(rows > 0 || index.numel() == 0, Value, "index_select: ", index.numel(),
               " indices into a tensor with no rows");
  const int64_t total = index.numel() * d;
  if (total == 0) return;
  DeviceGuard guard(x.device());
  dispatch_all(x.dtype(), "index_select", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::launch_after_previous(gpu::index_select_kernel<T>, gpu::grid_for(total), gpu::kBlock,
                               current_cuda_stream(x.device()), gpu::cptr<T>(x), gpu::cptr<int64_t>(index),
                               gpu::ptr<T>(out), total, d, rows);
  });
}

void CudaBackend::index_add(const Tensor& src, const Tensor& index, const Tensor& out) {
  const int64_t rows = out.size(0);
  const int64_t d = rows == 0 ? 0 : out.numel() / rows;
  TANDEM_CHECK(rows > 0 || index.numel() == 0, Value, "index_add: ", index.numel(),
               " indices into a tensor with no rows");
  const int64_t total = index.numel() * d;
  if (total == 0) return;
  DeviceGuard guard(out.device());
  dispatch_all(out.dtype(), "index_add", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::launch_after_previous(gpu::index_add_kernel<T>, gpu::grid_for(total), gpu::kBlock,
                               current_cuda_stream(out.device()), gpu::cptr<T>(src), gpu::cptr<int64_t>(index),
                               gpu::ptr<T>(out), total, d, rows);
  });
}

}  // namespace tandem
