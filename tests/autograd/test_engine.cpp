// The backward engine: accumulation, shared subgraphs, graph lifetime, hooks, grad mode.
#include <cmath>
#include <thread>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"

using namespace tandem;
using tandem::test::values;

namespace {

Tensor leaf_of(const std::vector<double>& v) {
  Tensor t = from_vector(v, {static_cast<int64_t>(v.size())});
  t.set_requires_grad();
  return t;
}

}  // namespace

TEST_CASE("gradients accumulate across backward calls", "[autograd]") {
  Tensor x = leaf_of({1.0, -2.0, 3.0});
  sum(x * x).backward();
  REQUIRE(values(x.grad()) == std::vector<double>{2.0, -4.0, 6.0});
  sum(x * 3.0).backward();
  REQUIRE(values(x.grad()) == std::vector<double>{5.0, -1.0, 9.0});
  x.set_grad(Tensor());
  REQUIRE_FALSE(x.grad().defined());
}

TEST_CASE("a diamond graph sums both paths before the shared node runs", "[autograd]") {
  Tensor x = leaf_of({0.5, -1.0});
  Tensor a = x * 2.0;
  Tensor b = exp(x);
  sum(a * b).backward();  // d/dx 2x e^x = 2 e^x + 2x e^x
  auto g = values(x.grad());
  for (int i = 0; i < 2; ++i) {
    const double xv = i == 0 ? 0.5 : -1.0;
    REQUIRE(g[i] == Approx(2 * std::exp(xv) + 2 * xv * std::exp(xv)));
  }
  Tensor y = leaf_of({3.0});
  Tensor h = y * 2.0;         // h used twice: its node receives two gradients
  sum(h * h + h).backward();  // d/dy (4y^2 + 2y) = 8y + 2
  REQUIRE(values(y.grad())[0] == Approx(26.0));
}

TEST_CASE("retain_graph allows a second backward, and without it reuse throws", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  Tensor y = sum(exp(x) * x);
  y.backward(Tensor(), /*retain_graph=*/true);
  auto first = values(x.grad());
  y.backward();  // frees the graph
  auto second = values(x.grad());
  REQUIRE(second[0] == Approx(2 * first[0]));
  REQUIRE(second[1] == Approx(2 * first[1]));
  REQUIRE_THROWS_AS(y.backward(), Error);
}

TEST_CASE("hooks fire once per backward with the final summed gradient", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  std::vector<std::pair<int, std::vector<double>>> calls;
  x.register_grad_hook([&](const Tensor& g) { calls.emplace_back(0, values(g)); });
  const int id = x.register_grad_hook([&](const Tensor& g) { calls.emplace_back(1, values(g)); });
  // x reaches the loss along three paths; the hook sees their sum once.
  sum(x * 2.0 + x * 3.0 + x).backward();
  REQUIRE(calls.size() == 2);
  REQUIRE(calls[0].first == 0);
  REQUIRE(calls[1].first == 1);
  REQUIRE(calls[0].second == std::vector<double>{6.0, 6.0});
  x.remove_grad_hook(id);
  sum(x).backward();  // the hook sees .grad after accumulation
  REQUIRE(calls.size() == 3);
  REQUIRE(calls[2].second == std::vector<double>{7.0, 7.0});
}

TEST_CASE("a hook may modify .grad in place (as an allreduce does)", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  x.register_grad_hook([](const Tensor& g) { g.copy_(kernels::scalar(ScalarOp::Mul, g, 0.5)); });
  sum(x * 4.0).backward();
  REQUIRE(values(x.grad()) == std::vector<double>{2.0, 2.0});
  REQUIRE_THROWS_AS((x * 2.0).register_grad_hook([](const Tensor&) {}), ValueError);
}

TEST_CASE("the first accumulated gradient never aliases the incoming buffer", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0, 3.0});
  Tensor go = from_vector<double>({1.0, 1.0, 1.0}, {3});
  reshape(x, {3, 1}).backward(go.reshape({3, 1}));
  REQUIRE(x.grad().raw_data() != go.raw_data());
  go.fill_(5.0);
  REQUIRE(values(x.grad()) == std::vector<double>{1.0, 1.0, 1.0});
}

TEST_CASE("NoGradGuard records nothing and is thread-local", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  REQUIRE(grad_enabled());
  {
    NoGradGuard guard;
    REQUIRE_FALSE(grad_enabled());
    Tensor y = x * 2.0;
    REQUIRE_FALSE(y.requires_grad());
    REQUIRE(y.is_leaf());
    bool other_thread_records = false;
    std::thread t([&] { other_thread_records = (x * 2.0).requires_grad(); });
    t.join();
    REQUIRE(other_thread_records);
  }
  REQUIRE(grad_enabled());
  bool guarded_thread_records = true;
  std::thread t([&] {
    NoGradGuard guard;
    guarded_thread_records = (x * 2.0).requires_grad();
  });
  t.join();
  REQUIRE_FALSE(guarded_thread_records);
  REQUIRE((x * 2.0).requires_grad());
}

TEST_CASE("requires_grad propagates, and leaves and dtypes are checked", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  Tensor c = from_vector<double>({3.0, 4.0}, {2});
  REQUIRE(x.is_leaf());
  REQUIRE_FALSE(c.requires_grad());
  Tensor y = x * c;
  REQUIRE(y.requires_grad());
  REQUIRE_FALSE(y.is_leaf());
  REQUIRE_FALSE((c * c).requires_grad());
  REQUIRE((c + y).requires_grad());
  Tensor labels = from_vector<int64_t>({1, 2}, {2});
  REQUIRE_THROWS_AS(labels.set_requires_grad(), DTypeError);
  REQUIRE_NOTHROW(labels.set_requires_grad(false));
  REQUIRE_THROWS_AS(y.set_requires_grad(false), ValueError);
  REQUIRE_THROWS_AS(sum(c).backward(), Error);  // nothing requires grad
  // Only the input that requires grad gets one.
  sum(y).backward();
  REQUIRE(values(x.grad()) == std::vector<double>{3.0, 4.0});
  REQUIRE_FALSE(c.grad().defined());
}

TEST_CASE("detach shares storage and cuts history", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  Tensor y = x * 3.0;
  Tensor d = y.detach();
  REQUIRE_FALSE(d.requires_grad());
  REQUIRE(d.is_leaf());
  REQUIRE(d.raw_data() == y.raw_data());
  sum(x * d).backward();  // d is a constant: dx = d
  REQUIRE(values(x.grad()) == std::vector<double>{3.0, 6.0});
}

TEST_CASE("a 10000-op chain runs backward and is freed without recursion", "[autograd]") {
  Tensor x = leaf_of({1.0});
  Tensor y = x;
  for (int i = 0; i < 10000; ++i) y = y * 1.0001;
  y.backward();
  REQUIRE(values(x.grad())[0] == Approx(std::pow(1.0001, 10000)).epsilon(1e-9));
  // A longer graph that is never run: dropping it must not overflow the stack either.
  Tensor z = x;
  for (int i = 0; i < 200000; ++i) z = z + 0.5;
  z = Tensor();
  SUCCEED();
}

TEST_CASE("backward of a non-scalar needs grad_output", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  Tensor y = x * 2.0;
  REQUIRE_THROWS_AS(y.backward(), ValueError);
  REQUIRE_THROWS_AS(y.backward(from_vector<double>({1.0}, {1})), ShapeError);
  y.backward(from_vector<double>({3.0, -1.0}, {2}));
  REQUIRE(values(x.grad()) == std::vector<double>{6.0, -2.0});
}

TEST_CASE("run_backward with several roots sums their contributions", "[autograd]") {
  Tensor x = leaf_of({1.0, 2.0});
  Tensor a = sum(x * 2.0);
  Tensor b = x * x;
  autograd::run_backward({a, b}, {Tensor(), from_vector<double>({1.0, 1.0}, {2})});
  REQUIRE(values(x.grad()) == std::vector<double>{4.0, 6.0});
}

TEST_CASE("leaf grads accumulate in float32 as well", "[autograd]") {
  manual_seed(3);
  Tensor w = randn({3, 2});
  w.set_requires_grad();
  Tensor x = randn({4, 2});
  Tensor loss = mean(relu(linear(x, w, Tensor())));
  loss.backward();
  REQUIRE(w.grad().dtype() == kFloat32);
  REQUIRE(w.grad().shape() == Shape{3, 2});
}

TEST_CASE("gradcheck reports a wrong backward and rejects float32 inputs", "[autograd]") {
  manual_seed(4);
  Tensor x = uniform({2, 3}, -1.0, 1.0, kFloat64);
  x.set_requires_grad();
  auto wrong_double = [](const std::vector<Tensor>& in) {
    Tensor y = kernels::scalar(ScalarOp::Mul, in[0], 2.0);
    autograd::record("WrongDouble", {in[0]}, {y},
                     [](autograd::TensorList&& g) -> autograd::TensorList {
                       return {kernels::scalar(ScalarOp::Mul, g[0], 3.0)};  // should be 2
                     });
    return y;
  };
  autograd::GradcheckResult r = autograd::gradcheck(wrong_double, {x});
  INFO(r.message);
  REQUIRE_FALSE(r.ok);
  REQUIRE(r.message.find("input 0") != std::string::npos);
  REQUIRE(r.max_abs_error > 0.1);
  REQUIRE(autograd::gradcheck([](const std::vector<Tensor>& in) { return in[0] * 2.0; }, {x}).ok);
  Tensor f = randn({2});
  f.set_requires_grad();
  REQUIRE_THROWS_AS(autograd::gradcheck([](const std::vector<Tensor>& in) { return in[0]; }, {f}),
                    DTypeError);
}

TEST_CASE("a later layer's hook fires before an earlier layer's gradient is computed",
          "[autograd]") {
  // The property overlapped gradient allreduce relies on: w2's gradient is final (and its hook
  // runs) before backward reaches the first layer.
  Tensor x = from_vector<double>({0.5, -1.0}, {1, 2});
  Tensor w1 = from_vector<double>({0.1, 0.2, 0.3, 0.4}, {2, 2});
  Tensor w2 = from_vector<double>({0.5, -0.5}, {1, 2});
  w1.set_requires_grad();
  w2.set_requires_grad();
  std::vector<std::string> order;
  w1.register_grad_hook([&](const Tensor&) { order.push_back("w1"); });
  w2.register_grad_hook([&](const Tensor&) { order.push_back("w2"); });
  Tensor h = tanh(linear(x, w1, Tensor()));
  // An identity node between the layers that logs when its backward runs.
  Tensor mid = h.detach();
  autograd::record("Mid", {h}, {mid}, [&](autograd::TensorList&& g) -> autograd::TensorList {
    order.push_back("mid");
    return {g[0]};
  });
  sum(linear(mid, w2, Tensor())).backward();
  REQUIRE(order == std::vector<std::string>{"w2", "mid", "w1"});
}
