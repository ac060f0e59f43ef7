#include "data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/file_io.h"

namespace tandem::data {

namespace {

namespace fs = std::filesystem;
using detail::str;

std::string hex(uint32_t v, int digits = 8) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(digits) << std::setfill('0') << v;
  return os.str();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_gzip(const uint8_t* b, size_t size, size_t at = 0) {
  return size >= at + 2 && b[at] == 0x1f && b[at + 1] == 0x8b;
}

void check_gz_name(const uint8_t* b, size_t size, const std::string& path) {
  TANDEM_CHECK(is_gzip(b, size) || !ends_with(path, ".gz"), Format, "'", path,
               "': corrupt gzip stream: the file is named .gz but does not start with the gzip"
               " magic bytes 1f 8b");
}

std::vector<uint8_t> read_raw(const std::string& path) {
  std::error_code ec;
  auto status = fs::status(path, ec);
  TANDEM_CHECK(fs::exists(status), IO, "cannot open '", path, "': no such file");
  TANDEM_CHECK(!fs::is_directory(status), IO, "cannot read '", path, "': it is a directory");
  std::FILE* f = std::fopen(path.c_str(), "rb");
  TANDEM_CHECK(f != nullptr, IO, "cannot open '", path, "': ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t chunk[1 << 16];
  size_t n = 0;
  while ((n = std::fread(chunk, 1, sizeof(chunk), f)) > 0)
    bytes.insert(bytes.end(), chunk, chunk + n);
  bool failed = std::ferror(f) != 0;
  std::fclose(f);
  TANDEM_CHECK(!failed, IO, "error reading '", path, "'");
  return bytes;
}

// Inflates one or more concatenated gzip members on demand, so a reader takes only the bytes it
// needs (an IDX header first, then no more than the header declares). zlib verifies each
// member's CRC-32 and length, so a flipped bit is caught here rather than showing up as a wrong
// pixel. Every failure is a FormatError naming the file.
class GzipReader {
 public:
  GzipReader(const uint8_t* in, size_t size, const std::string& path)
      : in_(in), size_(size), path_(path) {
    TANDEM_CHECK(inflateInit2(&zs_, 16 + MAX_WBITS) == Z_OK, IO, "'", path, "': zlib init failed");
  }
  ~GzipReader() { inflateEnd(&zs_); }
  GzipReader(const GzipReader&) = delete;
  GzipReader& operator=(const GzipReader&) = delete;

  // Inflates up to n bytes into dst and returns how many came: fewer than n only where the
  // last member ends.
  size_t read(uint8_t* dst, size_t n) {
    size_t produced = 0;
    while (produced < n && !done_) {
      zs_.next_in = const_cast<Bytef*>(in_ + consumed_);
      zs_.avail_in = static_cast<uInt>(std::min<size_t>(size_ - consumed_, UINT_MAX));
      zs_.next_out = dst + produced;
      zs_.avail_out = static_cast<uInt>(std::min<size_t>(n - produced, UINT_MAX));
      const uInt avail_in = zs_.avail_in, avail_out = zs_.avail_out;
      const int ret = inflate(&zs_, Z_NO_FLUSH);
      const bool progress = zs_.avail_in != avail_in || zs_.avail_out != avail_out;
      consumed_ += avail_in - zs_.avail_in;
      produced += avail_out - zs_.avail_out;
      if (ret == Z_STREAM_END) {
        if (consumed_ == size_) {
          done_ = true;
        } else {
          TANDEM_CHECK(is_gzip(in_, size_, consumed_), Format, "'", path_, "': corrupt gzip stream: ",
                       size_ - consumed_, " bytes of trailing garbage after the compressed data");
          inflateReset(&zs_);  // another gzip member follows
        }
      } else if (ret == Z_BUF_ERROR || (ret == Z_OK && consumed_ == size_ && zs_.avail_out > 0)) {
        TANDEM_CHECK(consumed_ < size_, Format, "'", path_, "': truncated gzip stream: the ",
                     size_, " bytes of the file end in the middle of the compressed data");
        TANDEM_CHECK(progress || zs_.avail_out == 0, Format, "'", path_,
                     "': corrupt gzip stream (inflate made no progress)");
        // otherwise only the output was full
      } else if (ret != Z_OK) {
        TANDEM_THROW(Format, "'", path_, "': corrupt gzip stream (", zs_.msg ? zs_.msg : "zlib error",
                     ", code ", ret, ")");
      }
    }
    return produced;
  }

  // Appends up to n inflated bytes to out, growing it as they arrive (never by more than came),
  // so a stream that claims more than it holds costs only what it holds.
  void append(std::vector<uint8_t>& out, uint64_t n) {
    constexpr size_t kChunk = size_t(1) << 20;
    while (n > 0) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(n, kChunk)), at = out.size();
      out.resize(at + want);
      const size_t got = read(out.data() + at, want);
      out.resize(at + got);
      if (got < want) return;
      n -= got;
    }
  }

  // True when the stream holds no more data (reads one byte when it does).
  bool at_end() {
    uint8_t byte = 0;
    return read(&byte, 1) == 0;
  }

 private:
  const uint8_t* in_;
  size_t size_;
  const std::string& path_;
  z_stream zs_{};
  size_t consumed_ = 0;
  bool done_ = false;
};

std::vector<uint8_t> gunzip(const std::vector<uint8_t>& in, const std::string& path) {
  GzipReader z(in.data(), in.size(), path);
  std::vector<uint8_t> out;
  z.append(out, UINT64_MAX);
  return out;
}

std::vector<uint8_t> gzip_bytes(const std::vector<uint8_t>& in, const std::string& path) {
  z_stream zs{};
  TANDEM_CHECK(deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8,
                            Z_DEFAULT_STRATEGY) == Z_OK,
               IO, "'", path, "': zlib init failed");
  std::vector<uint8_t> out(deflateBound(&zs, in.size()) + 64);
  size_t consumed = 0, produced = 0;
  int ret = Z_OK;
  while (ret != Z_STREAM_END) {
    if (produced == out.size()) out.resize(out.size() * 2);
    size_t in_left = in.size() - consumed;
    uInt chunk_in = static_cast<uInt>(std::min<size_t>(in_left, UINT_MAX));
    uInt chunk_out = static_cast<uInt>(std::min<size_t>(out.size() - produced, UINT_MAX));
    zs.next_in = const_cast<Bytef*>(in.data() + consumed);
    zs.avail_in = chunk_in;
    zs.next_out = out.data() + produced;
    zs.avail_out = chunk_out;
    ret = deflate(&zs, chunk_in == in_left ? Z_FINISH : Z_NO_FLUSH);
    consumed += chunk_in - zs.avail_in;
    produced += chunk_out - zs.avail_out;
    if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR) {
      deflateEnd(&zs);
      TANDEM_THROW(IO, "'", path, "': gzip compression failed (zlib error ", ret, ")");
    }
  }
  deflateEnd(&zs);
  out.resize(produced);
  return out;
}

// A validated IDX file: its dims and where its product(dims) data bytes are (in the caller's
// buffer for a raw file, in `inflated` for a gzip one).
struct IdxData {
  std::vector<int64_t> dims;
  std::vector<uint8_t> inflated;  // a gzip file's header and data
  const uint8_t* raw = nullptr;   // a raw file: the caller's bytes
  size_t data_offset = 0;
  const uint8_t* data() const { return (raw ? raw : inflated.data()) + data_offset; }
};

uint32_t read_be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

// Throws FormatError unless b starts with `magic` (4 bytes at least).
void check_magic(const uint8_t* b, size_t size, const std::string& path, uint32_t magic,
                 const char* what) {
  TANDEM_CHECK(size >= 4, Format, "'", path, "': truncated IDX file: ", size,
               " bytes, too short for the 4-byte magic number");
  uint32_t got = read_be32(b);
  if (got != magic) {
    // Name what the file seems to be, e.g. a label file passed as images.
    std::string seems;
    if ((got >> 16) == 0)
      seems = str(", which means element type ", hex(got >> 8 & 0xff, 2), " with ", got & 0xff,
                  " dimensions");
    TANDEM_THROW(Format, "'", path, "': bad IDX magic number ", hex(got), seems, " (expected ",
                 hex(magic), " for ", what, ": unsigned bytes with ", magic & 0xff, " dimensions)");
  }
}

// The dims of the header at the start of b (magic already checked) and the number of data
// bytes they declare; FormatError for a short header, a zero dimension or an overflow.
uint64_t check_header(const uint8_t* b, size_t size, const std::string& path, uint32_t magic,
                      std::vector<int64_t>& dims) {
  const size_t rank = magic & 0xff;
  const size_t header = 4 + 4 * rank;
  TANDEM_CHECK(size >= header, Format, "'", path, "': truncated IDX header: expected ", header,
               " bytes for ", rank, " dimensions, got ", size);
  uint64_t expected = 1;
  bool overflow = false;
  for (size_t d = 0; d < rank; ++d) dims.push_back(read_be32(b + 4 + 4 * d));
  const std::string shape = shape_str(dims);
  for (size_t d = 0; d < rank; ++d) {
    TANDEM_CHECK(dims[d] > 0, Format, "'", path, "': IDX dimension ", d, " is 0 (shape ", shape, ")");
    overflow = overflow || __builtin_mul_overflow(expected, uint64_t(dims[d]), &expected);
  }
  overflow = overflow || expected > UINT64_MAX - header;
  TANDEM_CHECK(!overflow, Format, "'", path, "': truncated IDX file: shape ", shape,
               " needs more than 2^64 bytes, got ", size);
  return expected;
}

// Deflate's largest compression ratio is 1032:1, so a gzip stream of n bytes holds at most
// this many.
uint64_t max_inflated_size(size_t n) { return uint64_t(n) * 1032 + 1024; }

// Validates the IDX file in file[0, size) whose magic must be `magic` (which fixes the rank). A
// gzip file is inflated step by step: the magic from its first 4 bytes, then the rest of the
// header, then no more data than the header declares (and one byte to see whether the stream
// goes on). A raw file is not copied: the result points into `file`.
IdxData parse_idx(const uint8_t* file, size_t file_size, const std::string& path, uint32_t magic,
                  const char* what) {
  IdxData idx;
  std::optional<GzipReader> z;
  if (is_gzip(file, file_size)) {
    z.emplace(file, file_size, path);
    z->append(idx.inflated, 4);
  } else {
    idx.raw = file;
  }
  const uint8_t* b = z ? idx.inflated.data() : file;
  size_t size = z ? idx.inflated.size() : file_size;
  check_magic(b, size, path, magic, what);
  const size_t header = 4 + 4 * (magic & 0xff);
  if (z) {
    z->append(idx.inflated, header - 4);
    b = idx.inflated.data();
    size = idx.inflated.size();
  }
  const uint64_t expected = check_header(b, size, path, magic, idx.dims);
  const std::string shape = shape_str(idx.dims);
  auto describe = [&] {
    return str("expected ", header + expected, " bytes (", header, "-byte header + ", expected,
               " data bytes for shape ", shape, ")");
  };
  if (z) {
    TANDEM_CHECK(header + expected <= max_inflated_size(file_size), Format, "'", path,
                 "': truncated IDX file: ", describe(), ", more than a ", file_size,
                 "-byte gzip stream can hold");
    z->append(idx.inflated, expected);
    size = idx.inflated.size();
  }
  const uint64_t actual = size - header;
  TANDEM_CHECK(actual >= expected, Format, "'", path, "': truncated IDX file: ", describe(), ", got ", size);
  TANDEM_CHECK(actual == expected, Format, "'", path, "': IDX file too long: ", describe(), ", got ", size);
  TANDEM_CHECK(!z || z->at_end(), Format, "'", path, "': IDX file too long: ", describe(),
               ", but the gzip stream holds more");
  idx.data_offset = header;
  return idx;
}

// Header + data of an IDX file of unsigned bytes.
std::vector<uint8_t> idx_bytes(uint32_t magic, const Shape& dims,
                               const std::vector<uint8_t>& data) {
  std::vector<uint8_t> out;
  out.reserve(4 + 4 * dims.size() + data.size());
  auto put = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
  };
  put(magic);
  for (int64_t d : dims) put(static_cast<uint32_t>(d));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Tensor images_from(const IdxData& idx) {
  Tensor out = empty(idx.dims, kUInt8, kCPU);  // [N, rows, cols]
  std::memcpy(out.raw_data(), idx.data(), out.nbytes());
  return out;
}

Tensor labels_from(const IdxData& idx, const std::string& path, int64_t num_classes) {
  Tensor out = empty(idx.dims, kInt64, kCPU);  // [N]
  int64_t* dst = out.data<int64_t>();
  const uint8_t* src = idx.data();
  for (int64_t i = 0; i < idx.dims[0]; ++i) {
    TANDEM_CHECK(src[i] < num_classes, Format, "'", path, "': label ", i, " is ", int(src[i]),
                 ", outside [0, ", num_classes, ")");
    dst[i] = src[i];
  }
  return out;
}

void check_num_classes(const std::string& path, int64_t num_classes) {
  TANDEM_CHECK(num_classes > 0, Value, "read_idx_labels('", path,
               "'): num_classes must be > 0, got ", num_classes);
}

}  // namespace

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  std::vector<uint8_t> raw = read_raw(path);
  if (is_gzip(raw.data(), raw.size())) return gunzip(raw, path);
  check_gz_name(raw.data(), raw.size(), path);
  return raw;
}

void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip) {
  if (!gzip) return ::tandem::write_file_atomic(path, bytes.data(), bytes.size());
  const std::vector<uint8_t> compressed = gzip_bytes(bytes, path);
  ::tandem::write_file_atomic(path, compressed.data(), compressed.size());
}

Tensor parse_idx_images(const uint8_t* data, size_t size, const std::string& name_for_errors) {
  return images_from(parse_idx(data, size, name_for_errors, kIdxImagesMagic, "images"));
}

Tensor parse_idx_labels(const uint8_t* data, size_t size, const std::string& name_for_errors,
                        int64_t num_classes) {
  check_num_classes(name_for_errors, num_classes);
  return labels_from(parse_idx(data, size, name_for_errors, kIdxLabelsMagic, "labels"),
                     name_for_errors, num_classes);
}

Tensor read_idx_images(const std::string& path) {
  const std::vector<uint8_t> file = read_raw(path);
  check_gz_name(file.data(), file.size(), path);
  return parse_idx_images(file.data(), file.size(), path);
}

Tensor read_idx_labels(const std::string& path, int64_t num_classes) {
  check_num_classes(path, num_classes);
  const std::vector<uint8_t> file = read_raw(path);
  check_gz_name(file.data(), file.size(), path);
  return parse_idx_labels(file.data(), file.size(), path, num_classes);
}

void write_idx_images(const std::string& path, const Tensor& images, bool gzip) {
  TANDEM_CHECK(images.defined(), Value, "write_idx_images('", path, "'): undefined tensor");
  TANDEM_CHECK(images.dtype() == kUInt8, DType, "write_idx_images('", path,
               "'): expected uint8 images, got ", dtype_name(images.dtype()));
  TANDEM_CHECK(images.dim() == 3, Shape, "write_idx_images('", path,
               "'): expected images [N, H, W], got ", shape_str(images.shape()));
  std::vector<uint8_t> data = images.to_vector<uint8_t>();
  write_file_atomic(path, idx_bytes(kIdxImagesMagic, images.shape(), data), gzip);
}

void write_idx_labels(const std::string& path, const Tensor& labels, bool gzip) {
  TANDEM_CHECK(labels.defined(), Value, "write_idx_labels('", path, "'): undefined tensor");
  TANDEM_CHECK(labels.dim() == 1, Shape, "write_idx_labels('", path,
               "'): expected labels [N], got ", shape_str(labels.shape()));
  std::vector<uint8_t> data;
  if (labels.dtype() == kUInt8) {
    data = labels.to_vector<uint8_t>();
  } else {
    TANDEM_CHECK(labels.dtype() == kInt64, DType, "write_idx_labels('", path,
                 "'): expected uint8 or int64 labels, got ", dtype_name(labels.dtype()));
    std::vector<int64_t> v = labels.to_vector<int64_t>();
    data.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      TANDEM_CHECK(v[i] >= 0 && v[i] <= 255, Value, "write_idx_labels('", path, "'): label ", i,
                   " is ", v[i], ", outside [0, 255]");
      data[i] = static_cast<uint8_t>(v[i]);
    }
  }
  write_file_atomic(path, idx_bytes(kIdxLabelsMagic, labels.shape(), data), gzip);
}

}  // namespace tandem::data
