// libFuzzer target: an uncompressed IDX file held in memory, read as images and as labels.
// Allowed outcome: a tensor that is exactly the file's data, or a FormatError.
#include <cstring>

#include "data/idx.h"
#include "tests/fuzz/fuzz_util.h"

using namespace tandem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) return -1;  // gzip: fuzz_idx_gzip's job
  Tensor images, labels;
  if (fuzz::returns_or_throws<FormatError>(
          [&] { images = data::parse_idx_images(data, size, "fuzz-images"); })) {
    fuzz::expect(images.dim() == 3 && images.dtype() == kUInt8, "images are uint8 [N, rows, cols]");
    fuzz::expect(size == 16 + static_cast<size_t>(images.numel()), "images cover the whole file");
    fuzz::expect(std::memcmp(images.raw_data(), data + 16, size - 16) == 0,
                 "images hold the file's bytes");
  }
  if (fuzz::returns_or_throws<FormatError>(
          [&] { labels = data::parse_idx_labels(data, size, "fuzz-labels", 10); })) {
    fuzz::expect(labels.dim() == 1 && labels.dtype() == kInt64, "labels are int64 [N]");
    fuzz::expect(size == 8 + static_cast<size_t>(labels.numel()), "labels cover the whole file");
    const int64_t* l = labels.data<int64_t>();
    for (int64_t i = 0; i < labels.numel(); ++i)
      fuzz::expect(l[i] == data[8 + i] && l[i] < 10, "labels are the file's bytes, below 10");
  }
  return 0;
}
