#include "nn/serialize.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include "nlohmann/json.hpp"

namespace tandem::nn {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

// Writing keeps the header in state-dict order; parsing uses the map-based type, whose
// inserts stay O(log n) however many keys a hostile header holds.
using Json = nlohmann::ordered_json;
using ParsedJson = nlohmann::json;
namespace fs = std::filesystem;

// The reference implementation refuses larger headers; so do we, before parsing one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// The safetensors names of the dtypes tandem has.
constexpr std::pair<DType, const char*> kDTypeNames[] = {
    {DType::Float32, "F32"}, {DType::Float64, "F64"}, {DType::Int64, "I64"}, {DType::UInt8, "U8"},
    {DType::BFloat16, "BF16"}};

const char* st_dtype(DType t) {
  for (const auto& [d, name] : kDTypeNames)
    if (d == t) return name;
  return "?";
}

bool parse_st_dtype(const std::string& s, DType& out) {
  for (const auto& [d, name] : kDTypeNames) {
    if (s == name) {
      out = d;
      return true;
    }
  }
  return false;
}

uLong crc32_update(uLong crc, const uint8_t* data, size_t size) {
  while (size > 0) {  // zlib takes uInt lengths: feed it in chunks
    const uInt n = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = crc32(crc, data, n);
    data += n;
    size -= n;
  }
  return crc;
}

std::string crc32_text(uLong crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08lx", static_cast<unsigned long>(crc & 0xffffffffUL));
  return std::string("crc32:") + buf;
}

// One tensor's entry in the header, validated on its own; the layout checks come after.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// Text from the file as it appears in a message: cut short, so that a hostile header cannot
// make a megabyte-long error.
std::string shown(std::string s) {
  constexpr size_t kMax = 80;
  if (s.size() > kMax) s = s.substr(0, kMax) + "...";
  return s;
}
std::string shown(const ParsedJson& j) {
  return shown(j.dump(-1, ' ', false, ParsedJson::error_handler_t::replace));
}

std::string range_str(uint64_t b, uint64_t e) {
  return detail::str("[", b, ", ", e, ")");
}

// The non-negative integer j or a FormatError: what names it in the message.
uint64_t header_uint(const ParsedJson& j, const std::string& file, const std::string& tensor,
                     const std::string& what) {
  TANDEM_CHECK(j.is_number_unsigned(), Format, file, ": tensor '", tensor, "': ", what, " is ",
               shown(j), ", not a non-negative integer");
  return j.get<uint64_t>();
}

Entry parse_entry(const std::string& file, const std::string& full_name, const ParsedJson& j,
                  uint64_t data_size) {
  const std::string name = shown(full_name);
  TANDEM_CHECK(j.is_object(), Format, file, ": tensor '", name,
               "': entry is not a JSON object but ", shown(j));
  for (const auto& [key, value] : j.items()) {
    TANDEM_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", Format, file,
                 ": tensor '", name, "': unexpected field '", key, "'");
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    TANDEM_CHECK(j.contains(key), Format, file, ": tensor '", name, "': no \"", key, "\" field");
  }
  Entry e;
  e.name = full_name;

  const ParsedJson& dt = j["dtype"];
  TANDEM_CHECK(dt.is_string(), Format, file, ": tensor '", name, "': dtype is ", shown(dt),
               ", not a string");
  TANDEM_CHECK(parse_st_dtype(dt.get<std::string>(), e.dtype), Format, file, ": tensor '", name,
               "': dtype ", shown(dt.get<std::string>()),
               " is not supported (tandem reads F32, F64, I64, U8 and BF16)");

  const ParsedJson& sh = j["shape"];
  TANDEM_CHECK(sh.is_array(), Format, file, ": tensor '", name, "': shape is ", shown(sh),
               ", not an array");
  uint64_t numel = 1;
  int64_t nonzero = 1;
  bool overflow = false;
  for (size_t d = 0; d < sh.size(); ++d) {
    const uint64_t n = header_uint(sh[d], file, name, detail::str("shape[", d, "]"));
    TANDEM_CHECK(n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), Format, file,
                 ": tensor '", name, "': shape[", d, "] = ", n, " is too large");
    e.shape.push_back(static_cast<int64_t>(n));
    overflow = overflow || __builtin_mul_overflow(numel, n, &numel);
    // Strides are products of dims: they must fit int64 even when a zero dim empties the tensor.
    if (n != 0)
      TANDEM_CHECK(!__builtin_mul_overflow(nonzero, static_cast<int64_t>(n), &nonzero), Format,
                   file, ": tensor '", name, "': shape ", shown(sh), " is too large");
  }
  uint64_t need = 0;
  overflow = overflow || __builtin_mul_overflow(numel, dtype_size(e.dtype), &need);

  const ParsedJson& off = j["data_offsets"];
  TANDEM_CHECK(off.is_array() && off.size() == 2, Format, file, ": tensor '", name,
               "': data_offsets is ", shown(off), ", not [begin, end]");
  e.begin = header_uint(off[0], file, name, "data_offsets[0]");
  e.end = header_uint(off[1], file, name, "data_offsets[1]");
  TANDEM_CHECK(e.begin <= e.end, Format, file, ": tensor '", name, "': data_offsets ",
               range_str(e.begin, e.end), " end before they begin");
  TANDEM_CHECK(e.end <= data_size, Format, file, ": tensor '", name, "': data_offsets ",
               range_str(e.begin, e.end), " run past the data section (", data_size, " bytes)");
  TANDEM_CHECK(!overflow && need == e.end - e.begin, Format, file, ": tensor '", name,
               "': data_offsets ", range_str(e.begin, e.end), " hold ", e.end - e.begin,
               " bytes but ", st_dtype(e.dtype), " ", shape_str(e.shape), " needs ",
               overflow ? std::string("more than 2^64") : std::to_string(need));
  return e;
}

// Note [header shape]: a valid header nests at most three levels (root object, tensor entry,
// shape array) and has no key twice (the DOM parser would silently keep the last). A SAX pass
// checks both before the DOM is built, stopping at the first container that opens too deep.
// (nlohmann's callback parser would do it in one pass, but it rescans an object's members
// each time one closes: quadratic in the number of tensors.)
class HeaderShapeCheck : public nlohmann::json_sax<ParsedJson> {
 public:
  std::string error;  // empty while the header is fine

  bool start_object(std::size_t) override {
    if (!open()) return false;
    if (depth_ == 2) entry_keys_.clear();
    return true;
  }
  bool start_array(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    if (depth_ > 2) return true;
    if ((depth_ == 1 ? top_keys_ : entry_keys_).insert(k).second) return true;
    error = "the header has the key '" + shown(k) + "' twice";
    return false;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = std::string("the header is not valid JSON: ") + e.what();
    return false;
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }

 private:
  bool open() {
    if (++depth_ <= 3) return true;
    error = "the header nests deeper than a safetensors header can";
    return false;
  }
  bool close() {
    --depth_;
    return true;
  }
  int depth_ = 0;
  std::set<std::string> top_keys_, entry_keys_;
};

ParsedJson parse_header_json(const uint8_t* p, size_t n, const std::string& file) {
  TANDEM_CHECK(n > 0 && p[0] == '{', Format, file, ": the header does not start with '{'");
  HeaderShapeCheck check;
  const bool ok = ParsedJson::sax_parse(p, p + n, &check);
  TANDEM_CHECK(ok && check.error.empty(), Format, file, ": ",
               check.error.empty() ? std::string("the header is not valid JSON") : check.error);
  try {
    return ParsedJson::parse(p, p + n);
  } catch (const ParsedJson::exception& e) {
    TANDEM_THROW(Format, file, ": the header is not valid JSON: ", e.what());
  }
}

}  // namespace

// ---- reading ---------------------------------------------------------------------------------

SafetensorsFile parse_safetensors(const uint8_t* data, size_t size, const std::string& file) {
  TANDEM_CHECK(size >= 8, Format, file, ": the file is ", size,
               " bytes, too short for the 8-byte header length");
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);  // little-endian (see the static_assert above)
  TANDEM_CHECK(header_len <= size - 8, Format, file, ": header length ", header_len,
               " runs past the end of the file (", size, " bytes)");
  TANDEM_CHECK(header_len <= kMaxHeaderBytes, Format, file, ": header length ", header_len,
               " exceeds the format's limit of ", kMaxHeaderBytes, " bytes");
  const uint8_t* section = data + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  const ParsedJson header = parse_header_json(data + 8, header_len, file);
  TANDEM_CHECK(header.is_object(), Format, file, ": the header is not a JSON object");

  SafetensorsFile out;
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      TANDEM_CHECK(value.is_object(), Format, file,
                   ": __metadata__ is not a JSON object of strings");
      for (const auto& [k, v] : value.items()) {
        TANDEM_CHECK(v.is_string(), Format, file, ": __metadata__ '", shown(k), "' is ", shown(v),
                     ", not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(file, name, value, data_size));
  }

  // The byte ranges, in file order, must tile the data section: each begins where the
  // previous one ended. Empty tensors ([k, k)) sit anywhere along the way.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    TANDEM_CHECK(e.begin >= pos, Format, file, ": tensors '", shown(prev->name), "' ",
                 range_str(prev->begin, prev->end), " and '", shown(e.name), "' ",
                 range_str(e.begin, e.end), " overlap");
    TANDEM_CHECK(e.begin == pos, Format, file, ": data bytes ", range_str(pos, e.begin),
                 " belong to no tensor (a gap before '", shown(e.name), "')");
    pos = e.end;
    if (e.end > e.begin || prev == nullptr) prev = &e;
  }
  TANDEM_CHECK(pos == data_size, Format, file, ": the data section has ", data_size,
               " bytes but the tensors cover ", pos, " (", data_size - pos,
               " trailing bytes belong to no tensor)");

  if (auto it = out.metadata.find(kChecksumKey); it != out.metadata.end()) {
    TANDEM_CHECK(it->second.rfind("crc32:", 0) == 0, Format, file, ": unsupported ", kChecksumKey,
                 " '", shown(it->second), "' (expected crc32:<8 hex digits>)");
    const std::string actual = crc32_text(crc32_update(crc32(0L, Z_NULL, 0), section, data_size));
    TANDEM_CHECK(actual == it->second, Format, file, ": checksum mismatch: the metadata says ",
                 shown(it->second), " but the data section hashes to ", actual,
                 " (the file is corrupt)");
  }

  // Every range is inside the file now, so these allocations are bounded by its size.
  for (const Entry& e : entries) {
    Tensor t(e.shape, e.dtype, kCPU);
    if (e.end > e.begin) std::memcpy(t.raw_data(), section + e.begin, e.end - e.begin);
    out.tensors.insert(e.name, t);
  }
  return out;
}

SafetensorsFile read_safetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TANDEM_CHECK(fd >= 0, IO, "cannot read '", path, "': ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  std::string err;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    err = std::strerror(errno);
  } else if (S_ISDIR(st.st_mode)) {
    err = "it is a directory";
  } else if (!S_ISREG(st.st_mode)) {
    err = "it is not a regular file";
  } else {
    bytes.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        err = std::strerror(errno);
        break;
      }
      if (n == 0) {
        err = "the file shrank while it was read";
        break;
      }
      got += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  TANDEM_CHECK(err.empty(), IO, "cannot read '", path, "': ", err);
  return parse_safetensors(bytes.data(), bytes.size(), path);
}

// ---- writing ---------------------------------------------------------------------------------

namespace {

// Note [safetensors written in pieces]: the file is the 8-byte header length, the header, and
// each tensor's bytes one after another. Its pieces are laid out here -- the header, with the
// data section's checksum computed tensor by tensor, and the tensors as contiguous CPU tensors
// (the tensors themselves when they already are) -- so write_safetensors writes them where they
// are, and a file never exists whole in memory besides its tensors (a checkpoint of a sharded
// run holds the consolidated state once, not twice more in the writer).
struct SafetensorsPieces {
  std::string head;          // header length (little-endian u64) + header, 8-byte aligned
  std::vector<Tensor> host;  // contiguous CPU tensors, in state-dict order
};

SafetensorsPieces safetensors_pieces(const StateDict& tensors, const Metadata& metadata) {
  TANDEM_CHECK(metadata.count(kChecksumKey) == 0, Value, "to_safetensors: metadata key '",
               kChecksumKey, "' is reserved (the writer sets it)");
  SafetensorsPieces out;
  for (const auto& [name, t] : tensors) {
    TANDEM_CHECK(t.defined(), Value, "to_safetensors: tensor '", name, "' is undefined");
    TANDEM_CHECK(name != "__metadata__", Value, "to_safetensors: '__metadata__' is reserved");
    out.host.push_back(t.to(kCPU).contiguous());
  }

  // __metadata__ first, as PyTorch's writer does (Json keeps insertion order); its checksum
  // covers the data section, the tensors' bytes in order.
  Json header = Json::object();
  header["__metadata__"] = Json::object();
  uint64_t pos = 0;
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t i = 0; i < out.host.size(); ++i) {
    const Tensor& t = out.host[i];
    if (t.nbytes() > 0) crc = crc32_update(crc, static_cast<const uint8_t*>(t.raw_data()), t.nbytes());
    header[tensors.item(i).first] = {{"dtype", st_dtype(t.dtype())},
                                     {"shape", t.shape()},
                                     {"data_offsets", {pos, pos + t.nbytes()}}};
    pos += t.nbytes();
  }
  Json& meta = header["__metadata__"];
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta[kChecksumKey] = crc32_text(crc);

  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // a name or value that is not UTF-8
    TANDEM_THROW(Value, "to_safetensors: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const uint64_t header_len = text.size();
  out.head.assign(reinterpret_cast<const char*>(&header_len), 8);
  out.head += text;
  return out;
}

}  // namespace

std::vector<uint8_t> to_safetensors(const StateDict& tensors, const Metadata& metadata) {
  const SafetensorsPieces p = safetensors_pieces(tensors, metadata);
  std::vector<uint8_t> out(p.head.begin(), p.head.end());
  for (const Tensor& t : p.host) {
    const auto* bytes = static_cast<const uint8_t*>(t.raw_data());
    if (t.nbytes() > 0) out.insert(out.end(), bytes, bytes + t.nbytes());
  }
  return out;
}

void write_safetensors(const std::string& path, const StateDict& tensors,
                       const Metadata& metadata) {
  const SafetensorsPieces p = safetensors_pieces(tensors, metadata);
  std::vector<FilePiece> pieces = {{reinterpret_cast<const uint8_t*>(p.head.data()), p.head.size()}};
  for (const Tensor& t : p.host) pieces.push_back({static_cast<const uint8_t*>(t.raw_data()), t.nbytes()});
  write_file_atomic(path, pieces);
}

// ---- modules ---------------------------------------------------------------------------------

void save(const Module& module, const std::string& path, const Metadata& metadata) {
  write_safetensors(path, module.state_dict(), metadata);
}

Metadata load(Module& module, const std::string& path) {
  SafetensorsFile file = read_safetensors(path);
  load_checked(module, file.tensors, path);
  return std::move(file.metadata);
}

void load_checked(Module& module, const StateDict& state, const std::string& path,
                  const std::string& prefix) {
  const StateDict own = module.state_dict();
  for (const auto& [name, t] : own) {
    const Tensor* src = state.find(name);
    TANDEM_CHECK(src != nullptr, Value, path, ": tensor '", prefix, name, "' (", st_dtype(t.dtype()),
                 " ", shape_str(t.shape()), " in the ", module.name(), ") is missing from the file");
    TANDEM_CHECK(src->dtype() == t.dtype(), DType, path, ": tensor '", prefix, name, "' is ",
                 st_dtype(src->dtype()), " in the file but ", st_dtype(t.dtype()), " in the ",
                 module.name());
    TANDEM_CHECK(src->shape() == t.shape(), Shape, path, ": tensor '", prefix, name,
                 "' has shape ", shape_str(src->shape()), " in the file but ",
                 shape_str(t.shape()), " in the ", module.name());
  }
  for (const auto& [name, t] : state) {
    TANDEM_CHECK(own.contains(name), Value, path, ": tensor '", prefix, name, "' (",
                 st_dtype(t.dtype()), " ", shape_str(t.shape()), ") is in the file but not in the ",
                 module.name());
  }
  module.load_state_dict(state, /*strict=*/true);
}

}  // namespace tandem::nn
