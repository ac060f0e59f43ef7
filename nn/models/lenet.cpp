#include "nn/models/lenet.h"

#include "nn/activation.h"
#include "nn/conv.h"
#include "nn/init.h"
#include "nn/linear.h"
#include "nn/models/init_cnn.h"
#include "nn/pooling.h"

namespace tandem::nn::models {

namespace {

std::shared_ptr<Module> activation(LeNetActivation a) {
  if (a == LeNetActivation::ReLU) return std::make_shared<ReLU>();
  return std::make_shared<Sigmoid>();
}

std::shared_ptr<Module> pool(LeNetActivation a) {
  if (a == LeNetActivation::ReLU) return std::make_shared<MaxPool2d>(2, 2);
  return std::make_shared<AvgPool2d>(2, 2);
}

}  // namespace

std::shared_ptr<SequentialImpl> lenet(const LeNetOptions& options, Generator& gen) {
  const LeNetActivation a = options.activation;
  // Note [drawing the initialization once]: init_cnn below draws every weight and bias.
  std::shared_ptr<SequentialImpl> net;
  {
    init::SkipDefaultInitGuard skip;
    net = std::make_shared<SequentialImpl>(std::vector<std::shared_ptr<Module>>{
        std::make_shared<Conv2d>(1, 6, 5, 1, 2, true, gen), activation(a), pool(a),
        std::make_shared<Conv2d>(6, 16, 5, 1, 0, true, gen), activation(a), pool(a),
        std::make_shared<Flatten>(), std::make_shared<Linear>(16 * 5 * 5, 120, true, gen),
        activation(a), std::make_shared<Linear>(120, 84, true, gen), activation(a),
        std::make_shared<Linear>(84, options.num_classes, true, gen)});
  }
  init_cnn(*net, gen);
  return net;
}

}  // namespace tandem::nn::models
