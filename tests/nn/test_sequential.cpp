// Sequential's children called the way PyTorch's model[i](x) reads.
#include <memory>

#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "nn/activation.h"
#include "nn/container.h"
#include "nn/linear.h"

using namespace tandem;
using tandem::test::values;

TEST_CASE("Sequential children are callable by index", "[nn]") {
  auto model = std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(3, 4), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(4, 2)});
  const Tensor x = randn({5, 3});
  // Layer by layer, both spellings, give what the whole model gives.
  Tensor h = x;
  for (size_t i = 0; i < model->size(); ++i) h = (i % 2 == 0) ? (*model)[i](h) : model->at(i)(h);
  REQUIRE(values(h) == values((*model)(x)));
  // The index still hands out the shared module, and the typed form still checks the type.
  std::shared_ptr<nn::Module> first = (*model)[0];
  REQUIRE(first.get() == &model->at(0));
  REQUIRE((*model)[1]->name() == "ReLU");
  REQUIRE(model->at<nn::Linear>(2).name() == "Linear");
  REQUIRE_THROWS_AS(model->at<nn::Linear>(1), ValueError);
  REQUIRE_THROWS_AS(model->at(3), ValueError);
  REQUIRE_THROWS_AS((*model)[7](x), ValueError);
}
