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

}  // namespace tandem
