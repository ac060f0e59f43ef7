#pragma once
// ResNet-18 as in d2l (chapter "Residual Networks (ResNet)"), adapted to 28x28 input.
#include <memory>

#include "core/generator.h"
#include "nn/container.h"

namespace tandem::nn::models {

// Sequential(
//   (0) Sequential(Conv2d(in, 64, 3, padding 1), BatchNorm2d(64), ReLU)   [N, 64, 28, 28]
//       (no max-pool: 28x28 is already small)
//   (1) Sequential(Residual(64, 64), Residual(64, 64))                     [N, 64, 28, 28]
//   (2) Sequential(Residual(64, 128, 1x1, stride 2), Residual(128, 128))   [N, 128, 14, 14]
//   (3) Sequential(Residual(128, 256, 1x1, stride 2), Residual(256, 256))  [N, 256, 7, 7]
//   (4) Sequential(Residual(256, 512, 1x1, stride 2), Residual(512, 512))  [N, 512, 4, 4]
//   (5) GlobalAvgPool2d  (6) Flatten  (7) Linear(512, num_classes))        [N, num_classes]
// Initialized by init_cnn (Xavier-uniform weights, zero biases) from `gen`; convolutions have
// biases, as in d2l.
// 11,175,818 parameters for in_channels 1 and 10 classes.
std::shared_ptr<SequentialImpl> resnet18(int64_t num_classes = 10, int64_t in_channels = 1,
                                     Generator& gen = default_generator());

}  // namespace tandem::nn::models
