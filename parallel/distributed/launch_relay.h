#pragma once
// The launcher's part that relays output: each worker's stdout and stderr come back through a
// pseudo-terminal or a pipe (launch_process.h) and go to the launcher's own streams a whole
// line at a time, each line after the rank's prefix ("Output" in launch.h). launch.cpp polls
// the read ends and calls pump() on those that are ready; this turns bytes into lines.
#include <unistd.h>

#include <cstddef>
#include <string>

namespace tandem::parallel::distributed::detail {

// Writes everything, retrying on EINTR; gives up silently when the reader is gone (the
// launcher must keep supervising even if nobody reads its output any more).
void write_all(int fd, const char* data, size_t n);

// One worker stream (a pipe, or a pseudo-terminal's master): relays complete lines, each with
// the rank's prefix.
struct Relay {
  int fd = -1;  // read end, non-blocking; -1 once closed
  int target = STDOUT_FILENO;
  std::string prefix;
  std::string pending;  // bytes after the last '\n'

  // Reads whatever is there now; at EOF (EIO on a pseudo-terminal whose last slave closed)
  // flushes a last partial line and closes.
  void pump();
  // Closes the read end (if open) and writes a last partial line with its prefix and a '\n'.
  void close();

 private:
  void emit_lines();
};

}  // namespace tandem::parallel::distributed::detail
