// nn::Sequential as libtorch spells it (a holder of nn::SequentialImpl, Note [module holders]
// in nn/module.h), checked against the shared_ptr style it stands for.
#include <cstdio>
#include <memory>
#include <sstream>
#include <type_traits>

#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "nn/activation.h"
#include "nn/container.h"
#include "nn/linear.h"
#include "nn/optim/adam.h"
#include "nn/serialize.h"
#include "parallel/distributed/ddp.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::values;

namespace {

// A hand-built model in libtorch's form: NetImpl and its holder Net.
class NetImpl : public nn::Cloneable<NetImpl> {
 public:
  explicit NetImpl(int64_t hidden = 4) {
    register_module("body", nn::Sequential(nn::Linear(2, hidden), nn::ReLU()));
    register_module("head", nn::Linear(hidden, 2));
  }
  std::string name() const override { return "Net"; }

 protected:
  Tensor forward_impl(const Tensor& x) override { return (*child("head"))((*child("body"))(x)); }
};
TANDEM_MODULE(Net);

// What DDP, DataParallel and the optimizers get: a shared module, a reference, parameters.
static_assert(std::is_convertible_v<nn::Sequential, std::shared_ptr<nn::Module>>);
static_assert(std::is_convertible_v<nn::Sequential, std::shared_ptr<nn::SequentialImpl>>);
static_assert(std::is_convertible_v<nn::Sequential, nn::Module&>);
static_assert(std::is_convertible_v<Net, std::shared_ptr<nn::Module>>);
static_assert(!std::is_convertible_v<nn::Sequential, std::shared_ptr<nn::Linear>>);
static_assert(std::is_constructible_v<parallel::distributed::DistributedDataParallel, nn::Sequential,
                                      std::shared_ptr<parallel::distributed::ProcessGroup>>);

}  // namespace

TEST_CASE("nn::Sequential is built, called and listed as in libtorch", "[nn][holder]") {
  nn::Sequential model(nn::Linear(2, 32), nn::ReLU(), nn::Linear(32, 2));
  const Tensor x = randn({5, 2});
  REQUIRE(model->size() == 3);
  // forward, operator() and the layers by hand give the same values.
  const auto& l0 = model->at<nn::Linear>(0);
  const auto& l2 = model->at<nn::Linear>(2);
  const Tensor by_hand = linear(relu(linear(x, l0.weight(), l0.bias())), l2.weight(), l2.bias());
  CHECK(values(model->forward(x)) == values(by_hand));
  CHECK(values(model(x)) == values(by_hand));
  CHECK(model->parameters().size() == 4);
  CHECK(model->named_parameters().keys() == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
  // A copy of the holder shares the module, as libtorch's does.
  nn::Sequential alias = model;
  CHECK(alias.get() == model.get());
  // The shared_ptr style names the same object.
  std::shared_ptr<nn::Module> as_module = model;
  std::shared_ptr<nn::SequentialImpl> as_impl = model;
  CHECK(as_module.get() == model.get());
  CHECK(as_impl == model.ptr());
  nn::Sequential rewrapped = as_impl;
  CHECK(rewrapped.get() == model.get());
}

TEST_CASE("A temporary layer is moved into the Sequential, not copied", "[nn][holder]") {
  nn::Linear layer(3, 2);
  const Tensor w = layer.weight();
  nn::Sequential s(std::move(layer), nn::ReLU());
  CHECK(s->at<nn::Linear>(0).weight().same(w));
  // Shared pointers and holders are shared, not copied.
  auto shared = std::make_shared<nn::Linear>(2, 3);
  nn::Sequential inner(nn::Linear(3, 3));
  nn::Sequential outer(shared, inner, nn::ReLU());
  CHECK(outer->at(0).parameters()[0].same(shared->weight()));
  CHECK(&outer->at(1) == inner.get());
  CHECK(outer->named_parameters().keys() ==
        std::vector<std::string>{"0.weight", "0.bias", "1.0.weight", "1.0.bias"});
  // push_back takes the three kinds too.
  nn::Sequential grown;
  grown->push_back(nn::Linear(2, 2));
  grown->push_back(shared);
  grown->push_back(inner);
  CHECK(grown->size() == 3);
}

TEST_CASE("A holder trains with Adam and saves and loads", "[nn][holder]") {
  nn::Sequential model(nn::Linear(2, 8), nn::ReLU(), nn::Linear(8, 2));
  nn::optim::Adam opt(model->parameters(), 1e-2);
  const Tensor x = randn({16, 2});
  const Tensor y = (x.sum(1) > 0).to(kInt64);
  const std::vector<double> before = values(model->parameters()[0]);
  Tensor loss = cross_entropy(model(x), y);
  opt.zero_grad();
  loss.backward();
  opt.step();
  CHECK(values(model->parameters()[0]) != before);
  const std::string path = "test_module_holder.safetensors";
  nn::save(model, path);
  nn::Sequential loaded(nn::Linear(2, 8), nn::ReLU(), nn::Linear(8, 2));
  nn::load(loaded, path);
  std::remove(path.c_str());
  CHECK(values(loaded(x)) == values(model(x)));
}

TEST_CASE("A TANDEM_MODULE holder registers holders and temporaries", "[nn][holder]") {
  Net net;
  Net wide(16);
  CHECK(net->named_parameters().keys() ==
        std::vector<std::string>{"body.0.weight", "body.0.bias", "head.weight", "head.bias"});
  CHECK(wide->child_as<nn::Linear>("head").in_features() == 16);
  CHECK(net(randn({3, 2})).shape() == Shape{3, 2});
  Net copy = net;
  CHECK(copy.get() == net.get());
}

TEST_CASE("Modules print their layer tree as PyTorch does", "[nn][holder]") {
  nn::Sequential model(nn::Linear(2, 32), nn::ReLU(), nn::Linear(32, 2, false));
  std::ostringstream s;
  s << model;
  CHECK(s.str() ==
        "Sequential(\n"
        "  (0): Linear(in_features=2, out_features=32, bias=true)\n"
        "  (1): ReLU()\n"
        "  (2): Linear(in_features=32, out_features=2, bias=false)\n"
        ")");
  std::ostringstream n;
  n << *Net();
  CHECK(n.str() ==
        "Net(\n"
        "  (body): Sequential(\n"
        "    (0): Linear(in_features=2, out_features=4, bias=true)\n"
        "    (1): ReLU()\n"
        "  )\n"
        "  (head): Linear(in_features=4, out_features=2, bias=true)\n"
        ")");
}

TEST_CASE("An empty holder is one clear error", "[nn][holder]") {
  nn::Sequential empty(nullptr);
  CHECK(empty.is_empty());
  CHECK(!empty);
  const std::string msg = tandem::test::error_message<ValueError>([&] { empty->forward(randn({1, 2})); });
  CHECK(contains(msg, "empty module holder"));
  CHECK_THROWS_AS(std::shared_ptr<nn::Module>(empty), ValueError);
  empty = nn::Sequential(nn::Linear(2, 2));
  CHECK(empty->size() == 1);
}
