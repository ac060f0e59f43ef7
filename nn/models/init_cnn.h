#pragma once
// d2l's init_cnn, the initialization the models here use.
#include "core/generator.h"
#include "nn/module.h"

namespace tandem::nn::models {

// Every Conv2d and Linear in the tree: weight xavier_uniform_ (drawn from `gen`, modules in
// apply() order), bias zeros. d2l applies Xavier-uniform to these weights for LeNet and ResNet
// (init_cnn / train_ch6); zero biases make the start independent of the default bias draw
// and match the PyTorch side of the benchmarks. BatchNorm keeps weight 1, bias 0.
// Overwrites every Conv2d and Linear weight and bias, so the models build their layers under
// init::SkipDefaultInitGuard and draw each weight once (Note [drawing the initialization
// once] in nn/init.h).
void init_cnn(Module& net, Generator& gen = default_generator());

}  // namespace tandem::nn::models
