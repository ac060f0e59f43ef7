#pragma once
// Files written so that a crash at any moment leaves the old file or the new one, never a part.
#include <cstddef>
#include <cstdint>
#include <string>

namespace tandem {

// Writes bytes to path atomically: a temporary file in the same folder (named
// ".<file name>.tmp.<pid>.<n>"), written and fsynced, renamed over path, then the folder fsynced
// (Note [atomic write] in core/file_io.cpp). Any failure is an IOError naming path, the step and
// the OS reason (strerror); the temporary file is removed and a previous file at path is left
// as it was.
void write_file_atomic(const std::string& path, const uint8_t* data, size_t size);

}  // namespace tandem
