#pragma once
// Files written so that a crash at any moment leaves the old file or the new one, never a part.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

// Writes bytes to path atomically: a temporary file in the same folder (named
// ".<file name>.tmp.<pid>.<n>"), written and fsynced, renamed over path, then the folder fsynced
// (Note [atomic write] in core/file_io.cpp). Any failure is an IOError naming path, the step and
// the OS reason (strerror); the temporary file is removed and a previous file at path is left
// as it was.
void write_file_atomic(const std::string& path, const uint8_t* data, size_t size);
// The same for a file made of pieces written one after another (a header and each tensor's
// bytes where they already are, without assembling the file in memory first).
struct FilePiece {
  const uint8_t* data;
  size_t size;
};
void write_file_atomic(const std::string& path, const std::vector<FilePiece>& pieces);

}  // namespace tandem
