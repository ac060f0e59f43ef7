// libFuzzer target: a safetensors file held in memory, parsed, then loaded into a small module.
//
// Allowed outcomes: parse_safetensors succeeds or throws FormatError; loading what it parsed
// (nn::load_checked, the checks of nn::load) succeeds or throws ValueError / DTypeError /
// ShapeError (the file does not fit the module). A successful parse must survive a round trip through the writer unchanged.
#include <cstring>

#include "nn/nn.h"
#include "tests/fuzz/fuzz_util.h"

using namespace tandem;

namespace {

// A small module with a parameter of each rank the format carries for it, and buffers:
// "0.weight" [3, 2], "0.bias" [3], "1.weight", "1.bias", "1.running_mean", "1.running_var"
// [3] and "1.num_batches_tracked".
nn::Module& module() {
  static nn::SequentialImpl m{std::make_shared<nn::Linear>(2, 3), std::make_shared<nn::BatchNorm2d>(3)};
  return m;
}

void check_round_trip(const nn::SafetensorsFile& file) {
  nn::Metadata meta = file.metadata;
  meta.erase(nn::kChecksumKey);
  std::vector<uint8_t> bytes;
  // Names and metadata came out of a JSON parser, so the writer must take them back.
  if (!fuzz::returns_or_throws<>([&] { bytes = nn::to_safetensors(file.tensors, meta); }))
    fuzz::fail("round trip", "unreachable");
  nn::SafetensorsFile again;
  if (!fuzz::returns_or_throws<FormatError>(
          [&] { again = nn::parse_safetensors(bytes.data(), bytes.size(), "fuzz-round-trip"); }))
    fuzz::fail("round trip", "the writer's output does not parse");
  fuzz::expect(again.tensors.size() == file.tensors.size(), "round trip keeps every tensor");
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const auto& [name, t] = file.tensors.item(i);
    const auto& [name2, t2] = again.tensors.item(i);
    fuzz::expect(name == name2, "round trip keeps names and order");
    fuzz::expect(t.dtype() == t2.dtype() && t.shape() == t2.shape(), "round trip keeps dtype, shape");
    fuzz::expect(t.nbytes() == 0 || std::memcmp(t.raw_data(), t2.raw_data(), t.nbytes()) == 0,
                 "round trip keeps the bytes");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nn::SafetensorsFile file;
  const bool parsed = fuzz::returns_or_throws<FormatError>(
      [&] { file = nn::parse_safetensors(data, size, "fuzz.safetensors"); });
  if (parsed) {
    size_t bytes = 0;
    for (const auto& [name, t] : file.tensors) bytes += t.nbytes();
    fuzz::expect(bytes <= size, "the tensors hold no more bytes than the file");
    check_round_trip(file);
  }
  // What nn::load does after reading the file: the module's checks, then the copy.
  if (!parsed) return 0;
  fuzz::returns_or_throws<ValueError, DTypeError, ShapeError>(
      [&] { nn::load_checked(module(), file.tensors, "fuzz.safetensors"); });
  return 0;
}
