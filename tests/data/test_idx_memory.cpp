// IDX parsing from memory (what the fuzz targets call): the same tensors and the same errors as
// reading the file, raw or gzip, with the caller's name in every message.
#include <zlib.h>

#include "core/error.h"
#include "data/idx.h"
#include "data_test_util.h"

using namespace tandem;
using namespace tandem::data;
using tandem::test::check_throws_containing;
using tandem::test::idx_file;
using tandem::test::TempDir;

namespace {

std::vector<uint8_t> gzip_of(const std::vector<uint8_t>& raw) {
  TempDir dir;
  write_file_atomic(dir.file("x.gz"), raw, /*gzip=*/true);
  std::FILE* f = std::fopen(dir.file("x.gz").c_str(), "rb");
  REQUIRE(f != nullptr);
  std::vector<uint8_t> out;
  for (int c; (c = std::fgetc(f)) != EOF;) out.push_back(static_cast<uint8_t>(c));
  std::fclose(f);
  REQUIRE(out.size() > 2);
  REQUIRE(out[0] == 0x1f);
  return out;
}

std::vector<uint8_t> pixels(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>((i * 53 + 7) % 256);
  return v;
}

}  // namespace

TEST_CASE("idx: parse_idx_* from memory give the file readers' tensors, raw and gzip", "[data]") {
  const std::vector<uint8_t> images = idx_file(kIdxImagesMagic, {3, 2, 5}, pixels(30));
  const std::vector<uint8_t> labels = idx_file(kIdxLabelsMagic, {4}, {9, 0, 3, 3});
  for (bool gz : {false, true}) {
    SECTION(gz ? "gzip" : "raw") {
      const std::vector<uint8_t> img = gz ? gzip_of(images) : images;
      const std::vector<uint8_t> lbl = gz ? gzip_of(labels) : labels;
      Tensor t = parse_idx_images(img.data(), img.size(), "mem-images");
      CHECK(t.shape() == Shape{3, 2, 5});
      CHECK(t.to_vector<uint8_t>() == pixels(30));
      Tensor l = parse_idx_labels(lbl.data(), lbl.size(), "mem-labels");
      CHECK(l.to_vector<int64_t>() == std::vector<int64_t>{9, 0, 3, 3});
      // The result owns its bytes: it outlives the buffer it came from.
      std::vector<uint8_t> copy = img;
      Tensor t2 = parse_idx_images(copy.data(), copy.size(), "copy");
      copy.assign(copy.size(), 0);
      CHECK(t2.to_vector<uint8_t>() == pixels(30));
    }
  }
}

TEST_CASE("idx: parse_idx_* from memory reject bad bytes with the caller's name", "[data]") {
  const std::vector<uint8_t> images = idx_file(kIdxImagesMagic, {3, 2, 5}, pixels(30));
  SECTION("empty and short buffers") {
    check_throws_containing<FormatError>([] { parse_idx_images(nullptr, 0, "empty-buf"); },
                                         {"'empty-buf'", "0 bytes"});
    check_throws_containing<FormatError>([&] { parse_idx_images(images.data(), 10, "short-buf"); },
                                         {"'short-buf'", "truncated IDX header"});
    check_throws_containing<FormatError>(
        [&] { parse_idx_images(images.data(), images.size() - 1, "cut-buf"); },
        {"'cut-buf'", "truncated IDX file", "got 45"});
  }
  SECTION("a gzip header that claims far more than the stream can hold allocates nothing big") {
    // 4 billion^3 would overflow; 60000 x 28 x 28 (47 MB) from a 40-byte stream is impossible.
    const std::vector<uint8_t> bomb = gzip_of(idx_file(kIdxImagesMagic, {60000, 28, 28}, pixels(8)));
    REQUIRE(bomb.size() < 100);
    check_throws_containing<FormatError>(
        [&] { parse_idx_images(bomb.data(), bomb.size(), "bomb"); },
        {"'bomb'", "47040016 bytes", "more than a", "gzip stream can hold"});
    const std::vector<uint8_t> huge =
        idx_file(kIdxImagesMagic, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, pixels(4));
    check_throws_containing<FormatError>([&] { parse_idx_images(huge.data(), huge.size(), "huge"); },
                                         {"'huge'", "more than 2^64 bytes"});
  }
  SECTION("labels: out of range and num_classes") {
    const std::vector<uint8_t> lbl = idx_file(kIdxLabelsMagic, {3}, {1, 10, 2});
    check_throws_containing<FormatError>([&] { parse_idx_labels(lbl.data(), lbl.size(), "lbl"); },
                                         {"'lbl'", "label 1 is 10", "outside [0, 10)"});
    check_throws_containing<ValueError>([&] { parse_idx_labels(lbl.data(), lbl.size(), "lbl", 0); },
                                        {"num_classes must be > 0"});
  }
}
