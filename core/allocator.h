#pragma once
// Memory for storages.
//
// CPU: 64-byte aligned host memory. CUDA: the stream-ordered allocator (cudaMallocAsync /
// cudaFreeAsync on the device's default memory pool, whose release threshold is raised so
// freed blocks stay in the pool instead of going back to the driver). No op calls cudaMalloc,
// and allocation works under graph capture.
//
// Note [stream-ordered free]: a CUDA block is freed on the stream it was allocated on. If a
// tensor is also used on another stream (e.g. a communication stream), the user must order
// that stream before the allocation stream (an Event) before dropping the last reference,
// exactly as with cudaFreeAsync itself. tandem's parallel code does this.
#include <cstddef>
#include <memory>

#include "core/device.h"
#include "core/stream.h"

namespace tandem {

// Owning pointer to device bytes; the deleter frees on the right device/stream.
using DataPtr = std::shared_ptr<void>;

// Allocates nbytes on d (on the current stream of d for CUDA). nbytes may be 0.
DataPtr allocate(Device d, size_t nbytes);

// Bytes currently held by live tensors on a device (for tests and diagnostics).
size_t allocated_bytes(Device d);
// The most allocated_bytes(d) has been since the start or the last reset (PyTorch's
// torch.cuda.max_memory_allocated / reset_peak_memory_stats). A CUDA graph's memory counts as
// it was during the capture: a replay allocates the same blocks again.
size_t max_allocated_bytes(Device d);
void reset_max_allocated_bytes(Device d);

// Note [allocation under graph capture]: while a CUDA stream is captured into a graph
// (core/cuda_graph.h), cudaMallocAsync on it adds an allocation node to the graph and
// cudaFreeAsync a free node -- but a free node may only free the graph's own allocations. So
// for the duration of a capture the allocator keeps a record of the stream: blocks allocated
// during the capture are the graph's, and their frees become free nodes (the usual case: a
// step's activations are made and released inside the step); a block allocated *before* the
// capture and released during it is not freed at all but handed to the record, because the
// captured work may still read it at every replay -- it is freed when the graph is destroyed.
// A graph block still held by a tensor when the capture ends would outlive the graph's own
// free nodes: capture_memory_end reports it, and CUDAGraph refuses such a capture.
class CaptureMemory;
// Starts the record for `stream` (a cudaStream_t) of device d. One record per stream.
std::shared_ptr<CaptureMemory> capture_memory_begin(Device d, void* stream);
// `joined` (a cudaStream_t of the same device) takes part in the capture of `stream` -- it
// waited for an event recorded there, as a fork of the captured work does -- so its
// allocations and frees are the record's as well, until the capture ends. Nothing when
// `stream` is not being captured.
void capture_memory_join(Device d, void* stream, void* joined);
// `keep` lives as long as the record of the capture that `stream` (a cudaStream_t of device d:
// the captured stream or one joined to it) takes part in, i.e. as long as its graph: for memory
// made outside the capture that the captured work uses at every replay. False, and nothing
// kept, when no capture of this allocator's records covers `stream`.
bool capture_memory_keep(Device d, void* stream, std::shared_ptr<const void> keep);
// Ends the record's capture: later frees of the stream are ordinary again. Returns the bytes
// allocated during the capture that live tensors still hold.
size_t capture_memory_end(CaptureMemory& record);
// Marks the capture as failed: frees of its blocks are dropped silently (the capture that
// would have freed them no longer exists; the blocks were never backed).
void capture_memory_abandon(CaptureMemory& record);

}  // namespace tandem
