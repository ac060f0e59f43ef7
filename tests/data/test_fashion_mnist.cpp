// load_fashion_mnist on small synthetic files with the standard names.
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"
#include "data_test_util.h"

using namespace tandem;
using namespace tandem::data;
using tandem::test::check_throws_containing;
using tandem::test::idx_file;
using tandem::test::TempDir;

namespace {

// n images of 28x28 whose pixel p of image i is (i * 31 + p) % 256.
std::vector<uint8_t> pixels(uint32_t n) {
  std::vector<uint8_t> v(size_t(n) * 28 * 28);
  for (size_t i = 0; i < n; ++i)
    for (size_t p = 0; p < 28 * 28; ++p) v[i * 784 + p] = static_cast<uint8_t>((i * 31 + p) % 256);
  return v;
}

void write_split(const TempDir& dir, const std::string& prefix, uint32_t n_images,
                 uint32_t n_labels, bool images_gz, bool labels_gz) {
  std::vector<uint8_t> labels(n_labels);
  for (uint32_t i = 0; i < n_labels; ++i) labels[i] = static_cast<uint8_t>((i * 7) % 10);
  write_file_atomic(dir.file(prefix + "-images-idx3-ubyte" + (images_gz ? ".gz" : "")),
                    idx_file(kIdxImagesMagic, {n_images, 28, 28}, pixels(n_images)), images_gz);
  write_file_atomic(dir.file(prefix + "-labels-idx1-ubyte" + (labels_gz ? ".gz" : "")),
                    idx_file(kIdxLabelsMagic, {n_labels}, labels), labels_gz);
}

}  // namespace

TEST_CASE("fashion_mnist: loads gzipped and raw files, scaled to [0, 1]", "[data]") {
  TempDir dir;
  write_split(dir, "train", 6, 6, true, false);  // images gzipped, labels raw
  write_split(dir, "t10k", 3, 3, false, true);

  FashionMnist train = load_fashion_mnist(dir.path().string(), true);
  CHECK(train.images.shape() == Shape{6, 1, 28, 28});
  CHECK(train.images.dtype() == kFloat32);
  CHECK(train.labels.shape() == Shape{6});
  CHECK(train.labels.dtype() == kInt64);
  CHECK(train.images_path == dir.file("train-images-idx3-ubyte.gz"));
  CHECK(train.labels_path == dir.file("train-labels-idx1-ubyte"));
  std::vector<float> px = train.images.to_vector<float>();
  std::vector<uint8_t> want = pixels(6);
  REQUIRE(px.size() == want.size());
  bool exact = true;
  for (size_t i = 0; i < px.size(); ++i)
    exact = exact && px[i] == static_cast<float>(want[i]) / 255.0f;
  CHECK(exact);
  CHECK(train.labels.to_vector<int64_t>() == std::vector<int64_t>{0, 7, 4, 1, 8, 5});

  FashionMnist test = load_fashion_mnist(dir.path().string(), false);
  CHECK(test.images.shape() == Shape{3, 1, 28, 28});
  CHECK(test.labels.to_vector<int64_t>() == std::vector<int64_t>{0, 7, 4});

  FashionMnist few = load_fashion_mnist(dir.path().string(), true, 4);
  CHECK(few.images.shape() == Shape{4, 1, 28, 28});
  CHECK(few.labels.to_vector<int64_t>() == std::vector<int64_t>{0, 7, 4, 1});
  CHECK(load_fashion_mnist(dir.path().string(), true, 100).labels.size(0) == 6);
  check_throws_containing<ValueError>([&] { load_fashion_mnist(dir.path().string(), true, -2); },
                                      {"limit"});
}

TEST_CASE("fashion_mnist: image/label count mismatch names both files and counts", "[data]") {
  TempDir dir;
  write_split(dir, "train", 5, 4, true, true);
  check_throws_containing<FormatError>(
      [&] { load_fashion_mnist(dir.path().string(), true); },
      {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "5 images", "4 labels"});
}

TEST_CASE("fashion_mnist: missing files and wrong image size", "[data]") {
  TempDir dir;
  check_throws_containing<IOError>([&] { load_fashion_mnist(dir.path().string(), false); },
                                   {"t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte'"});
  write_file_atomic(dir.file("t10k-images-idx3-ubyte"),
                    idx_file(kIdxImagesMagic, {2, 4, 3}, std::vector<uint8_t>(24, 1)), false);
  write_file_atomic(dir.file("t10k-labels-idx1-ubyte"), idx_file(kIdxLabelsMagic, {2}, {1, 2}),
                    false);
  check_throws_containing<FormatError>([&] { load_fashion_mnist(dir.path().string(), false); },
                                       {"t10k-images-idx3-ubyte", "4x3"});
}

TEST_CASE("fashion_mnist: a directory where a file should be is named as a directory", "[data]") {
  TempDir dir;
  write_split(dir, "t10k", 2, 2, false, false);
  std::filesystem::remove(dir.file("t10k-images-idx3-ubyte"));
  for (const char* name : {"t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"}) {
    DYNAMIC_SECTION(name) {
      std::filesystem::create_directory(dir.file(name));
      check_throws_containing<IOError>([&] { load_fashion_mnist(dir.path().string(), false); },
                                       {"'" + dir.file(name) + "' is a directory"});
    }
  }
}

TEST_CASE("fashion_mnist: class names", "[data]") {
  CHECK(fashion_mnist_class_names().size() == 10);
  CHECK(std::strcmp(fashion_mnist_class_name(0), "T-shirt/top") == 0);
  CHECK(std::strcmp(fashion_mnist_class_name(9), "Ankle boot") == 0);
  CHECK_THROWS_AS(fashion_mnist_class_name(10), ValueError);
  CHECK(std::string(kFashionMnistDefaultDir) == "/usr/share/datasets/fashion-mnist");
}
