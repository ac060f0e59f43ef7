#include "parallel/distributed/launch_relay.h"

#include <cerrno>

namespace tandem::parallel::distributed::detail {

void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

void Relay::pump() {
  char buf[65536];
  while (fd >= 0) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      pending.append(buf, static_cast<size_t>(n));
      emit_lines();
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      close();  // EOF or a read error
    }
  }
}

void Relay::close() {
  if (fd < 0) return;
  ::close(fd);
  fd = -1;
  if (!pending.empty()) {
    const std::string text = prefix + pending + "\n";
    write_all(target, text.data(), text.size());
    pending.clear();
  }
}

// One write() for all the complete lines of a read, so lines of different workers interleave
// only at line boundaries. A line longer than 64 KiB is cut, so that a worker printing without
// newlines cannot grow the buffer without bound.
void Relay::emit_lines() {
  std::string text;
  size_t start = 0, nl;
  while ((nl = pending.find('\n', start)) != std::string::npos) {
    text.append(prefix).append(pending, start, nl + 1 - start);
    start = nl + 1;
  }
  pending.erase(0, start);
  if (pending.size() > 65536) {
    text.append(prefix).append(pending).append("\n");
    pending.clear();
  }
  if (!text.empty()) write_all(target, text.data(), text.size());
}

}  // namespace tandem::parallel::distributed::detail
