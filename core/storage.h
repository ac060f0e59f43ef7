#pragma once
// Storage: bytes on one device, shared by every tensor view onto them.
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

 private:
  Device device_;
  size_t nbytes_;
  DataPtr data_;
};

}  // namespace tandem
