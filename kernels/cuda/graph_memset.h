#pragma once
// Library calls captured without their memset nodes (Note [cuDNN's memsets in a captured graph]
// in graph_memset.cu).
#include <cstddef>
#include <functional>

#include <cuda_runtime.h>

namespace tandem::gpu {

// Replaces every memset node of `graph` (not yet instantiated, and holding no allocation or
// free node: CUDA removes no node from such a graph) by a kernel node writing the same bytes,
// with the same edges; returns how many. A memset whose edges carry data is left alone.
size_t memsets_to_kernels(cudaGraph_t graph);

// Runs work(s), which enqueues its work on s. When `stream` is being captured into a CUDA graph
// (and cudnn_memsets_as_kernels() is on), s is a stream of the same device and priority captured
// into a small graph of its own; that graph's memsets become kernels (memsets_to_kernels) and it
// joins the capture of `stream` as one child graph node after the work captured so far. Otherwise
// s is `stream` and nothing else happens. Returns the memset nodes replaced.
size_t run_memsets_as_kernels(cudaStream_t stream, const std::function<void(cudaStream_t)>& work);

}  // namespace tandem::gpu
