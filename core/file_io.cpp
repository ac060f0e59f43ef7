#include "core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace tandem {

namespace fs = std::filesystem;

// Note [atomic write]: rename() replaces a name in one step, so a reader (or the next run
// after a crash) sees the old file or the new one, never a partial one. The data must be on
// disk *before* the rename (fsync of the temporary file), or a power cut could leave the new
// name pointing at empty blocks; and the rename itself is only durable once the folder is
// fsynced. The temporary file lives in the target's folder because rename() cannot cross
// file systems. O_EXCL plus pid and counter keep concurrent writers apart.
void write_file_atomic(const std::string& path, const uint8_t* data, size_t size) {
  write_file_atomic(path, std::vector<FilePiece>{{data, size}});
}

void write_file_atomic(const std::string& path, const std::vector<FilePiece>& pieces) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target(path);
  TANDEM_CHECK(!target.filename().empty(), IO, "cannot write '", path, "': not a file name");
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = (dir / ("." + target.filename().string() + ".tmp." +
                                  std::to_string(::getpid()) + "." + std::to_string(counter++)))
                              .string();

  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  TANDEM_CHECK(fd >= 0, IO, "cannot write '", path, "': cannot create a file in '", dir.string(),
               "': ", std::strerror(errno));
  auto fail = [&](const char* step, int err, bool close_fd) {
    if (close_fd) ::close(fd);
    ::unlink(tmp.c_str());
    TANDEM_THROW(IO, "cannot write '", path, "': ", step, ": ", std::strerror(err));
  };
  for (const FilePiece& piece : pieces) {
    size_t done = 0;
    while (done < piece.size) {
      const ssize_t n = ::write(fd, piece.data + done, piece.size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("write failed", errno, true);
      if (n == 0) fail("write failed", EIO, true);
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) fail("fsync failed", errno, true);
  if (::close(fd) != 0) fail("close failed", errno, false);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename failed", errno, false);

  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int err = dfd < 0 ? errno : (::fsync(dfd) != 0 ? errno : 0);
  if (dfd >= 0) ::close(dfd);
  // The new file is in place; only its durability across a power cut is in doubt.
  TANDEM_CHECK(err == 0 || err == EINVAL, IO, "'", path, "' was written but its folder '",
               dir.string(), "' could not be synced: ", std::strerror(err));
}

}  // namespace tandem
