#include "common/report.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "nn/serialize.h"

namespace tandem::examples {

Progress::Progress(int64_t total, std::string label)
    : total_(total), label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::update(int64_t done) {
  if (!tty_ || total_ <= 0) return;
  int percent = static_cast<int>(100 * done / total_);
  if (percent == last_percent_) return;
  last_percent_ = percent;
  const int width = 30;
  int filled = width * percent / 100;
  std::fprintf(stderr, "\r%s [%s%s] %3d%%", label_.c_str(), std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), percent);
  std::fflush(stderr);
}

void Progress::finish() {
  if (tty_ && last_percent_ >= 0) std::fprintf(stderr, "\r%s\r", std::string(label_.size() + 40, ' ').c_str());
}

namespace {

[[noreturn]] void csv_error(const std::string& what, const std::string& path, int err) {
  throw std::runtime_error(what + " '" + path + "': " + std::strerror(err));
}

}  // namespace

CsvLog::CsvLog(std::string path) : path_(std::move(path)) {
  if (path_.empty()) return;
  // What the first rename would find: the path must not be a directory, and an existing file
  // must be writable; creating PATH.tmp checks the folder.
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) csv_error("cannot write CSV file", path_, EISDIR);
    if (::access(path_.c_str(), W_OK) != 0) csv_error("cannot write CSV file", path_, errno);
  }
  const std::string tmp = path_ + ".tmp";
  std::FILE* probe = std::fopen(tmp.c_str(), "w");
  if (probe == nullptr) csv_error("cannot write CSV file", path_, errno);
  std::fclose(probe);
  std::remove(tmp.c_str());
}

void CsvLog::add(const EpochStats& s) {
  if (path_.empty()) return;
  rows_.push_back(s);
  flush();
}

void CsvLog::flush() const {
  std::string text = "epoch,loss,train_acc,test_acc,seconds,images_per_s\n";
  char line[256];
  for (const auto& r : rows_) {
    std::snprintf(line, sizeof line, "%lld,%.6f,%.6f,%.6f,%.4f,%.1f\n", static_cast<long long>(r.epoch), r.loss,
                  r.train_acc, r.test_acc, r.seconds, r.images_per_s);
    text += line;
  }
  // A crash or a full disk leaves the previous CSV whole (temp file, fsync, rename).
  nn::write_file_atomic(path_, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

std::string format_epoch(const EpochStats& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "epoch %3lld  loss %.4f  train acc %.4f  test acc %.4f  %7.2f s  %9.0f images/s",
                static_cast<long long>(s.epoch), s.loss, s.train_acc, s.test_acc, s.seconds, s.images_per_s);
  return buf;
}

}  // namespace tandem::examples
