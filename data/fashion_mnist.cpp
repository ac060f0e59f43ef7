#include "data/fashion_mnist.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "data/idx.h"

namespace tandem::data {

namespace {

// dir/name.gz when it is a file, else dir/name when it is a file, else IOError: naming what is
// there instead (a directory, ...) when one of the two paths exists, else both paths.
std::string find_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  fs::path gz = fs::path(dir) / (name + ".gz");
  fs::path raw = fs::path(dir) / name;
  std::error_code ec;
  if (fs::is_regular_file(gz, ec)) return gz.string();
  if (fs::is_regular_file(raw, ec)) return raw.string();
  for (const fs::path& p : {gz, raw}) {
    const fs::file_status st = fs::status(p, ec);
    if (!fs::exists(st)) continue;
    TANDEM_THROW(IO, "Fashion-MNIST: '", p.string(), "' is ",
                 fs::is_directory(st) ? "a directory" : "not a regular file", ", not an IDX file");
  }
  TANDEM_THROW(IO, "Fashion-MNIST: neither '", gz.string(), "' nor '", raw.string(),
               "' exists (is the dataset in '", dir, "'?)");
}

}  // namespace

const std::array<const char*, 10>& fashion_mnist_class_names() {
  static const std::array<const char*, 10> names = {
      "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
      "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return names;
}

const char* fashion_mnist_class_name(int64_t label) {
  TANDEM_CHECK(label >= 0 && label < kFashionMnistClasses, Value,
               "fashion_mnist_class_name: label ", label, " outside [0, ", kFashionMnistClasses,
               ")");
  return fashion_mnist_class_names()[static_cast<size_t>(label)];
}

FashionMnist load_fashion_mnist(const std::string& dir, bool train, int64_t limit) {
  TANDEM_CHECK(limit >= -1, Value, "load_fashion_mnist: limit must be >= 0 or -1 (all), got ",
               limit);
  const std::string prefix = train ? "train" : "t10k";
  FashionMnist ds;
  ds.images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  ds.labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");

  Tensor raw = read_idx_images(ds.images_path);                           // uint8 [N, 28, 28]
  Tensor labels = read_idx_labels(ds.labels_path, kFashionMnistClasses);  // int64 [N]
  const int64_t n_images = raw.size(0), n_labels = labels.size(0);
  TANDEM_CHECK(n_images == n_labels, Format, "Fashion-MNIST: '", ds.images_path, "' has ", n_images,
               " images but '", ds.labels_path, "' has ", n_labels, " labels");
  TANDEM_CHECK(raw.size(1) == kFashionMnistRows && raw.size(2) == kFashionMnistCols, Format,
               "Fashion-MNIST: '", ds.images_path, "' holds images of ", raw.size(1), "x",
               raw.size(2), ", expected ", kFashionMnistRows, "x", kFashionMnistCols);

  const int64_t n = limit < 0 ? n_images : std::min(limit, n_images);
  ds.images = empty({n, 1, kFashionMnistRows, kFashionMnistCols}, kFloat32, kCPU);
  const uint8_t* src = raw.data<uint8_t>();
  float* dst = ds.images.data<float>();
  const int64_t count = n * kFashionMnistRows * kFashionMnistCols;
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]) / 255.0f;
  ds.labels = n == n_labels ? labels : labels.slice(0, 0, n).clone();
  return ds;
}

}  // namespace tandem::data
