#pragma once
// d2l's init_cnn, the initialization the models here use.
#include "core/generator.h"
#include "nn/module.h"

namespace tandem::nn::models {

// Every Conv2d and Linear in the tree: weight xavier_uniform_ (drawn from `gen`, modules in
// apply() order); biases keep the layer's default initialization (uniform in
// +-1/sqrt(fan_in), PyTorch's default), exactly as d2l's train_ch6 / init_cnn, which only
// re-initializes the weights. BatchNorm keeps weight 1, bias 0.
void init_cnn(Module& net, Generator& gen = default_generator());

}  // namespace tandem::nn::models
