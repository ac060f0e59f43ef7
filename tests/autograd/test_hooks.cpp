// Hooks on any tensor and retain_grad: what PyTorch's Tensor.register_hook and retain_grad do.
#include <cmath>
#include <functional>

#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

// The tail of the graph after the activation h; it uses h three times, so h's gradient is a sum.
Tensor tail(const Tensor& h) { return sum(mul(sigmoid(h), h) + h * 0.5); }

// Central differences of tail at the (float64) values of h.
std::vector<double> numeric_grad(const Tensor& h_values) {
  std::vector<double> v = values(h_values), out;
  const double eps = 1e-6;
  for (size_t i = 0; i < v.size(); ++i) {
    auto at = [&](double d) {
      std::vector<double> w = v;
      w[i] += d;
      return tail(from_vector(w, h_values.shape())).item();
    };
    out.push_back((at(eps) - at(-eps)) / (2 * eps));
  }
  return out;
}

struct Graph {
  Tensor x, w, h, loss;
};

// x [2,3] @ w [3,4] -> tanh -> h [2,4] -> tail; float64 on `device`, fresh random values.
Graph make_graph(Device device) {
  Graph g;
  g.x = randn({2, 3}, kFloat64).to(device);
  g.w = randn({3, 4}, kFloat64).to(device);
  g.x.set_requires_grad();
  g.w.set_requires_grad();
  g.h = tanh(matmul(g.x, g.w));
  return g;
}

void check_hook_reads_activation_gradient(Device device) {
  Graph g = make_graph(device);
  Tensor seen;
  int calls = 0;
  g.h.register_hook([&](const Tensor& grad) {
    ++calls;
    seen = grad.clone();
  });
  tail(g.h).backward();
  REQUIRE(calls == 1);  // once per backward, with the sum over h's three uses
  REQUIRE(seen.device() == device);
  const std::vector<double> got = values(seen), want = numeric_grad(g.h.detach().to(kCPU));
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - want[i]) < 1e-7);
  // By hand: d/dh [sigmoid(h) h + h / 2] = s + h s (1 - s) + 1/2.
  const std::vector<double> h = values(g.h);
  for (size_t i = 0; i < h.size(); ++i) {
    const double s = 1.0 / (1.0 + std::exp(-h[i]));
    REQUIRE(std::abs(got[i] - (s + h[i] * s * (1 - s) + 0.5)) < 1e-12);
  }
}

void check_scaling_hook(Device device) {
  Graph g = make_graph(device);
  tail(g.h).backward(Tensor(), /*retain_graph=*/true);
  const std::vector<double> gx = values(g.x.grad()), gw = values(g.w.grad());
  g.x.set_grad(Tensor());
  g.w.set_grad(Tensor());
  // The replacement flows upstream: both leaves see three times the gradient.
  const int id = g.h.register_hook([](const Tensor& grad) { return grad * 3.0; });
  tail(g.h).backward(Tensor(), true);
  std::vector<double> sx = values(g.x.grad()), sw = values(g.w.grad());
  for (size_t i = 0; i < gx.size(); ++i) REQUIRE(std::abs(sx[i] - 3 * gx[i]) < 1e-12);
  for (size_t i = 0; i < gw.size(); ++i) REQUIRE(std::abs(sw[i] - 3 * gw[i]) < 1e-12);
  // Removed, the hook no longer applies.
  g.h.remove_hook(id);
  g.x.set_grad(Tensor());
  tail(g.h).backward();
  sx = values(g.x.grad());
  for (size_t i = 0; i < gx.size(); ++i) REQUIRE(std::abs(sx[i] - gx[i]) < 1e-12);
}

}  // namespace

TEST_CASE("a hook on an activation reads the gradient flowing into it", "[autograd][hooks]") {
  SECTION("cpu") { check_hook_reads_activation_gradient(kCPU); }
  SECTION("cuda") {
    TANDEM_REQUIRE_CUDA();
    check_hook_reads_activation_gradient(Device::cuda(0));
  }
}

TEST_CASE("a hook that returns a gradient replaces it for everything upstream", "[autograd][hooks]") {
  SECTION("cpu") { check_scaling_hook(kCPU); }
  SECTION("cuda") {
    TANDEM_REQUIRE_CUDA();
    check_scaling_hook(Device::cuda(0));
  }
}

TEST_CASE("a hook on a leaf runs before accumulation and the gradient hook sees the result", "[autograd][hooks]") {
  Tensor x = randn({5}, kFloat64);
  x.set_requires_grad();
  std::vector<double> before, final_grad;
  x.register_hook([&](const Tensor& g) {
    before = values(g);
    return g * -2.0;
  });
  x.register_grad_hook([&](const Tensor& g) { final_grad = values(g); });
  sum(x * x).backward();
  const std::vector<double> xv = values(x);
  for (size_t i = 0; i < xv.size(); ++i) {
    REQUIRE(before[i] == 2 * xv[i]);
    REQUIRE(values(x.grad())[i] == -4 * xv[i]);
    REQUIRE(final_grad[i] == -4 * xv[i]);
  }
}

TEST_CASE("retain_grad fills .grad of a non-leaf and accumulates", "[autograd][hooks]") {
  Graph g = make_graph(kCPU);
  REQUIRE_FALSE(g.h.is_leaf());
  REQUIRE_FALSE(g.h.retains_grad());
  g.h.retain_grad();
  g.h.retain_grad();  // twice is once
  REQUIRE(g.h.retains_grad());
  Tensor loss = sum(g.h * g.h);
  loss.retain_grad();  // the root: its gradient is the seed, 1
  loss.backward(Tensor(), true);
  REQUIRE(values(loss.grad()) == std::vector<double>{1.0});
  const std::vector<double> h = values(g.h);
  std::vector<double> gh = values(g.h.grad());
  for (size_t i = 0; i < h.size(); ++i) REQUIRE(gh[i] == 2 * h[i]);
  loss.backward();  // a second pass adds, as for a leaf
  gh = values(g.h.grad());
  for (size_t i = 0; i < h.size(); ++i) REQUIRE(gh[i] == 4 * h[i]);
  // A leaf keeps its gradient anyway: retain_grad is a no-op there.
  g.x.retain_grad();
  REQUIRE_FALSE(g.x.retains_grad());
}

TEST_CASE("retain_grad shows the gradient after the tensor's hooks", "[autograd][hooks]") {
  Tensor x = randn({4}, kFloat64);
  x.set_requires_grad();
  Tensor h = exp(x);
  h.retain_grad();  // registered first, still runs after the hook, as in PyTorch
  h.register_hook([](const Tensor& g) { return g * 10.0; });
  sum(h).backward();
  for (double v : values(h.grad())) REQUIRE(v == 10.0);
  const std::vector<double> ex = values(h);
  for (size_t i = 0; i < ex.size(); ++i) REQUIRE(std::abs(values(x.grad())[i] - 10 * ex[i]) < 1e-12);
}

TEST_CASE("a non-leaf's hook fires after the tensor itself is gone", "[autograd][hooks]") {
  Tensor x = randn({3}, kFloat64);
  x.set_requires_grad();
  int calls = 0;
  Tensor loss;
  {
    Tensor h = x * 2.0;
    h.register_hook([&](const Tensor&) { ++calls; });
    h.retain_grad();  // holds h weakly: nothing to fill once h is gone, and no error
    loss = sum(relu(h));
  }
  loss.backward();
  REQUIRE(calls == 1);
  REQUIRE(x.grad().defined());
}

TEST_CASE("hooks reject tensors without gradients and bad replacements", "[autograd][hooks]") {
  Tensor c = randn({3});
  REQUIRE(contains(error_message<ValueError>([&] { c.register_hook([](const Tensor&) {}); }),
                   "does not require grad"));
  REQUIRE(contains(error_message<ValueError>([&] { c.retain_grad(); }), "does not require grad"));
  REQUIRE_THROWS_AS(Tensor().retain_grad(), ValueError);
  REQUIRE_THROWS_AS(c.register_tensor_hook(nullptr), ValueError);

  Tensor x = randn({3}, kFloat64);
  x.set_requires_grad();
  Tensor h = x * 2.0;
  h.register_hook([](const Tensor&) { return zeros({2}, kFloat64); });
  const std::string msg = error_message<ShapeError>([&] { sum(h).backward(); });
  REQUIRE(contains(msg, "[2]"));
  REQUIRE(contains(msg, "[3]"));

  Tensor y = x * 3.0;
  y.register_hook([](const Tensor& g) { return g.to(kFloat32); });
  REQUIRE_THROWS_AS(sum(y).backward(), DTypeError);
}
