#pragma once
// Storage: bytes on one device, shared by every tensor view onto them.
//
// Note [releasing a storage]: a Storage can give its bytes back and take new ones while keeping
// its identity, as PyTorch's storage.resize_(0) and back. Every tensor that aliases it (a view,
// autograd's saved copy of a parameter) holds the Storage object, not the bytes, so
// release() really returns the memory to the allocator while those aliases live, and
// reallocate() gives all of them the same new bytes. FSDP's FULL_SHARD is built on it
// (parallel/sharded/fsdp.cpp): a unit's gathered parameters are released after its forward
// although the graph holds them, and gathered again into the same Storage before its backward.
//
// Both are stream-ordered, as dropping the last reference is: release() hands the block to its
// deleter (cudaFreeAsync on the stream it was allocated on, Note [stream-ordered free]), so work
// already enqueued on that stream still reads valid memory; reallocate() allocates on the
// current stream. Neither synchronizes. A kernel that reads a released storage through any tensor
// is an error naming the tensor (Tensor::raw_data, the one door every kernel's pointer goes
// through), not a read of freed memory.
#include <cstddef>
#include <memory>

#include "core/allocator.h"
#include "core/device.h"

namespace tandem {

class Storage {
 public:
  Storage(Device device, size_t nbytes) : device_(device), nbytes_(nbytes), data_(allocate(device, nbytes)) {}
  // Wraps memory the caller owns; `owner` keeps it alive (may be null for static memory).
  Storage(Device device, size_t nbytes, DataPtr data) : device_(device), nbytes_(nbytes), data_(std::move(data)) {}

  void* data() const { return data_.get(); }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Gives the bytes back to the allocator (or to their owner): nbytes() becomes 0 and released()
  // true for every tensor on this storage. Releasing a released storage does nothing.
  void release() {
    data_.reset();
    nbytes_ = 0;
    released_ = true;
  }
  // New, uninitialized bytes from the allocator (on the current stream of the device), in place
  // of whatever the storage held (released or not: the old bytes go as in release()). Every
  // alias sees them at its own offset; the caller writes them before a kernel reads them.
  void reallocate(size_t nbytes) {
    release();  // first: the old block returns to the pool before the new one is taken
    data_ = allocate(device_, nbytes);  // may throw: the storage then stays released
    nbytes_ = nbytes;
    released_ = false;
  }
  // True between release() and the next reallocate().
  bool released() const { return released_; }

 private:
  Device device_;
  size_t nbytes_;
  DataPtr data_;
  bool released_ = false;
};

}  // namespace tandem
