#include "nn/models/resnet.h"

#include "nn/activation.h"
#include "nn/batchnorm.h"
#include "nn/conv.h"
#include "nn/init.h"
#include "nn/linear.h"
#include "nn/models/init_cnn.h"
#include "nn/pooling.h"
#include "nn/residual.h"

namespace tandem::nn::models {

namespace {

// d2l's resnet_block: the first block of every stage but the first halves H and W and
// changes the channel count through a 1x1-conv shortcut.
std::shared_ptr<SequentialImpl> stage(int64_t in, int64_t out, int64_t blocks, bool first_stage,
                                  Generator& gen) {
  auto s = std::make_shared<SequentialImpl>();
  for (int64_t i = 0; i < blocks; ++i) {
    if (i == 0 && !first_stage) {
      s->push_back(std::make_shared<Residual>(in, out, true, 2, gen));
    } else {
      s->push_back(std::make_shared<Residual>(out, out, false, 1, gen));
    }
  }
  return s;
}

}  // namespace

std::shared_ptr<SequentialImpl> resnet18(int64_t num_classes, int64_t in_channels, Generator& gen) {
  // Note [drawing the initialization once]: init_cnn below draws every weight and bias.
  std::shared_ptr<SequentialImpl> net;
  {
    init::SkipDefaultInitGuard skip;
    auto stem = std::make_shared<SequentialImpl>(std::vector<std::shared_ptr<Module>>{
        std::make_shared<Conv2d>(in_channels, 64, 3, 1, 1, true, gen),
        std::make_shared<BatchNorm2d>(64), std::make_shared<ReLU>()});
    net = std::make_shared<SequentialImpl>(std::vector<std::shared_ptr<Module>>{
        stem, stage(64, 64, 2, true, gen), stage(64, 128, 2, false, gen),
        stage(128, 256, 2, false, gen), stage(256, 512, 2, false, gen),
        std::make_shared<GlobalAvgPool2d>(), std::make_shared<Flatten>(),
        std::make_shared<Linear>(512, num_classes, true, gen)});
  }
  init_cnn(*net, gen);
  return net;
}

}  // namespace tandem::nn::models
