#pragma once
// A graph's copies into its inputs as kernels (Note [input copies as kernels] in graph_copy.cu).
#include <cstddef>

#include <cuda_runtime.h>

namespace tandem::detail {

// Copies `bytes` bytes between two device addresses with a kernel on `stream`, so that a
// captured copy is a kernel node.
void launch_copy_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream);
// Whether `node` is such a copy's kernel node; then its destination and size.
bool copy_bytes_node(cudaGraphNode_t node, void** dst, size_t* bytes);
// Points the copy node `node` of the executable graph `exec` at `src` (host work, no launch).
void point_copy_bytes(cudaGraphExec_t exec, cudaGraphNode_t node, const void* src);

}  // namespace tandem::detail
