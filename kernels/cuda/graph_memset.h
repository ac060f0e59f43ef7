#pragma once
// Memset nodes of a captured CUDA graph rewritten as kernel nodes (Note [memsets of a captured
// graph as kernels] in graph_memset.cu).
#include <cstddef>

#include <cuda_runtime.h>

namespace tandem::gpu {

// Replaces every memset node of `graph` (not yet instantiated) by a kernel node writing the
// same bytes, with the same edges; returns how many. None when graph_memset_kernels() is off.
size_t memsets_to_kernels(cudaGraph_t graph);

}  // namespace tandem::gpu
