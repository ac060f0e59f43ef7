// IDX reading and writing: round trips (raw and gzip) and every malformed-file error.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "core/error.h"
#include "data/idx.h"
#include "data_test_util.h"

using namespace tandem;
using namespace tandem::data;
using tandem::test::check_throws_containing;
using tandem::test::idx_file;
using tandem::test::TempDir;

namespace {

// 5 images of 4x3 with distinct bytes (wrapping through 0..255 including 0 and 255).
std::vector<uint8_t> image_bytes() {
  std::vector<uint8_t> v(5 * 4 * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 37 + 255) % 256);
  return v;
}
const std::vector<uint8_t> kLabels = {3, 0, 9, 1, 7};

void write_bytes_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("idx: images and labels read back exactly, raw and gzip", "[data]") {
  TempDir dir;
  for (bool gz : {false, true}) {
    SECTION(gz ? "gzip" : "raw") {
      const std::string ext = gz ? ".gz" : "";
      const std::string img = dir.file("img-idx3-ubyte" + ext);
      const std::string lbl = dir.file("lbl-idx1-ubyte" + ext);
      write_file_atomic(img, idx_file(kIdxImagesMagic, {5, 4, 3}, image_bytes()), gz);
      write_file_atomic(lbl, idx_file(kIdxLabelsMagic, {5}, kLabels), gz);

      Tensor images = read_idx_images(img);
      CHECK(images.dtype() == kUInt8);
      CHECK(images.device() == kCPU);
      CHECK(images.shape() == Shape{5, 4, 3});
      CHECK(images.to_vector<uint8_t>() == image_bytes());

      Tensor labels = read_idx_labels(lbl);
      CHECK(labels.dtype() == kInt64);
      CHECK(labels.shape() == Shape{5});
      CHECK(labels.to_vector<int64_t>() == std::vector<int64_t>{3, 0, 9, 1, 7});
    }
  }
}

TEST_CASE("idx: writers round-trip and leave no temporary files", "[data]") {
  TempDir dir;
  Tensor images = from_vector<uint8_t>(image_bytes(), {5, 4, 3});
  Tensor labels = from_vector<int64_t>({3, 0, 9, 1, 7}, {5});
  for (bool gz : {false, true}) {
    const std::string ext = gz ? ".gz" : "";
    write_idx_images(dir.file("i" + ext), images, gz);
    write_idx_labels(dir.file("l" + ext), labels, gz);
    CHECK(read_idx_images(dir.file("i" + ext)).to_vector<uint8_t>() == image_bytes());
    CHECK(read_idx_labels(dir.file("l" + ext)).to_vector<int64_t>() == labels.to_vector<int64_t>());
  }
  // Overwriting replaces the file.
  write_idx_labels(dir.file("l"), from_vector<uint8_t>({1, 2}, {2}), false);
  CHECK(read_idx_labels(dir.file("l")).to_vector<int64_t>() == std::vector<int64_t>{1, 2});
  // gzip output really is gzip, and raw output is the exact IDX bytes.
  CHECK(read_file_bytes(dir.file("i")) == idx_file(kIdxImagesMagic, {5, 4, 3}, image_bytes()));
  CHECK(std::filesystem::file_size(dir.file("i.gz")) != std::filesystem::file_size(dir.file("i")));
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    INFO(e.path().string());
    CHECK(e.path().string().find(".tmp") == std::string::npos);
    ++entries;
  }
  CHECK(entries == 4);

  check_throws_containing<DTypeError>([&] { write_idx_images(dir.file("x"), labels, false); },
                                      {"int64"});
  check_throws_containing<ShapeError>(
      [&] {
        write_idx_images(dir.file("x"), from_vector<uint8_t>({1, 2}, {2}), false);
      },
      {"[2]"});
  check_throws_containing<ValueError>(
      [&] {
        write_idx_labels(dir.file("x"), from_vector<int64_t>({1, 256}, {2}), false);
      },
      {"256"});
  check_throws_containing<IOError>(
      [&] { write_idx_labels(dir.file("no/such/dir/x"), labels, false); }, {"no/such/dir/x"});
}

TEST_CASE("idx: several concatenated gzip members read as one stream", "[data]") {
  TempDir dir;
  std::vector<uint8_t> whole = idx_file(kIdxImagesMagic, {5, 4, 3}, image_bytes());
  std::vector<uint8_t> a(whole.begin(), whole.begin() + 21), b(whole.begin() + 21, whole.end());
  write_file_atomic(dir.file("a.gz"), a, true);
  write_file_atomic(dir.file("b.gz"), b, true);
  std::vector<uint8_t> joined;
  for (const char* part : {"a.gz", "b.gz"}) {
    std::ifstream f(dir.file(part), std::ios::binary);
    joined.insert(joined.end(), std::istreambuf_iterator<char>(f),
                  std::istreambuf_iterator<char>());
  }
  write_bytes_raw(dir.file("ab.gz"), joined);
  CHECK(read_idx_images(dir.file("ab.gz")).to_vector<uint8_t>() == image_bytes());
}

TEST_CASE("idx: malformed files throw errors naming the file", "[data]") {
  TempDir dir;
  const std::vector<uint8_t> good = idx_file(kIdxImagesMagic, {5, 4, 3}, image_bytes());

  SECTION("truncated image file") {
    std::vector<uint8_t> cut(good.begin(), good.end() - 7);
    write_file_atomic(dir.file("cut-images"), cut, false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("cut-images")); },
                                         {"cut-images", "truncated", "expected 76", "got 69"});
  }
  SECTION("truncated header") {
    std::vector<uint8_t> cut(good.begin(), good.begin() + 10);
    write_file_atomic(dir.file("short-header"), cut, false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("short-header")); },
                                         {"short-header", "truncated"});
  }
  SECTION("gzip of a truncated image file") {
    std::vector<uint8_t> cut(good.begin(), good.end() - 1);
    write_file_atomic(dir.file("cut-images.gz"), cut, true);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("cut-images.gz")); },
                                         {"cut-images.gz", "expected 76", "got 75"});
  }
  SECTION("truncated gzip stream") {
    write_file_atomic(dir.file("cut.gz"), good, true);
    auto size = std::filesystem::file_size(dir.file("cut.gz"));
    std::filesystem::resize_file(dir.file("cut.gz"), size - 12);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("cut.gz")); },
                                         {"cut.gz", "gzip"});
  }
  SECTION("corrupt gzip: garbage bytes with a .gz name") {
    write_bytes_raw(dir.file("garbage.gz"), {'n', 'o', 't', ' ', 'g', 'z', 'i', 'p', 0, 1, 2, 3});
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("garbage.gz")); },
                                         {"garbage.gz", "gzip"});
  }
  SECTION("corrupt gzip: gzip header followed by garbage") {
    std::vector<uint8_t> bad = {0x1f, 0x8b, 0x08, 0, 0, 0, 0, 0, 0, 0x03};
    for (int i = 0; i < 40; ++i) bad.push_back(static_cast<uint8_t>(0xff - i));
    write_bytes_raw(dir.file("mangled.gz"), bad);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("mangled.gz")); },
                                         {"mangled.gz", "gzip"});
  }
  SECTION("corrupt gzip: one flipped byte fails the checksum") {
    write_file_atomic(dir.file("flipped.gz"), good, true);
    std::vector<uint8_t> bytes;
    {
      std::ifstream f(dir.file("flipped.gz"), std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    bytes[bytes.size() - 6] ^= 0x5a;  // inside the CRC-32 trailer
    write_bytes_raw(dir.file("flipped.gz"), bytes);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("flipped.gz")); },
                                         {"flipped.gz", "gzip"});
  }
  SECTION("wrong magic") {
    std::vector<uint8_t> bad = idx_file(0x00000c03, {5, 4, 3}, image_bytes());
    write_file_atomic(dir.file("bad-magic"), bad, false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("bad-magic")); },
                                         {"bad-magic", "0x00000c03", "0x00000803"});
    // A label file is not an image file, and the other way round.
    write_file_atomic(dir.file("labels"), idx_file(kIdxLabelsMagic, {5}, kLabels), false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("labels")); },
                                         {"labels", "0x00000801"});
    write_file_atomic(dir.file("images"), good, false);
    check_throws_containing<FormatError>([&] { read_idx_labels(dir.file("images")); },
                                         {"images", "0x00000803"});
  }
  SECTION("label out of range") {
    write_file_atomic(dir.file("bad-labels.gz"), idx_file(kIdxLabelsMagic, {4}, {1, 2, 10, 3}),
                      true);
    check_throws_containing<FormatError>([&] { read_idx_labels(dir.file("bad-labels.gz")); },
                                         {"bad-labels.gz", "label 2", "is 10"});
    // With more classes the same file is fine.
    CHECK(read_idx_labels(dir.file("bad-labels.gz"), 11).to_vector<int64_t>() ==
          std::vector<int64_t>{1, 2, 10, 3});
    check_throws_containing<ValueError>([&] { read_idx_labels(dir.file("bad-labels.gz"), 0); },
                                        {"num_classes"});
  }
  SECTION("zero dimension") {
    write_file_atomic(dir.file("zero-dim"), idx_file(kIdxImagesMagic, {5, 0, 3}, {}), false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("zero-dim")); },
                                         {"zero-dim", "dimension 1 is 0"});
  }
  SECTION("huge dimensions do not overflow") {
    write_file_atomic(dir.file("huge"),
                      idx_file(kIdxImagesMagic, {0xffffffffu, 0xffffffffu, 0xffffffffu}, {1, 2}),
                      false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("huge")); },
                                         {"huge", "truncated"});
  }
  SECTION("extra bytes after the data") {
    std::vector<uint8_t> longer = good;
    longer.push_back(0);
    write_file_atomic(dir.file("too-long"), longer, false);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("too-long")); },
                                         {"too-long", "expected 76", "got 77"});
  }
  SECTION("empty file") {
    write_bytes_raw(dir.file("empty"), {});
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("empty")); }, {"empty"});
  }
  SECTION("missing file is an IOError, not a FormatError") {
    const std::string missing = dir.file("does-not-exist-idx3-ubyte.gz");
    bool format_error = false;
    try {
      read_idx_images(missing);
    } catch (const FormatError&) {
      format_error = true;
    } catch (const IOError&) {
    }
    CHECK_FALSE(format_error);
    check_throws_containing<IOError>([&] { read_idx_images(missing); }, {missing});
    check_throws_containing<IOError>([&] { read_idx_labels(missing); }, {missing});
    check_throws_containing<IOError>([&] { read_idx_images(dir.path().string()); }, {"directory"});
  }
}

namespace {

// The bytes of a file.
std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// `members` gzip members of 1 MB each, the first starting with `head`, the rest zeros: a
// ~1 KB-per-MB stream (a "zip bomb" in small).
std::vector<uint8_t> zero_members(const TempDir& dir, const std::vector<uint8_t>& head, int members) {
  std::vector<uint8_t> first(size_t(1) << 20, 0), zeros(size_t(1) << 20, 0);
  std::copy(head.begin(), head.end(), first.begin());
  write_file_atomic(dir.file("first.gz"), first, true);
  write_file_atomic(dir.file("zeros.gz"), zeros, true);
  std::vector<uint8_t> out = file_bytes(dir.file("first.gz"));
  const std::vector<uint8_t> z = file_bytes(dir.file("zeros.gz"));
  for (int i = 1; i < members; ++i) out.insert(out.end(), z.begin(), z.end());
  return out;
}

}  // namespace

TEST_CASE("idx: a gzip stream is inflated no further than the IDX header declares", "[data]") {
  TempDir dir;
  SECTION("a bad magic is rejected from the first bytes of 64 MB of zeros") {
    // Garbage after the members: reaching the end of the stream would report it instead.
    std::vector<uint8_t> bomb = zero_members(dir, {}, 64);
    CHECK(bomb.size() < 200000);
    bomb.insert(bomb.end(), {'j', 'u', 'n', 'k'});
    write_bytes_raw(dir.file("bomb-images.gz"), bomb);
    const auto t0 = std::chrono::steady_clock::now();
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("bomb-images.gz")); },
                                         {"bomb-images.gz", "bad IDX magic number 0x00000000"});
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 1.0);
  }
  SECTION("a stream longer than declared is rejected after the declared bytes") {
    // One 28x28 image declared, 64 MB in the stream, and garbage at its end.
    std::vector<uint8_t> longer = zero_members(dir, idx_file(kIdxImagesMagic, {1, 28, 28}, {}), 64);
    longer.insert(longer.end(), {'j', 'u', 'n', 'k'});
    write_bytes_raw(dir.file("long-images.gz"), longer);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("long-images.gz")); },
                                         {"long-images.gz", "too long", "expected 800 bytes"});
  }
  SECTION("a header that claims more than the stream can hold") {
    std::vector<uint8_t> claim = idx_file(kIdxImagesMagic, {100000, 100, 100}, {1, 2, 3});
    write_file_atomic(dir.file("claim-images.gz"), claim, true);
    check_throws_containing<FormatError>([&] { read_idx_images(dir.file("claim-images.gz")); },
                                         {"claim-images.gz", "truncated", "expected 1000000016 bytes"});
  }
  SECTION("a stream shorter than declared, and garbage after a whole stream") {
    const std::vector<uint8_t> good = idx_file(kIdxLabelsMagic, {5}, kLabels);
    write_file_atomic(dir.file("short-labels.gz"), std::vector<uint8_t>(good.begin(), good.end() - 2), true);
    check_throws_containing<FormatError>([&] { read_idx_labels(dir.file("short-labels.gz")); },
                                         {"short-labels.gz", "truncated", "expected 13", "got 11"});
    write_file_atomic(dir.file("tail-labels.gz"), good, true);
    std::vector<uint8_t> tail = file_bytes(dir.file("tail-labels.gz"));
    tail.insert(tail.end(), {'x', 'y', 'z'});
    write_bytes_raw(dir.file("tail-labels.gz"), tail);
    check_throws_containing<FormatError>([&] { read_idx_labels(dir.file("tail-labels.gz")); },
                                         {"tail-labels.gz", "3 bytes of trailing garbage"});
  }
}
