#pragma once
// Library calls captured without their memset nodes (Note [cuDNN's memsets in a captured graph]
// in graph_memset.cu).
#include <cstddef>
#include <functional>

#include <cuda_runtime.h>

#include "core/device.h"

namespace tandem::gpu {

// Replaces every memset node of `graph` (not yet instantiated, and holding no allocation or
// free node: CUDA removes no node from such a graph) by a kernel node writing the same bytes,
// with the same edges; returns how many. A memset whose edges carry data is left alone.
size_t memsets_to_kernels(cudaGraph_t graph);

// Note [a workspace prepared ahead] (graph_memset.cu): a capturing stream's own workspace for
// graph-API cuDNN calls, so that what only prepares it can run before the convolution's input
// is ready. `slot` is opaque: the stream's record of the block's last use.
struct StreamWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
  void* slot = nullptr;
  explicit operator bool() const { return data != nullptr; }
};

// Outside a capture: makes sure `stream` (the current stream of `device`) has a workspace of its
// own of at least `bytes`, when that is small enough to keep (the block is allocated on the
// stream, grown as needed, and kept by this thread and by every graph that uses it).
void reserve_stream_workspace(Device device, cudaStream_t stream, size_t bytes);
// Inside a capture of `stream` by CUDAGraph (core/cuda_graph.h): the stream's own workspace
// when it has one of at least `bytes` (the capture's graph then keeps the block alive), else
// none; none as well when cudnn_prepare_ahead() or cudnn_memsets_as_kernels() is off.
StreamWorkspace capture_stream_workspace(Device device, cudaStream_t stream, size_t bytes);
// Preparation nodes moved ahead of their calls since the process started (for tests).
size_t prepared_ahead_nodes();

// Runs work(s), which enqueues its work on s. When `stream` is being captured into a CUDA graph
// (and cudnn_memsets_as_kernels() is on), s is a stream of the same device and priority captured
// into a small graph of its own; that graph's memsets become kernels (memsets_to_kernels) and it
// joins the capture of `stream` as one child graph node after the work captured so far. Otherwise
// s is `stream` and nothing else happens. Returns the memset nodes replaced.
// With `ahead` (from capture_stream_workspace, the workspace `work` uses), the small graph's
// nodes that only prepare that workspace join the capture as a child graph of their own, after
// the previous call that used the workspace in this capture (Note [a workspace prepared
// ahead]), and the rest follows both.
size_t run_memsets_as_kernels(cudaStream_t stream, const std::function<void(cudaStream_t)>& work,
                              const StreamWorkspace* ahead = nullptr);

}  // namespace tandem::gpu
