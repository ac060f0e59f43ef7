#pragma once
// LeNet-5 as in d2l (chapter "Convolutional Neural Networks (LeNet)"), for 1x28x28 input.
#include <memory>

#include "core/generator.h"
#include "nn/container.h"

namespace tandem::nn::models {

enum class LeNetActivation : uint8_t { Sigmoid, ReLU };

struct LeNetOptions {
  // Sigmoid pairs with average pooling (the original d2l network), ReLU with max pooling.
  LeNetActivation activation = LeNetActivation::Sigmoid;
  int64_t num_classes = 10;
};

// Sequential(
//   (0) Conv2d(1, 6, 5, padding 2)  (1) act  (2) pool 2x2/2      [N, 6, 14, 14]
//   (3) Conv2d(6, 16, 5)            (4) act  (5) pool 2x2/2      [N, 16, 5, 5]
//   (6) Flatten                                                  [N, 400]
//   (7) Linear(400, 120)  (8) act  (9) Linear(120, 84)  (10) act  (11) Linear(84, classes))
// Initialized by init_cnn (Xavier-uniform weights, zero biases) from `gen`.
// 61,706 parameters with 10 classes.
std::shared_ptr<SequentialImpl> lenet(const LeNetOptions& options = {},
                                  Generator& gen = default_generator());

}  // namespace tandem::nn::models
