// Note [input copies as kernels]: a step graph's first node was the copy of the batch's row
// numbers into its input (Note [input copies inside the graph] in core/cuda_graph.h), a memcpy
// node of 2 KB, and the kernel after it, the gather of the images, started 11 us after it ended
// (ResNet-18's step, H100; 6 us in LeNet's), where one kernel follows another by 0.4: handing
// over from a copy node to the kernels costs what a memset node's hand-over did. The copy is
// now a kernel of its own (16 bytes a thread where both addresses and the size allow, bytes
// otherwise), and the graph's copy is pointed at each step's source by setting that kernel
// node's arguments, as the memcpy node's were set.
#include "core/cuda/graph_copy.h"

#include <cstdint>

#include "core/cuda_check.h"

namespace tandem::detail {

namespace {

// Copies `bytes` bytes, 16 a thread: in 16-byte words where dst, src and bytes allow it.
__global__ void copy_bytes_kernel(char* dst, const char* src, size_t bytes) {
  const size_t i = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 16;
  if (i >= bytes) return;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
    return;
  }
  const size_t end = i + 16 < bytes ? i + 16 : bytes;
  for (size_t b = i; b < end; ++b) dst[b] = src[b];
}

constexpr unsigned kCopyThreads = 128;

}  // namespace

void launch_copy_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  const size_t threads = (bytes + 15) / 16;
  const auto blocks = static_cast<unsigned>((threads + kCopyThreads - 1) / kCopyThreads);
  copy_bytes_kernel<<<blocks, kCopyThreads, 0, stream>>>(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

bool copy_bytes_node(cudaGraphNode_t node, void** dst, size_t* bytes) {
  cudaGraphNodeType type{};
  TANDEM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
  if (type != cudaGraphNodeTypeKernel) return false;
  cudaKernelNodeParams p{};
  if (cudaGraphKernelNodeGetParams(node, &p) != cudaSuccess) {  // a library's kernel: not ours
    (void)cudaGetLastError();
    return false;
  }
  if (p.func != reinterpret_cast<void*>(&copy_bytes_kernel)) return false;
  *dst = *static_cast<char**>(p.kernelParams[0]);
  *bytes = *static_cast<size_t*>(p.kernelParams[2]);
  return true;
}

void point_copy_bytes(cudaGraphExec_t exec, cudaGraphNode_t node, const void* src) {
  cudaKernelNodeParams p{};
  TANDEM_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &p));  // the captured launch
  char* dst = *static_cast<char**>(p.kernelParams[0]);
  size_t bytes = *static_cast<size_t*>(p.kernelParams[2]);
  auto* from = static_cast<const char*>(src);
  void* args[] = {&dst, &from, &bytes};
  p.kernelParams = args;
  TANDEM_CUDA_CHECK(cudaGraphExecKernelNodeSetParams(exec, node, &p));
}

}  // namespace tandem::detail
