#pragma once
// Saving and loading tensors in safetensors, the format of PyTorch's and Hugging Face's
// `safetensors` package, so a tandem checkpoint opens in PyTorch and back.
//
// A safetensors file is
//   8 bytes      N, the length of the header, a little-endian uint64
//   N bytes      a JSON object (UTF-8, padded with spaces):
//                  {"__metadata__": {"key": "value", ...},             (optional, strings only)
//                   "0.weight": {"dtype": "F32", "shape": [6, 1, 5, 5],
//                                "data_offsets": [begin, end]}, ...}
//   the rest     the data section: each tensor's bytes, row-major, little-endian, at
//                [begin, end) counted from the start of the data section.
// The tensors' byte ranges are back to back and cover the data section exactly (no gaps, no
// overlap, no trailing bytes), as the format requires. tandem reads and writes F32, F64, I64,
// U8 and BF16 (float32, float64, int64, uint8, bfloat16); other dtypes (F16, I32, BOOL, ...)
// are a FormatError naming the tensor.
//
// Writers put the tensors in state-dict order and add two metadata entries: "format": "pt"
// (what Hugging Face's loaders expect of a PyTorch file) and "tandem.checksum", the CRC-32 of
// the data section ("crc32:89abcdef"). Readers verify the checksum when it is there (files
// written by PyTorch have none) and name the file in every error:
//   "x.safetensors: tensor '3.weight': data_offsets [0, 480) hold 480 bytes but F32
//    [16,6,5,5] needs 9600"
// A reader never allocates more than the file holds: every tensor is checked to lie inside
// the data section before its storage is made.
//
// save() is atomic (see Note [atomic write] in serialize.cpp): a crash or a failure at any
// point leaves either the previous file or the new one whole, never a mix, and no temporary
// file behind.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/file_io.h"
#include "nn/module.h"

namespace tandem::nn {

using Metadata = std::map<std::string, std::string>;

// The metadata key holding the data section's checksum (reserved: writers set it).
inline constexpr const char* kChecksumKey = "tandem.checksum";

struct SafetensorsFile {
  StateDict tensors;  // contiguous CPU tensors, in the order of their bytes in the file
  Metadata metadata;  // "__metadata__", including the checksum entry when there is one
};

// The bytes of a safetensors file holding `tensors` (any device, any strides; copied to the
// host) and `metadata` plus "format" and the checksum. ValueError when metadata uses the
// reserved checksum key or a tensor is undefined.
std::vector<uint8_t> to_safetensors(const StateDict& tensors, const Metadata& metadata = {});

// Parses and validates a whole file held in memory (no file access, so a fuzzer can call it).
// `name_for_errors` starts every message. Throws FormatError for anything malformed, including
// a checksum that does not match.
SafetensorsFile parse_safetensors(const uint8_t* data, size_t size,
                                  const std::string& name_for_errors);

// The file at path, parsed (IOError when it cannot be read or is not a regular file).
SafetensorsFile read_safetensors(const std::string& path);
// to_safetensors(tensors, metadata) written atomically to path.
void write_safetensors(const std::string& path, const StateDict& tensors,
                       const Metadata& metadata = {});

// The atomic write of core/file_io.h, which checkpoints use.
using ::tandem::write_file_atomic;

// Writes module.state_dict() (PyTorch's names: "0.weight", "3.bias", ...) to path.
void save(const Module& module, const std::string& path, const Metadata& metadata = {});

// Reads path into module (values are copied onto the module's device). Before changing
// anything it checks that the file holds exactly the module's tensors and names the first
// that does not fit, in state-dict order: a missing name (ValueError), a dtype (DTypeError) or
// shape (ShapeError) mismatch, then a name the module does not have (ValueError). Returns the
// file's metadata.
Metadata load(Module& module, const std::string& path);

// load()'s checks and copy for tensors already read: `state` into module, every message
// starting with `source` (the file) and naming the tensor as prefix + its state-dict name.
void load_checked(Module& module, const StateDict& state, const std::string& source,
                  const std::string& prefix = "");

}  // namespace tandem::nn
