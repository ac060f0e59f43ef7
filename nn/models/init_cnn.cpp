#include "nn/models/init_cnn.h"

#include "nn/conv.h"
#include "nn/init.h"
#include "nn/linear.h"

namespace tandem::nn::models {

void init_cnn(Module& net, Generator& gen) {
  net.apply([&gen](Module& m) {
    if (dynamic_cast<Conv2d*>(&m) == nullptr && dynamic_cast<Linear*>(&m) == nullptr) return;
    init::xavier_uniform_(m.parameter("weight"), 1.0, gen);
    if (Tensor b = m.find_parameter("bias"); b.defined()) init::zeros_(b);
  });
}

}  // namespace tandem::nn::models
