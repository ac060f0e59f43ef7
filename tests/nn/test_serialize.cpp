// safetensors: round trips, every validation rule on hand-built files, the checksum, loading
// into a model that does not fit, and the atomic write when the disk or folder fails.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>

#include "data/data_test_util.h"
#include "helpers.h"
#include "nn/state_test_util.h"
#include "nn/models/lenet.h"
#include "nn/models/resnet.h"
#include "nn/nn.h"
#include "nn/serialize.h"
#include "nn/serialize_checkpoint.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::TempDir;
using tandem::test::require_identical;
using tandem::test::snapshot;

namespace {

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<std::string> dir_entries(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A module holding every dtype tandem writes, plus a scalar and an empty tensor.
class Mixed : public Cloneable<Mixed> {
 public:
  explicit Mixed(uint64_t seed) {
    Generator gen(seed);
    register_parameter("w32", randn({3, 4}, kFloat32, kCPU, &gen));
    register_parameter("w64", randn({5}, kFloat64, kCPU, &gen));
    register_parameter("scalar", randn({}, kFloat64, kCPU, &gen));
    register_buffer("steps",
                    from_vector<int64_t>({static_cast<int64_t>(seed), -1, 1LL << 62}, {3}));
    register_buffer("mask", from_vector<uint8_t>({0, 255, 7, static_cast<uint8_t>(seed)}, {2, 2}));
    register_buffer("empty", zeros({0, 3}));
  }
  std::string name() const override { return "Mixed"; }

 protected:
  Tensor forward_impl(const Tensor& x) override { return x; }
};

// A file from a header text and a data section, with the header length prepended.
std::vector<uint8_t> st_file(const std::string& header, size_t data_bytes = 0,
                             uint64_t claimed_len = ~uint64_t{0}) {
  const uint64_t len = claimed_len == ~uint64_t{0} ? header.size() : claimed_len;
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  std::memcpy(out.data(), &len, 8);
  for (size_t i = 0; i < header.size(); ++i) out[8 + i] = static_cast<uint8_t>(header[i]);
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i);
  return out;
}

std::string parse_error(const std::vector<uint8_t>& file) {
  return error_message<FormatError>(
      [&] { parse_safetensors(file.data(), file.size(), "x.safetensors"); });
}

// Restores a resource limit and a signal disposition at scope exit.
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved);
    old_handler = signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
    rlimit l = saved;
    l.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved);
    signal(SIGXFSZ, old_handler);
  }
  rlimit saved{};
  sighandler_t old_handler;
};

}  // namespace

TEST_CASE("safetensors round trip: LeNet, ResNet-18 and every dtype", "[nn][serialize]") {
  TempDir dir;
  SECTION("LeNet") {
    Generator g1(1), g2(2);
    auto a = models::lenet({}, g1), b = models::lenet({}, g2);
    save(*a, dir.file("lenet.safetensors"), {{"epoch", "3"}});
    const Metadata meta = load(*b, dir.file("lenet.safetensors"));
    require_identical(a->state_dict(), b->state_dict());
    CHECK(meta.at("epoch") == "3");
    CHECK(meta.at("format") == "pt");
    CHECK(meta.at(kChecksumKey).rfind("crc32:", 0) == 0);
    // PyTorch's names and order.
    const std::vector<std::string> names = {"0.weight",  "0.bias", "3.weight", "3.bias",
                                            "7.weight",  "7.bias", "9.weight", "9.bias",
                                            "11.weight", "11.bias"};
    CHECK(read_safetensors(dir.file("lenet.safetensors")).tensors.keys() == names);
  }
  SECTION("ResNet-18, batch-norm statistics included") {
    Generator g1(1), g2(2);
    auto a = models::resnet18(10, 1, g1), b = models::resnet18(10, 1, g2);
    // Non-trivial running statistics.
    for (auto& [name, t] : a->named_buffers())
      if (is_floating(t.dtype())) t.copy_(rand(t.shape(), t.dtype(), kCPU, &g1));
      else t.fill_(7.0);  // num_batches_tracked
    save(*a, dir.file("resnet.safetensors"));
    load(*b, dir.file("resnet.safetensors"));
    require_identical(a->state_dict(), b->state_dict());
  }
  SECTION("F32, F64, I64, U8, a scalar and an empty tensor, in memory") {
    Mixed a(7), b(8);
    const std::vector<uint8_t> bytes = to_safetensors(a.state_dict(), {{"k", "v"}});
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    CHECK(header_len % 8 == 0);  // padded with spaces: the data section is 8-byte aligned
    SafetensorsFile f = parse_safetensors(bytes.data(), bytes.size(), "mem");
    require_identical(a.state_dict(), f.tensors);
    CHECK(f.metadata.at("k") == "v");
    b.load_state_dict(f.tensors);
    require_identical(a.state_dict(), b.state_dict());
  }
  SECTION("BF16: bfloat16 bits, little-endian") {
    StateDict sd{{"h", from_vector<float>({1.0f, -2.0f, 0.1f}, {3}).to(kBFloat16)}};
    const std::vector<uint8_t> bytes = to_safetensors(sd);
    const std::string text(bytes.begin(), bytes.end());
    CHECK(contains(text, "\"dtype\":\"BF16\""));
    // The data section is the last 6 bytes: 0x3f80, 0xc000, 0x3dcd.
    const std::vector<uint8_t> data(bytes.end() - 6, bytes.end());
    CHECK(data == std::vector<uint8_t>{0x80, 0x3f, 0x00, 0xc0, 0xcd, 0x3d});
    SafetensorsFile f = parse_safetensors(bytes.data(), bytes.size(), "mem");
    REQUIRE(f.tensors.at("h").dtype() == kBFloat16);
    CHECK(f.tensors.at("h").to_vector<float>() == std::vector<float>{1.0f, -2.0f, 0.10009765625f});
  }
  SECTION("non-contiguous input is written row-major") {
    Tensor t = arange(0, 6, 1, kFloat32).view({2, 3}).transpose(0, 1);  // [3, 2]
    StateDict sd{{"t", t}};
    auto bytes = to_safetensors(sd);
    SafetensorsFile f = parse_safetensors(bytes.data(), bytes.size(), "mem");
    CHECK(f.tensors.at("t").to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
  }
  SECTION("the reserved metadata key is refused") {
    StateDict sd{{"t", zeros({1})}};
    CHECK(contains(error_message<ValueError>([&] {
                     to_safetensors(sd, {{kChecksumKey, "x"}});
                   }),
                   "reserved"));
  }
}

TEST_CASE("safetensors parser: each malformed file gives a named FormatError", "[nn][serialize]") {
  const std::string w = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::vector<uint8_t> good = st_file("{" + w + "}", 8);
  CHECK(parse_safetensors(good.data(), good.size(), "ok").tensors.size() == 1);

  CHECK(contains(parse_error({1, 2, 3, 4, 5}), "x.safetensors: the file is 5 bytes, too short"));
  CHECK(contains(parse_error(st_file("{}", 0, 1000)),
                 "header length 1000 runs past the end of the file (10 bytes)"));
  CHECK(contains(parse_error(st_file("{}", 0, 1ULL << 60)), "runs past the end"));
  CHECK(contains(parse_error(st_file("{\"w\": {")), "the header is not valid JSON"));
  CHECK(contains(parse_error(st_file("[1, 2]")), "does not start with '{'"));
  CHECK(contains(parse_error(st_file("")), "does not start with '{'"));
  CHECK(contains(parse_error(st_file("{} x")), "not valid JSON"));
  CHECK(contains(parse_error(st_file("{\"w\": 3}")), "tensor 'w': entry is not a JSON object"));
  CHECK(contains(parse_error(st_file(R"({"w":{"dtype":"F32","shape":[2]}})")),
                 "tensor 'w': no \"data_offsets\" field"));
  CHECK(contains(
      parse_error(st_file(R"({"w":{"dtype":"F32","shape":[],"data_offsets":[0,4],"x":1}})", 4)),
      "tensor 'w': unexpected field 'x'"));
  CHECK(contains(
      parse_error(st_file(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4)),
      "tensor 'w': dtype F16 is not supported"));
  CHECK(contains(parse_error(st_file(R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,4]}})", 4)),
                 "tensor 'w': dtype is 7, not a string"));
  CHECK(contains(
      parse_error(st_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)),
      "tensor 'w': shape[0] is -2, not a non-negative integer"));
  CHECK(contains(
      parse_error(st_file(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8)),
      "shape[0] is 2.5"));
  CHECK(contains(parse_error(st_file(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8)),
                 "shape is 2, not an array"));
  CHECK(contains(parse_error(st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8)),
                 "data_offsets is [0], not [begin, end]"));
  CHECK(
      contains(parse_error(st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)),
               "data_offsets [8, 0) end before they begin"));
  CHECK(
      contains(parse_error(st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4)),
               "tensor 'w': data_offsets [0, 8) run past the data section (4 bytes)"));
  // The message of the format's documentation, exactly.
  CHECK(contains(
      parse_error(st_file(
          R"({"3.weight":{"dtype":"F32","shape":[16,6,5,5],"data_offsets":[0,480]}})", 480)),
      "x.safetensors: tensor '3.weight': data_offsets [0, 480) hold 480 bytes but F32 "
      "[16,6,5,5] needs 9600"));
  SECTION("a 2^60-byte tensor claimed by a tiny file is refused before any allocation") {
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"F32","shape":[288230376151711744],"data_offsets":[0,8]}})", 8)),
        "hold 8 bytes but F32 [288230376151711744] needs 1152921504606846976"));
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"F32","shape":[288230376151711744],"data_offsets":[0,1152921504606846976]}})",
            8)),
        "run past the data section (8 bytes)"));
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8)),
        "needs more than 2^64"));
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})",
            8)),
        "is too large"));
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"U8","shape":[99999999999999999999],"data_offsets":[0,8]}})", 8)),
        "not a non-negative integer"));
    // Empty, but its strides would not fit int64.
    CHECK(contains(
        parse_error(st_file(
            R"({"w":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})")),
        "shape [0,4294967296,4294967296] is too large"));
  }
  SECTION("layout: overlap, gap, trailing bytes") {
    const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
    CHECK(contains(parse_error(st_file(
                       "{" + a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)),
                   "tensors 'a' [0, 8) and 'b' [4, 12) overlap"));
    CHECK(contains(parse_error(st_file(
                       "{" + a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8)),
                   "overlap"));
    CHECK(
        contains(parse_error(st_file(
                     "{" + a + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", 16)),
                 "data bytes [8, 12) belong to no tensor (a gap before 'b')"));
    CHECK(contains(
        parse_error(st_file(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8)),
        "data bytes [0, 4) belong to no tensor"));
    CHECK(contains(parse_error(st_file("{" + a + "}", 12)),
                   "the data section has 12 bytes but the tensors cover 8 (4 trailing bytes"));
    CHECK(contains(parse_error(st_file("{}", 3)), "has 3 bytes but the tensors cover 0"));
    // Out of order in the header is fine: the format orders by offsets, not by keys.
    const auto ok = st_file(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},)"
                            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("e":{"dtype":"F64","shape":[0],"data_offsets":[4,4]}})",
                            8);
    SafetensorsFile f = parse_safetensors(ok.data(), ok.size(), "ok");
    CHECK(f.tensors.keys() == std::vector<std::string>{"a", "e", "b"});
    CHECK(f.tensors.at("b").to_vector<uint8_t>() == std::vector<uint8_t>{4, 5, 6, 7});
  }
  SECTION("metadata, duplicate keys, nesting") {
    CHECK(contains(parse_error(st_file(R"({"__metadata__":{"a":1}})")),
                   "__metadata__ 'a' is 1, not a string"));
    CHECK(contains(parse_error(st_file(R"({"__metadata__":[1]})")),
                   "__metadata__ is not a JSON object"));
    CHECK(contains(parse_error(st_file(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                       R"("w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                                       1)),
                   "the header has the key 'w' twice"));
    CHECK(contains(parse_error(st_file(
                       R"({"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1)),
                   "the key 'dtype' twice"));
    CHECK(contains(parse_error(st_file(R"({"__metadata__":{"a":"x","a":"y"}})")),
                   "the key 'a' twice"));
    CHECK(contains(parse_error(st_file("{\"w\":{\"shape\":[" + std::string(100000, '[') + "}")),
                   "nests deeper"));
    // Text from the file is cut short in messages.
    const std::string longname(100000, 'n');
    const std::string msg =
        parse_error(st_file("{\"" + longname + R"(":{"dtype":")" + std::string(100000, 'F') +
                                R"(","shape":[1],"data_offsets":[0,1]}})",
                            1));
    CHECK(contains(msg, "is not supported"));
    CHECK(msg.size() < 400);
    const auto padded = st_file(R"({"__metadata__":{}}   )");  // spaces pad a header
    CHECK(parse_safetensors(padded.data(), padded.size(), "m").tensors.empty());
  }
}

TEST_CASE("safetensors parser survives truncation and random corruption", "[nn][serialize]") {
  Mixed m(3);
  const std::vector<uint8_t> good = to_safetensors(m.state_dict(), {{"note", "fuzz"}});
  auto parse_or_format_error = [&](const std::vector<uint8_t>& f) {
    try {
      parse_safetensors(f.data(), f.size(), "f");
      return true;
    } catch (const FormatError&) {
      return false;
    }
  };
  for (size_t n = 0; n < good.size(); ++n) {
    std::vector<uint8_t> cut(good.begin(), good.begin() + n);
    INFO("cut at " << n);
    CHECK_FALSE(parse_or_format_error(cut));
  }
  std::mt19937 rng(12345);
  int parsed = 0;
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> bad = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k)
      bad[rng() % bad.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    parsed += parse_or_format_error(bad) ? 1 : 0;  // anything else fails the test case
  }
  // With the checksum, a flip in the data section never parses; a flip in the padding may.
  CHECK(parsed < 300);
}

TEST_CASE("write_safetensors writes the bytes of to_safetensors, piece by piece", "[nn][serialize]") {
  // Note [safetensors written in pieces]: a strided view, an empty tensor and a scalar among
  // contiguous tensors; the file equals the assembled bytes and reads back with its checksum.
  TempDir dir;
  Generator gen(7);
  StateDict tensors;
  tensors.insert("a", randn({3, 4}, kFloat32, kCPU, &gen));
  tensors.insert("strided", randn({4, 5}, kFloat64, kCPU, &gen).transpose(0, 1));
  tensors.insert("empty", zeros({0, 3}, kFloat32, kCPU));
  tensors.insert("scalar", full({}, 2.5, kFloat32, kCPU));
  const std::string path = dir.file("pieces.safetensors");
  write_safetensors(path, tensors, {{"who", "test"}});
  CHECK(read_all(path) == to_safetensors(tensors, {{"who", "test"}}));
  const SafetensorsFile f = read_safetensors(path);
  REQUIRE(f.tensors.size() == 4);
  CHECK(f.metadata.at("who") == "test");
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(f.tensors.at(name).shape() == t.shape());
    CHECK(f.tensors.at(name).to_vector<double>() == t.to_vector<double>());
  }
}

TEST_CASE("safetensors checksum detects a flipped data byte", "[nn][serialize]") {
  TempDir dir;
  Generator gen(5);
  auto net = models::lenet({}, gen);
  const std::string path = dir.file("lenet.safetensors");
  save(*net, path);
  std::vector<uint8_t> bytes = read_all(path);
  bytes[bytes.size() - 100] ^= 0x10;  // inside 11.weight
  const std::string msg = parse_error(bytes);
  CHECK(contains(msg, "x.safetensors: checksum mismatch: the metadata says crc32:"));
  {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  }
  auto other = models::lenet({}, gen);
  const StateDict before = snapshot(*other);
  CHECK(contains(error_message<FormatError>([&] { load(*other, path); }),
                 path + ": checksum mismatch"));
  require_identical(before, other->state_dict());
  // Without a checksum entry (as PyTorch writes them) the same bytes parse.
  const std::string key = kChecksumKey;
  auto at = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  REQUIRE(at != bytes.end());
  *at = 'X';  // renames the key: now plain metadata
  SafetensorsFile f = parse_safetensors(bytes.data(), bytes.size(), "renamed");
  CHECK(f.metadata.count(kChecksumKey) == 0);
  CHECK(f.tensors.size() == 10);
}

TEST_CASE("nn::load names the first tensor that does not fit and changes nothing",
          "[nn][serialize]") {
  TempDir dir;
  Generator gen(11);
  auto net = models::lenet({}, gen);
  const std::string path = dir.file("lenet.safetensors");
  save(*net, path);

  SECTION("shape") {
    auto five = models::lenet({models::LeNetActivation::Sigmoid, 5}, gen);
    const StateDict before = snapshot(*five);
    const std::string msg = error_message<ShapeError>([&] { load(*five, path); });
    CHECK(contains(msg, path + ": tensor '11.weight' has shape [10,84] in the file but [5,84]"));
    require_identical(before, five->state_dict());
  }
  SECTION("missing") {
    std::vector<std::shared_ptr<Module>> layers;
    for (const auto& [name, c] : net->named_children()) layers.push_back(c->clone());
    layers.push_back(std::make_shared<Linear>(10, 3, true, gen));
    auto bigger = std::make_shared<SequentialImpl>(layers);
    const StateDict before = snapshot(*bigger);
    CHECK(contains(error_message<ValueError>([&] { load(*bigger, path); }),
                   "tensor '12.weight' (F32 [3,10] in the Sequential) is missing from the file"));
    require_identical(before, bigger->state_dict());
  }
  SECTION("extra") {
    std::vector<std::shared_ptr<Module>> layers;
    for (const auto& [name, c] : net->named_children()) layers.push_back(c->clone());
    layers.pop_back();
    auto smaller = std::make_shared<SequentialImpl>(layers);
    smaller->state_dict().at("0.weight").fill_(0.5);
    const StateDict before = snapshot(*smaller);
    CHECK(contains(error_message<ValueError>([&] { load(*smaller, path); }),
                   "tensor '11.weight' (F32 [10,84]) is in the file but not in the Sequential"));
    require_identical(before, smaller->state_dict());
  }
  SECTION("dtype") {
    Mixed a(1);
    save(a, dir.file("mixed.safetensors"));
    StateDict sd = a.state_dict();
    StateDict converted;
    for (const auto& [name, t] : sd) converted.insert(name, name == "steps" ? t.to(kFloat64) : t);
    write_safetensors(dir.file("bad.safetensors"), converted);
    Mixed b(2);
    const StateDict before = snapshot(b);
    CHECK(contains(error_message<DTypeError>([&] { load(b, dir.file("bad.safetensors")); }),
                   "tensor 'steps' is F64 in the file but I64 in the Mixed"));
    require_identical(before, b.state_dict());
    load(b, dir.file("mixed.safetensors"));
    require_identical(a.state_dict(), b.state_dict());
  }
  SECTION("not a file") {
    CHECK(contains(error_message<IOError>([&] { load(*net, dir.file("absent.safetensors")); }),
                   "No such file or directory"));
    CHECK(contains(error_message<IOError>([&] { load(*net, dir.path().string()); }),
                   "it is a directory"));
  }
}

TEST_CASE("nn::save is atomic: a failed write keeps the previous file and leaves no temp file",
          "[nn][serialize]") {
  TempDir dir;
  Generator gen(13);
  auto old_net = models::lenet({}, gen), new_net = models::lenet({}, gen);
  const std::string path = dir.file("ckpt.safetensors");
  save(*old_net, path);
  const std::vector<uint8_t> old_bytes = read_all(path);
  REQUIRE(old_bytes.size() > 200000);

  SECTION("the disk fills up during the write") {
    std::string msg;
    {
      FileSizeLimit limit(64 * 1024);  // writes past 64 KiB fail with EFBIG, as on a full disk
      msg = error_message<IOError>([&] { save(*new_net, path); });
    }
    CHECK(contains(msg, "cannot write '" + path + "': write failed: File too large"));
    CHECK(read_all(path) == old_bytes);
    CHECK(dir_entries(dir.path()) == std::vector<std::string>{"ckpt.safetensors"});
    auto check = models::lenet({}, gen);
    load(*check, path);
    require_identical(old_net->state_dict(), check->state_dict());
  }
  SECTION("a read-only folder") {
    ::chmod(dir.path().c_str(), 0555);
    const std::string probe = dir.file("probe");
    if (std::FILE* f = std::fopen(probe.c_str(), "w")) {  // root ignores folder permissions
      std::fclose(f);
      std::remove(probe.c_str());
      ::chmod(dir.path().c_str(), 0755);
      WARN("running as root: folder permissions do not apply, read-only folder part skipped");
      return;
    }
    const std::string msg = error_message<IOError>([&] { save(*new_net, path); });
    ::chmod(dir.path().c_str(), 0755);
    CHECK(contains(msg, "cannot write '" + path + "': cannot create a file in '"));
    CHECK(contains(msg, "Permission denied"));
    CHECK(read_all(path) == old_bytes);
    CHECK(dir_entries(dir.path()) == std::vector<std::string>{"ckpt.safetensors"});
  }
  SECTION("a folder that does not exist, a path under a file, a target that is a folder") {
    CHECK(
        contains(error_message<IOError>([&] { save(*new_net, dir.file("no/such/x.safetensors")); }),
                 "No such file or directory"));
    CHECK(contains(error_message<IOError>([&] { save(*new_net, path + "/x.safetensors"); }),
                   "Not a directory"));
    std::filesystem::create_directory(dir.file("sub"));
    const std::string msg = error_message<IOError>([&] { save(*new_net, dir.file("sub")); });
    CHECK(contains(msg, "cannot write '" + dir.file("sub") + "': rename failed: Is a directory"));
    CHECK(dir_entries(dir.path()) == std::vector<std::string>{"ckpt.safetensors", "sub"});
    CHECK(read_all(path) == old_bytes);
  }
  SECTION("a successful save replaces the file whole") {
    save(*new_net, path);
    auto check = models::lenet({}, gen);
    load(*check, path);
    require_identical(new_net->state_dict(), check->state_dict());
    CHECK(dir_entries(dir.path()) == std::vector<std::string>{"ckpt.safetensors"});
  }
}
