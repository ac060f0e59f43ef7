#pragma once
// The IDX file format of MNIST and Fashion-MNIST, raw or gzip-compressed.
//
// An IDX file is a big-endian header followed by the data, row-major:
//   bytes 0..1  zero
//   byte  2     element type (0x08 = unsigned byte, the only one used here)
//   byte  3     number of dimensions D
//   4 * D bytes the size of each dimension, big-endian uint32
//   the data    product(dims) elements
// so the magic number (the first four bytes as a big-endian uint32) is 2049 (0x00000801) for a
// label file [N] and 2051 (0x00000803) for an image file [N, rows, cols].
//
// Readers load the whole file into memory, then validate everything before building a tensor.
// A file that starts with the gzip magic bytes (whatever its name) is inflated step by step:
// the magic number is checked on the first 4 inflated bytes, and no more than the header
// declares is ever inflated, so a small .gz cannot make a reader inflate gigabytes to reject
// it. Every failure names the file:
//   missing or unreadable file                       -> IOError
//   bad magic, zero dimension, truncated or oversized
//   data, corrupt or truncated gzip stream or one
//   that holds more than the header declares, a label
//   outside [0, num_classes)                         -> FormatError (an IOError)
// Writers write a temporary file next to the target and rename it into place, so a reader
// never sees a half-written file.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::data {

inline constexpr uint32_t kIdxLabelsMagic = 2049;  // 0x00000801: ubyte, 1 dimension
inline constexpr uint32_t kIdxImagesMagic = 2051;  // 0x00000803: ubyte, 3 dimensions

// uint8 [N, rows, cols] on the CPU.
Tensor read_idx_images(const std::string& path);
// int64 [N] on the CPU; every label must lie in [0, num_classes) (num_classes > 0).
Tensor read_idx_labels(const std::string& path, int64_t num_classes = 10);

// The same from a whole file held in memory, raw or gzip (told apart by the gzip magic bytes),
// with the same checks and errors; `name_for_errors` stands for the path in every message. No
// file access, so a fuzzer can call them. The only allocations are bounded by what the bytes
// hold (a gzip stream by deflate's largest ratio), never by what a header claims.
Tensor parse_idx_images(const uint8_t* data, size_t size, const std::string& name_for_errors);
Tensor parse_idx_labels(const uint8_t* data, size_t size, const std::string& name_for_errors,
                        int64_t num_classes = 10);

// images: uint8 [N, H, W], labels: uint8 or int64 [N] with values in [0, 255]; any device and
// strides. With gzip the file is gzip-compressed (name it *.gz by convention).
void write_idx_images(const std::string& path, const Tensor& images, bool gzip);
void write_idx_labels(const std::string& path, const Tensor& labels, bool gzip);

// The bytes of a file, gunzipped when it starts with the gzip magic bytes (several
// concatenated gzip members are joined, as gunzip does). A file whose name ends in ".gz" must
// be gzip data. Throws IOError / FormatError naming the path.
std::vector<uint8_t> read_file_bytes(const std::string& path);
// Writes bytes (gzip-compressed when gzip is true) to path atomically (core/file_io.h).
// Throws IOError naming the path.
void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip);

}  // namespace tandem::data
