#pragma once
// Fashion-MNIST (Xiao et al. 2017): 28x28 grayscale images of 10 kinds of clothing,
// 60,000 for training and 10,000 for testing, in the IDX format of MNIST.
//
// The loader looks in `dir` for the four standard files, each gzipped or raw:
//   train-images-idx3-ubyte(.gz)  train-labels-idx1-ubyte(.gz)
//   t10k-images-idx3-ubyte(.gz)   t10k-labels-idx1-ubyte(.gz)
// preferring the .gz one when both exist.
#include <array>
#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace tandem::data {

inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";
inline constexpr int64_t kFashionMnistClasses = 10;
inline constexpr int64_t kFashionMnistRows = 28;
inline constexpr int64_t kFashionMnistCols = 28;

// Class names in label order (0 = "T-shirt/top", ..., 9 = "Ankle boot").
const std::array<const char*, 10>& fashion_mnist_class_names();
// The name of one label; throws ValueError outside [0, 10).
const char* fashion_mnist_class_name(int64_t label);

struct FashionMnist {
  Tensor images;                         // float32 [N, 1, 28, 28] in [0, 1] (pixel / 255), CPU
  Tensor labels;                         // int64 [N] in [0, 10), CPU
  std::string images_path, labels_path;  // the files that were read
};

// Loads the training (train = true) or test split from dir. limit >= 0 keeps only the first
// `limit` samples (all of them when limit exceeds the split); -1 keeps everything.
// Throws IOError naming the paths tried when a file is missing, FormatError (naming both
// files and both counts) when the image and label counts differ, and FormatError when the
// images are not 28x28.
FashionMnist load_fashion_mnist(const std::string& dir, bool train, int64_t limit = -1);

}  // namespace tandem::data
