#pragma once
// A Fashion-MNIST stand-in for the program tests: 64 training and 32 test images of 28x28 with
// labels in [0, 10), noise with a bright band of rows at a place that depends on the label, so
// a few epochs learn something and the accuracies move. Written as the four .gz IDX files.
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "data/idx.h"

namespace tandem::test {

inline void write_tiny_dataset(const std::filesystem::path& dir) {
  for (auto [prefix, n] : {std::pair<std::string, int64_t>{"train", 64}, {"t10k", 32}}) {
    Tensor images = rand({n, 28, 28}, kFloat64);
    std::vector<uint8_t> px;
    for (double v : images.to_vector<double>()) px.push_back(static_cast<uint8_t>(v * 127));
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < n; ++i) {
      labels.push_back(i % 10);
      for (int64_t r = 2 * (i % 10) + 4; r < 2 * (i % 10) + 7; ++r)
        for (int64_t c = 0; c < 28; ++c) px[static_cast<size_t>(i * 784 + r * 28 + c)] = 255;
    }
    data::write_idx_images((dir / (prefix + "-images-idx3-ubyte.gz")).string(), from_vector(px, {n, 28, 28}), true);
    data::write_idx_labels((dir / (prefix + "-labels-idx1-ubyte.gz")).string(), from_vector(labels, {n}), true);
  }
}

}  // namespace tandem::test
