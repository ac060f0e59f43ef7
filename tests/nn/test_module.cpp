// Module: registration, names and order, state_dict, clone, to(Device), zero_grad, errors.
#include <memory>

#include "autograd/ops.h"
#include "helpers.h"
#include "nn/nn.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

// A user-defined module written the documented way: state in the registry, config in members.
class Affine : public Cloneable<Affine> {
 public:
  explicit Affine(int64_t n) : n_(n) {
    register_parameter("scale", ones({n}));
    register_parameter("shift", zeros({n}));
    register_buffer("calls", zeros({1}));
  }
  std::string name() const override { return "Affine"; }

 protected:
  Tensor forward_impl(const Tensor& x) override {
    return x * parameter("scale") + parameter("shift");
  }

 private:
  int64_t n_;
};

std::shared_ptr<SequentialImpl> small_net() {
  return std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Linear>(3, 4), std::make_shared<ReLU>(),
      std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
          std::make_shared<Linear>(4, 2, false), std::make_shared<BatchNorm2d>(2)})});
}

// True when no parameter or buffer of a shares storage with one of b.
bool storage_disjoint(const Module& a, const Module& b) {
  auto ta = a.state_dict(), tb = b.state_dict();
  for (const auto& [ka, x] : ta) {
    for (const auto& [kb, y] : tb) {
      if (x.storage() == y.storage()) return false;
    }
  }
  return true;
}

void check_clone(const Module& original) {
  std::shared_ptr<Module> copy = original.clone();
  REQUIRE(copy != nullptr);
  CHECK(copy->name() == original.name());
  CHECK(copy->str() == original.str());
  CHECK(copy->is_training() == original.is_training());
  auto a = original.state_dict(), b = copy->state_dict();
  REQUIRE(a.keys() == b.keys());
  for (const auto& [key, t] : a) {
    INFO(key);
    CHECK(values(t) == values(b.at(key)));
  }
  CHECK(storage_disjoint(original, *copy));
  for (const auto& p : copy->parameters()) {
    CHECK(p.is_leaf());
    CHECK(p.requires_grad());
  }
  // Mutating the clone leaves the original untouched.
  const std::vector<double> before = values(original.parameters().front());
  for (const auto& p : copy->parameters()) p.fill_(7.0);
  for (const auto& t : copy->buffers()) t.fill_(7.0);
  CHECK(values(original.parameters().front()) == before);
  for (const auto& [key, t] : original.state_dict()) {
    INFO(key);
    CHECK(values(t) == values(a.at(key)));
  }
}

}  // namespace

TEST_CASE("Module registers parameters, buffers and children in order", "[nn]") {
  auto net = small_net();
  auto names = net->named_parameters().keys();
  CHECK(names ==
        std::vector<std::string>{"0.weight", "0.bias", "2.0.weight", "2.1.weight", "2.1.bias"});
  CHECK(net->named_buffers().keys() ==
        std::vector<std::string>{"2.1.running_mean", "2.1.running_var", "2.1.num_batches_tracked"});
  CHECK(net->state_dict().keys() ==
        std::vector<std::string>{"0.weight", "0.bias", "2.0.weight", "2.1.weight", "2.1.bias",
                                 "2.1.running_mean", "2.1.running_var", "2.1.num_batches_tracked"});
  CHECK(net->num_parameters() == 12 + 4 + 8 + 2 + 2);
  CHECK(net->children().size() == 3);
  CHECK(net->parameters(false).empty());
  CHECK((*net)[2]->parameters(false).empty());
  CHECK(net->size() == 3);
  CHECK(net->at<Linear>(0).out_features() == 4);
  CHECK_THROWS_AS(net->at<Linear>(1), ValueError);
  CHECK_THROWS_AS((*net)[3], ValueError);

  auto params = net->parameters();
  REQUIRE(params.size() == 5);
  CHECK(params[0].same(net->at<Linear>(0).weight()));
  for (const auto& p : params) {
    CHECK(p.requires_grad());
    CHECK(p.is_leaf());
  }
  for (const auto& b : net->buffers()) CHECK_FALSE(b.requires_grad());

  int visited = 0;
  net->apply([&](Module&) { ++visited; });
  CHECK(visited == 6);  // net, Linear, ReLU, inner Sequential, Linear, BatchNorm2d
  CHECK(contains(net->str(), "(0): Linear(in_features=3, out_features=4, bias=true)"));
  CHECK(contains(net->str(), "(1): BatchNorm2d(2, eps=1e-05, momentum=0.1)"));

  SECTION("a shared parameter is listed once") {
    auto lin = std::make_shared<Linear>(2, 2);
    SequentialImpl tied{lin, lin};
    CHECK(tied.parameters().size() == 2);
    CHECK(tied.state_dict().size() == 4);  // both names, as PyTorch's state_dict
  }
}

TEST_CASE("Module registration errors", "[nn]") {
  Affine m(3);
  CHECK_THROWS_AS(m.register_parameter("scale", ones({3})), ValueError);
  CHECK_THROWS_AS(m.register_buffer("calls", ones({3})), ValueError);
  CHECK_THROWS_AS(m.register_parameter("a.b", ones({3})), ValueError);
  CHECK_THROWS_AS(m.register_parameter("", ones({3})), ValueError);
  CHECK_THROWS_AS(m.register_parameter("ints", zeros({3}, kInt64)), DTypeError);
  CHECK_THROWS_AS(m.register_module("null", std::shared_ptr<Module>()), ValueError);
  Tensor leaf = ones({3}).set_requires_grad();
  Tensor non_leaf = leaf * 2.0;
  CHECK_THROWS_AS(m.register_parameter("derived", non_leaf), ValueError);
  Tensor elsewhere = ones({3}).to(Device::cpu(1));
  std::string msg =
      error_message<DeviceError>([&] { m.register_parameter("elsewhere", elsewhere); });
  CHECK(contains(msg, "cpu:1"));
  CHECK(contains(msg, "cpu:0"));
  CHECK_THROWS_AS(m.parameter("missing"), ValueError);
  CHECK_FALSE(m.find_parameter("missing").defined());
  CHECK(m.find_parameter("scale").defined());
}

TEST_CASE("state_dict round trip and load errors", "[nn]") {
  manual_seed(1);
  auto a = models::lenet();
  auto b = models::lenet();
  REQUIRE(values(a->parameters()[0]) != values(b->parameters()[0]));

  SECTION("round trip copies values, not storage") {
    b->load_state_dict(a->state_dict());
    for (const auto& [key, t] : a->state_dict()) {
      INFO(key);
      CHECK(values(t) == values(b->state_dict().at(key)));
    }
    CHECK(storage_disjoint(*a, *b));
    for (const auto& p : b->parameters()) CHECK(p.is_leaf());
  }
  SECTION("buffers are part of the state") {
    auto n1 = small_net(), n2 = small_net();
    n1->at<SequentialImpl>(2).at<BatchNorm2d>(1).running_mean().fill_(0.25);
    n2->load_state_dict(n1->state_dict());
    CHECK(values(n2->state_dict().at("2.1.running_mean")) == std::vector<double>{0.25, 0.25});
  }
  SECTION("missing key") {
    StateDict sd;
    for (const auto& [k, t] : a->state_dict()) {
      if (k != "3.bias") sd.insert(k, t);
    }
    std::string msg = error_message<ValueError>([&] { b->load_state_dict(sd); });
    CHECK(contains(msg, "missing key '3.bias'"));
  }
  SECTION("shape mismatch") {
    StateDict sd = a->state_dict();
    sd.insert_or_assign("7.weight", zeros({120, 401}));
    std::string msg = error_message<ShapeError>([&] { b->load_state_dict(sd); });
    CHECK(contains(msg, "'7.weight'"));
    CHECK(contains(msg, "[120,401]"));
    CHECK(contains(msg, "[120,400]"));
  }
  SECTION("unexpected key") {
    StateDict sd = a->state_dict();
    sd.insert("99.weight", zeros({1}));
    std::string msg = error_message<ValueError>([&] { b->load_state_dict(sd); });
    CHECK(contains(msg, "unexpected key '99.weight'"));
    b->load_state_dict(sd, /*strict=*/false);
    CHECK(values(b->parameters()[0]) == values(a->parameters()[0]));
  }
  SECTION("a failed load changes nothing") {
    std::vector<double> before = values(b->parameters()[0]);
    StateDict sd = a->state_dict();
    sd.insert_or_assign("11.bias", zeros({11}));
    CHECK_THROWS_AS(b->load_state_dict(sd), ShapeError);
    CHECK(values(b->parameters()[0]) == before);
  }
}

TEST_CASE("clone is a deep copy: LeNet", "[nn]") {
  auto net = models::lenet({models::LeNetActivation::ReLU});
  check_clone(*net);
  net->eval();
  auto copy = std::dynamic_pointer_cast<SequentialImpl>(net->clone());
  REQUIRE(copy != nullptr);
  CHECK_FALSE(copy->is_training());
  CHECK_FALSE((*copy)[0]->is_training());
  Tensor x = randn({2, 1, 28, 28});
  CHECK(values((*net)(x)) == values((*copy)(x)));
}

TEST_CASE("clone is a deep copy: ResNet-18 and custom modules", "[nn]") {
  auto net = models::resnet18();
  net->at<SequentialImpl>(0).at<BatchNorm2d>(1).running_var().fill_(3.0);
  check_clone(*net);
  auto copy = net->clone();
  CHECK(values(copy->state_dict().at("0.1.running_var"))[0] == 3.0);
  // The typed accessors of the copy see the copy's own children.
  auto& block = std::dynamic_pointer_cast<SequentialImpl>(copy)->at<SequentialImpl>(2).at<Residual>(0);
  CHECK(block.use_1x1conv());
  CHECK(block.conv1().weight().same(copy->named_parameters().at("2.0.conv1.weight")));

  Affine affine(4);
  check_clone(affine);
}

TEST_CASE("to(Device) moves in place and keeps leaves", "[nn]") {
  const Device cpu1 = Device::cpu(1);
  auto net = small_net();
  auto params_before = net->parameters();
  Tensor x = randn({5, 3});
  Tensor y0 = (*net)(x);
  y0.backward(ones({5, 2}));
  REQUIRE(params_before[0].grad().defined());
  auto sgd = optim::SGD(net->parameters(), 0.1, 0.9);
  sgd.step();  // momentum buffers now live on cpu:0
  REQUIRE(sgd.momentum_buffer(0).device() == kCPU);

  net->to(cpu1);
  CHECK(net->device() == cpu1);
  auto params_after = net->parameters();
  REQUIRE(params_after.size() == params_before.size());
  for (size_t i = 0; i < params_after.size(); ++i) {
    CHECK(params_after[i].same(params_before[i]));  // the same tensors, now on cpu:1
    CHECK(params_after[i].device() == cpu1);
    CHECK(params_after[i].is_leaf());
    CHECK(params_after[i].requires_grad());
    CHECK(params_after[i].grad().device() == cpu1);
  }
  for (const auto& b : net->buffers()) CHECK(b.device() == cpu1);
  CHECK((*net)[1]->device() == cpu1);  // parameter-free children are pinned too

  // Input on the wrong device: a clear error naming both devices.
  std::string msg = error_message<DeviceError>([&] { (*net)(x); });
  CHECK(contains(msg, "Sequential"));
  CHECK(contains(msg, "cpu:0"));
  CHECK(contains(msg, "cpu:1"));

  // Training continues on the new device, with the optimizer built before the move.
  net->zero_grad();
  Tensor y1 = (*net)(x.to(cpu1));
  CHECK(y1.device() == cpu1);
  sum(y1 * y1).backward();
  sgd.step();
  for (const auto& p : net->parameters()) CHECK(p.device() == cpu1);
  CHECK(sgd.momentum_buffer(0).device() == cpu1);

  // A module without tensors accepts any device until it is moved.
  ReLU relu;
  CHECK(relu(x.to(cpu1)).device() == cpu1);
  CHECK(relu(x).device() == kCPU);
  CHECK_THROWS_AS(Linear(2, 2)(Tensor()), ValueError);
}

TEST_CASE("zero_grad sets to none or zeros", "[nn]") {
  Linear lin(3, 2);
  sum(lin(randn({4, 3}))).backward();
  REQUIRE(lin.weight().grad().defined());
  lin.zero_grad(/*set_to_none=*/false);
  REQUIRE(lin.weight().grad().defined());
  for (double v : values(lin.weight().grad())) CHECK(v == 0.0);
  lin.zero_grad();
  CHECK_FALSE(lin.weight().grad().defined());
  CHECK_FALSE(lin.bias().grad().defined());
}
