#pragma once
// What a training program prints and writes: a progress bar on a terminal, one line per
// epoch, and a CSV with one row per epoch (epoch,loss,train_acc,test_acc,seconds,images_per_s).
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::examples {

struct EpochStats {
  int64_t epoch = 0;  // 1-based
  double loss = 0, train_acc = 0, test_acc = 0, seconds = 0, images_per_s = 0;
};

class Progress {
 public:
  Progress(int64_t total, std::string label);  // draws only when stderr is a terminal
  void update(int64_t done);
  void finish();

 private:
  int64_t total_;
  std::string label_;
  bool tty_;
  int last_percent_ = -1;
};

// Writes the CSV atomically: the whole file is rewritten to PATH.tmp and renamed over PATH after
// every epoch, so the file on disk always holds complete rows. The constructor checks that the
// file can be written -- not a directory, not read-only, in a folder that takes files -- before
// training starts; every failure is a std::runtime_error naming the path and the OS reason, and
// leaves no PATH.tmp behind.
class CsvLog {
 public:
  explicit CsvLog(std::string path);
  void add(const EpochStats& s);

 private:
  void flush() const;
  std::string path_;
  std::vector<EpochStats> rows_;
};

std::string format_epoch(const EpochStats& s);

}  // namespace tandem::examples
