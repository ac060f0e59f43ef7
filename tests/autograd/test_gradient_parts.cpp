// Note [gradient parts] (autograd/node.h): a node that sums its gradient parts gets the second
// gradient of an output apart and adds it itself; the sum is the engine's bit for bit, a third
// gradient goes into the first as before, a hook sees the whole gradient, and a part left
// untaken is an error. The batch norm's backward takes its part: the same bits as the summed
// gradient, on every device and in both memory formats.
#include <memory>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"

using namespace tandem;
using tandem::test::values;

namespace {

// What the test node's backward saw: its output's gradient and the part handed apart.
struct Seen {
  std::vector<double> grad, part;
  bool had_part = false;
};

// y = x (a copy), recorded as a node that sums its gradient parts when `take` (else it leaves
// them), writing what it saw into *seen.
Tensor pass_through(const Tensor& x, const std::shared_ptr<Seen>& seen, bool take = true) {
  Tensor y = x.detach().clone();
  autograd::record("PassThrough", {x}, {y}, [seen, take](autograd::TensorList&& g) -> autograd::TensorList {
    seen->grad = values(g[0]);
    if (!take) return {g[0]};
    const Tensor part = autograd::take_gradient_part(0);
    seen->had_part = part.defined();
    if (!part.defined()) return {g[0]};
    seen->part = values(part);
    return {kernels::binary(BinaryOp::Add, g[0], part)};
  });
  autograd::meta(y).grad_fn->sums_gradient_parts = true;
  return y;
}

Tensor grad_leaf(const Shape& shape, uint64_t seed) {
  Generator gen(seed);
  Tensor t = uniform(shape, -1.0, 1.0, kFloat32, kCPU, &gen);
  t.set_requires_grad();
  return t;
}

// sum(y * w) for each w: one gradient of y per use, w itself.
Tensor uses(const Tensor& y, const std::vector<Tensor>& ws) {
  Tensor loss;
  for (const Tensor& w : ws) {
    const Tensor term = sum(mul(y, w));
    loss = loss.defined() ? add(loss, term) : term;
  }
  return loss;
}

}  // namespace

TEST_CASE("a node that sums its gradient parts gets the second gradient apart, the same sum", "[autograd]") {
  const Tensor x = grad_leaf({7}, 1);
  const std::vector<Tensor> w = {uniform({7}, -1.0, 1.0), uniform({7}, -1.0, 1.0), uniform({7}, -1.0, 1.0)};
  // Two uses: the first gradient as the node's, the second apart.
  auto seen = std::make_shared<Seen>();
  uses(pass_through(x, seen), {w[0], w[1]}).backward();
  REQUIRE(seen->had_part);
  const std::vector<double> wa = values(w[0]), wb = values(w[1]);
  const bool first_then_second = seen->grad == wa && seen->part == wb;
  const bool second_then_first = seen->grad == wb && seen->part == wa;
  CHECK((first_then_second || second_then_first));
  CHECK(values(x.grad()) == values(add(w[0], w[1])));
  // Three uses: two are added by the engine, the last stays apart; x's gradient is the engine's sum.
  const Tensor x3 = grad_leaf({7}, 1);
  auto seen3 = std::make_shared<Seen>();
  uses(pass_through(x3, seen3), w).backward();
  REQUIRE(seen3->had_part);
  CHECK(seen3->grad.size() == 7);
  const Tensor x_ref = grad_leaf({7}, 1);
  uses(mul(x_ref, ones({7})), w).backward();  // the engine adds all three
  CHECK(values(x3.grad()) == values(x_ref.grad()));
  // One use: no part.
  const Tensor x1 = grad_leaf({7}, 1);
  auto seen1 = std::make_shared<Seen>();
  uses(pass_through(x1, seen1), {w[0]}).backward();
  CHECK_FALSE(seen1->had_part);
  CHECK(values(x1.grad()) == wa);
}

TEST_CASE("a tensor hook sees the whole gradient, so the node gets no part", "[autograd]") {
  const Tensor x = grad_leaf({5}, 2);
  const std::vector<Tensor> w = {uniform({5}, -1.0, 1.0), uniform({5}, -1.0, 1.0)};
  auto seen = std::make_shared<Seen>();
  const Tensor y = pass_through(x, seen);
  std::vector<double> hooked;
  y.register_hook([&](const Tensor& g) {
    hooked = values(g);
    return Tensor();
  });
  uses(y, w).backward();
  CHECK_FALSE(seen->had_part);
  CHECK(hooked == values(add(w[0], w[1])));
  CHECK(seen->grad == hooked);
}

TEST_CASE("a backward that leaves its gradient part untaken is an error, not a gradient dropped", "[autograd]") {
  const Tensor x = grad_leaf({4}, 3);
  auto seen = std::make_shared<Seen>();
  const Tensor y = pass_through(x, seen, /*take=*/false);
  const std::string msg =
      test::error_message<Error>([&] { uses(y, {uniform({4}, -1.0, 1.0), uniform({4}, -1.0, 1.0)}).backward(); });
  CHECK(test::contains(msg, "PassThrough"));
  CHECK(test::contains(msg, "unsummed"));
}

TEST_CASE("batch norm adds its gradient part as it reads the gradient: the bits of the sum", "[autograd][cuda]") {
  manual_seed(5);
  for (const Device d : test::test_devices()) {
    for (DType dt : {kFloat32, kBFloat16}) {
      const DType pt = dt == kBFloat16 ? kFloat32 : dt;
      for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{64, 64, 32, 32}}) {
        if (shape[0] == 64 && !d.is_cuda()) continue;  // the 16-byte vector kernels: CUDA only
        for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
          for (bool relu : {false, true}) {
            INFO("on " << d.str() << ", " << dtype_name(dt) << " " << shape_str(shape)
                       << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : "") << (relu ? ", relu" : ""));
            const int64_t c = shape[1];
            const Tensor x = uniform(shape, -2.0, 2.0).to(dt).contiguous(fmt).to(d);
            const Tensor a = uniform(shape, -1.0, 1.0).to(dt).contiguous(fmt).to(d);
            const Tensor b = uniform(shape, -1.0, 1.0).to(dt).contiguous(fmt).to(d);
            const Tensor gamma = uniform({c}, 0.5, 1.5).to(pt).to(d);
            const auto r = kernels::batch_norm_train(x, gamma, Tensor(), zeros({c}, pt, d), ones({c}, pt, d), 0.1, 1e-5,
                                                     relu);
            const Tensor mask = relu ? r.y : Tensor();
            const auto two = kernels::batch_norm_backward(a, x, gamma, r.save_mean, r.save_invstd, mask, Tensor(),
                                                          false, Tensor(), Tensor(), relu, b);
            const auto one = kernels::batch_norm_backward(kernels::binary(BinaryOp::Add, a, b), x, gamma, r.save_mean,
                                                          r.save_invstd, mask, Tensor(), false, Tensor(), Tensor(), relu);
            CHECK(values(two.dx) == values(one.dx));
            CHECK(values(two.dgamma) == values(one.dgamma));
            CHECK(values(two.dbeta) == values(one.dbeta));
            if (relu) CHECK(values(two.masked_dy) == values(one.masked_dy));
          }
        }
      }
    }
  }
}

TEST_CASE("a ResNet block's input gets its two gradients summed by the batch norm before it", "[autograd]") {
  // y = relu(bn(x)) used by two layers: the batch norm's node takes the part; the gradients
  // are those of the engine's add (the same graph with the node's part switched off by a hook).
  const auto run = [](bool hook) {
    Generator gen(9);
    Tensor x = uniform({3, 4, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen);
    x.set_requires_grad();
    Tensor gamma = uniform({4}, 0.5, 1.5, kFloat32, kCPU, &gen);
    gamma.set_requires_grad();
    const Tensor y = batch_norm_relu(x, gamma, Tensor(), zeros({4}), ones({4}), true, 0.1, 1e-5);
    if (hook) y.register_hook([](const Tensor&) { return Tensor(); });  // sees the sum: no part
    const Tensor wa = uniform({3, 4, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen);
    const Tensor wb = uniform({3, 4, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen);
    uses(y, {wa, wb}).backward();
    return std::vector<std::vector<double>>{values(x.grad()), values(gamma.grad())};
  };
  CHECK(run(false) == run(true));
}
