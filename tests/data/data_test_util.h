#pragma once
// Shared by the data tests: a scratch directory, hand-built IDX bytes, and error checks.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

#include "catch.h"

namespace tandem::test {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("tandem_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// An IDX file of unsigned bytes: big-endian magic, dims, then data.
inline std::vector<uint8_t> idx_file(uint32_t magic, const std::vector<uint32_t>& dims,
                                     const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  auto put = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
  };
  put(magic);
  for (uint32_t d : dims) put(d);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// Runs f, which must throw exactly E (or a subclass) with every part in its message.
template <typename E, typename F>
void check_throws_containing(F&& f, std::initializer_list<std::string> parts) {
  bool thrown = false;
  try {
    f();
  } catch (const E& e) {
    thrown = true;
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      INFO("message: " << msg << "\nexpected to contain: " << p);
      CHECK(msg.find(p) != std::string::npos);
    }
  }
  CHECK(thrown);
}

}  // namespace tandem::test
