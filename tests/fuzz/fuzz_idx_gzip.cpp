// libFuzzer target: a gzip-compressed IDX file held in memory.
//
// An input that starts with the gzip magic bytes is parsed as it is (corrupt, truncated,
// concatenated or oversized streams: FormatError only). Any other input x is gzip-compressed
// here and parsed both ways: gzip(x) must give exactly what x gives raw, or both must be
// rejected with a FormatError. The stream is cut into two gzip members at a point the input
// chooses, which exercises the step-by-step inflate across member boundaries.
#include <zlib.h>

#include <climits>
#include <cstring>
#include <vector>

#include "data/idx.h"
#include "tests/fuzz/fuzz_util.h"

using namespace tandem;

namespace {

void append_gzip(std::vector<uint8_t>& out, const uint8_t* data, size_t size) {
  z_stream zs{};
  if (deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    fuzz::fail("zlib", "deflateInit2 failed");
  const size_t at = out.size();
  out.resize(at + deflateBound(&zs, size) + 64);
  zs.next_in = const_cast<Bytef*>(data);
  zs.avail_in = static_cast<uInt>(size);
  zs.next_out = out.data() + at;
  zs.avail_out = static_cast<uInt>(out.size() - at);
  if (deflate(&zs, Z_FINISH) != Z_STREAM_END) fuzz::fail("zlib", "deflate did not finish");
  out.resize(out.size() - zs.avail_out);
  deflateEnd(&zs);
}

// Parses as images and as labels; returns whether each succeeded, and the tensors.
void parse_both(const uint8_t* data, size_t size, bool ok[2], Tensor out[2]) {
  ok[0] = fuzz::returns_or_throws<FormatError>(
      [&] { out[0] = data::parse_idx_images(data, size, "fuzz-images"); });
  ok[1] = fuzz::returns_or_throws<FormatError>(
      [&] { out[1] = data::parse_idx_labels(data, size, "fuzz-labels", 10); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bool ok[2];
  Tensor got[2];
  if (size >= 2 && data[0] == 0x1f && data[1] == 0x8b) {
    parse_both(data, size, ok, got);
    return 0;
  }
  if (size > (1u << 20)) return -1;
  // The first byte picks where the second member starts; the rest is the IDX file.
  if (size == 0) return -1;
  const size_t n = size - 1, cut = n == 0 ? 0 : data[0] % (n + 1);
  const uint8_t* file = data + 1;
  // A file that is itself gzip would be inflated once raw and once less through gzip(file).
  if (n >= 2 && file[0] == 0x1f && file[1] == 0x8b) return -1;
  std::vector<uint8_t> gz;
  append_gzip(gz, file, cut);
  if (cut < n) append_gzip(gz, file + cut, n - cut);

  bool ok_raw[2];
  Tensor raw[2];
  parse_both(file, n, ok_raw, raw);
  parse_both(gz.data(), gz.size(), ok, got);
  for (int i = 0; i < 2; ++i) {
    fuzz::expect(ok[i] == ok_raw[i], "gzip and raw bytes are accepted alike");
    if (!ok[i]) continue;
    fuzz::expect(got[i].shape() == raw[i].shape(), "gzip and raw give the same shape");
    fuzz::expect(std::memcmp(got[i].raw_data(), raw[i].raw_data(), got[i].nbytes()) == 0,
                 "gzip and raw give the same values");
  }
  return 0;
}
