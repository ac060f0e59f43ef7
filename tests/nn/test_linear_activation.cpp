// A linear layer with its activation as one op (Note [linear + activation] in
// kernels/backend.h): a float64 gradcheck; the values and gradients of linear followed by the
// activation, bit for bit; a Sequential with the fusion on equal to it off; the CUDA kernels
// (Note [small fused linear layers] in kernels/cuda/linear.cu) against the CPU for every
// activation, dtype and subset of gradients, deterministic, and the large layers they leave to
// cuBLAS; and bad shapes named.
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "autograd/gradcheck_util.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/cuda_test_util.h"
#include "kernels/ops.h"
#include "nn/activation.h"
#include "nn/container.h"
#include "nn/linear.h"
#include "nn_test_util.h"

using namespace tandem;
using tandem::test::check_fusion_changes_nothing;
using tandem::test::check_gradients;
using tandem::test::leaf_away_from_zero;
using tandem::test::values;
using V = std::vector<Tensor>;

namespace {

constexpr Activation kActivations[] = {Activation::None, Activation::Relu, Activation::Sigmoid};

const char* act_name(Activation a) {
  return a == Activation::Relu ? "relu" : a == Activation::Sigmoid ? "sigmoid" : "none";
}

// act(linear(x, w, b)) as the separate differentiable ops compute it.
Tensor unfused(const Tensor& x, const Tensor& w, const Tensor& b, Activation act) {
  Tensor y = matmul(x, transpose(w, 0, 1));
  if (b.defined()) y = y + b;
  if (act == Activation::Relu) return relu(y);
  if (act == Activation::Sigmoid) return sigmoid(y);
  return y;
}

struct Grads {
  Tensor y, dx, dw, db;
};

Grads run(const Tensor& x0, const Tensor& w0, const Tensor& b0, const Tensor& dy, Activation act,
          bool fused) {
  Tensor x = x0.detach().clone(), w = w0.detach().clone(), b = b0.defined() ? b0.detach().clone() : Tensor();
  for (Tensor* t : {&x, &w, &b}) {
    if (t->defined()) t->set_requires_grad(true);
  }
  Grads g;
  g.y = fused ? linear_activation(x, w, b, act) : unfused(x, w, b, act);
  g.y.backward(dy);
  g.dx = x.grad(), g.dw = w.grad();
  if (b.defined()) g.db = b.grad();
  return g;
}

}  // namespace

TEST_CASE("gradcheck linear_activation", "[autograd]") {
  manual_seed(61);
  for (Activation act : kActivations) {
    INFO(act_name(act));
    // Inputs away from zero keep ReLU's kink out of the finite differences' reach.
    Tensor x = leaf_away_from_zero({5, 4}), w = leaf_away_from_zero({3, 4}), b = leaf_away_from_zero({3});
    check_gradients([act](const V& in) { return linear_activation(in[0], in[1], in[2], act); }, {x, w, b});
    check_gradients([act](const V& in) { return linear_activation(in[0], in[1], Tensor(), act); }, {x, w});
  }
}

TEST_CASE("linear_activation is the activation of linear, bit for bit, forward and backward", "[nn][cuda]") {
  for (const Device d : test::test_devices()) {
    for (DType dt : {kFloat32, kFloat64}) {
      for (Activation act : kActivations) {
        // LeNet's first classifier layer, and an odd one (tiles cut at every edge).
        for (const auto& [m, k, n] : {std::array<int64_t, 3>{256, 400, 120}, std::array<int64_t, 3>{19, 37, 5}}) {
          INFO(d.str() << " " << dtype_name(dt) << " " << act_name(act) << " [" << m << ", " << k << "] -> " << n);
          const Tensor x = uniform({m, k}, -1.0, 1.0, dt).to(d), w = uniform({n, k}, -0.2, 0.2, dt).to(d);
          const Tensor b = uniform({n}, -1.0, 1.0, dt).to(d), dy = uniform({m, n}, -1.0, 1.0, dt).to(d);
          for (bool with_bias : {true, false}) {
            // The reference is linear then the activation module's op: on the CUDA backend
            // both run the same product kernel, so the bits agree there too.
            const Tensor bias = with_bias ? b : Tensor();
            const auto ref = [&](const Tensor& xx, const Tensor& ww, const Tensor& bb) {
              Tensor y = linear(xx, ww, bb);
              return act == Activation::Relu ? relu(y) : act == Activation::Sigmoid ? sigmoid(y) : y;
            };
            Tensor xf = x.clone(), wf = w.clone(), bf = with_bias ? b.clone() : Tensor();
            Tensor xr = x.clone(), wr = w.clone(), br = with_bias ? b.clone() : Tensor();
            for (Tensor* t : {&xf, &wf, &bf, &xr, &wr, &br}) {
              if (t->defined()) t->set_requires_grad(true);
            }
            const Tensor yf = linear_activation(xf, wf, bf, act), yr = ref(xr, wr, br);
            yf.backward(dy);
            yr.backward(dy);
            REQUIRE(values(yf) == values(yr));
            CHECK(values(xf.grad()) == values(xr.grad()));
            CHECK(values(wf.grad()) == values(wr.grad()));
            if (with_bias) CHECK(values(bf.grad()) == values(br.grad()));
            // And within rounding of the textbook composition, matmul + add + activation.
            const Grads u = run(x, w, bias, dy, act, false);
            const double t = dt == kFloat32 ? 1e-5 : 1e-12;
            CHECK(test::rel_error(yf, u.y) < t);
            CHECK(test::rel_error(xf.grad(), u.dx) < t);
            CHECK(test::rel_error(wf.grad(), u.dw) < t);
            if (with_bias) CHECK(test::rel_error(bf.grad(), u.db) < t);
          }
        }
      }
    }
  }
}

TEST_CASE("A Sequential runs its Linear and the activation after it as one op", "[nn][cuda]") {
  const test::SettingRestore restore(set_fuse_linear_activation, fuse_linear_activation);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    Generator gen(13);
    // Linear -> Sigmoid and Linear -> ReLU (fused), Linear -> Linear (not), a Linear at the end.
    check_fusion_changes_nothing(
        std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{
            std::make_shared<nn::Linear>(12, 9, true, gen), std::make_shared<nn::Sigmoid>(),
            std::make_shared<nn::Linear>(9, 7, true, gen), std::make_shared<nn::ReLU>(),
            std::make_shared<nn::Linear>(7, 6, false, gen), std::make_shared<nn::Linear>(6, 3, true, gen)}),
        uniform({10, 12}, -1.0, 1.0, kFloat32), d, set_fuse_linear_activation, fuse_linear_activation);
    // What ran: one fused node for Linear -> activation, the activation's own otherwise.
    nn::SequentialImpl pair({std::make_shared<nn::Linear>(4, 3, true, gen), std::make_shared<nn::Sigmoid>()});
    pair.to(d);
    const Tensor h = uniform({2, 4}, -1.0, 1.0, kFloat32).to(d);
    set_fuse_linear_activation(true);
    CHECK(autograd::meta(pair(h)).grad_fn->name() == "LinearSigmoid");
    set_fuse_linear_activation(false);
    CHECK(autograd::meta(pair(h)).grad_fn->name() == "Sigmoid");
    // A wrong input is named by the Linear, fused or not.
    set_fuse_linear_activation(true);
    const std::string msg = test::error_message<ShapeError>([&] { pair(uniform({2, 5}, -1.0, 1.0).to(d)); });
    CHECK(test::contains(msg, "Linear(4, 3)"));
    CHECK(test::contains(msg, shape_str({2, 5})));
  }
}

TEST_CASE("cuda linear layers with their activation against the CPU", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  using test::check;
  using test::gpu;
  struct Case {
    int64_t m, k, n;
  };
  const Case cases[] = {
      {256, 400, 120}, {256, 120, 84}, {256, 84, 10},  // LeNet's classifier
      {256, 512, 10},                                  // ResNet-18's
      {1, 1, 1},      {33, 17, 2}, {7, 65, 31},        // tiles cut at every edge
      {4096, 64, 64},                                  // the largest batch of the fused kernels
      {4097, 8, 8},   {512, 1024, 64},                 // left to cuBLAS: too many rows, too much work
  };
  for (DType dt : test::kFloatTypes) {
    for (Activation act : kActivations) {
      for (const Case& c : cases) {
        INFO(dtype_name(dt) << " " << act_name(act) << " [" << c.m << ", " << c.k << "] -> " << c.n);
        const Tensor x = uniform({c.m, c.k}, -1.0, 1.0, dt), w = uniform({c.n, c.k}, -0.3, 0.3, dt);
        const Tensor b = uniform({c.n}, -1.0, 1.0, dt), dy = uniform({c.m, c.n}, -1.0, 1.0, dt);
        const Tensor y = kernels::linear(x, w, b, act);
        const Tensor yg = kernels::linear(gpu(x), gpu(w), gpu(b), act);
        check(yg, y, 4);
        check(kernels::linear(gpu(x), gpu(w), Tensor(), act), kernels::linear(x, w, Tensor(), act), 4);
        const kernels::LinearGrads want = kernels::linear_backward(dy, y, x, w, act, c.k, true, true, true);
        const kernels::LinearGrads got =
            kernels::linear_backward(gpu(dy), yg, gpu(x), gpu(w), act, c.k, true, true, true);
        check(got.dx, want.dx, 4);
        check(got.dw, want.dw, 4);
        check(got.db, want.db, 4);
        // Each gradient alone (the weight gradient's kernel without or with only the bias
        // column), and a second call gives the same bits.
        const kernels::LinearGrads dx_only =
            kernels::linear_backward(gpu(dy), yg, Tensor(), gpu(w), act, c.k, true, false, false);
        CHECK_FALSE(dx_only.dw.defined());
        CHECK_FALSE(dx_only.db.defined());
        test::check_equal(dx_only.dx, got.dx.to(kCPU));
        const kernels::LinearGrads dw_only =
            kernels::linear_backward(gpu(dy), yg, gpu(x), Tensor(), act, c.k, false, true, false);
        test::check_equal(dw_only.dw, got.dw.to(kCPU));
        const kernels::LinearGrads db_only =
            kernels::linear_backward(gpu(dy), yg, Tensor(), Tensor(), act, c.k, false, false, true);
        test::check_equal(db_only.db, got.db.to(kCPU));
        test::check_equal(kernels::linear(gpu(x), gpu(w), gpu(b), act), yg.to(kCPU));
      }
    }
  }
}

TEST_CASE("linear and linear_backward name the shapes at fault", "[kernels]") {
  const Tensor x = uniform({4, 3}, -1.0, 1.0), w = uniform({2, 3}, -1.0, 1.0), b = uniform({2}, -1.0, 1.0);
  std::string msg = test::error_message<ShapeError>([&] { kernels::linear(x, uniform({2, 5}, -1.0, 1.0), b); });
  CHECK(test::contains(msg, shape_str({4, 3})));
  CHECK(test::contains(msg, shape_str({2, 5})));
  msg = test::error_message<ShapeError>([&] { kernels::linear(x, w, uniform({3}, -1.0, 1.0)); });
  CHECK(test::contains(msg, "bias"));
  CHECK(test::contains(msg, shape_str({3})));
  test::error_message<DTypeError>([&] { kernels::linear(x, w, b.to(kFloat64)); });
  const Tensor dy = uniform({4, 2}, -1.0, 1.0);
  // The output is needed for an activation's gradient; the weight for dx; the input for dw.
  msg = test::error_message<ValueError>(
      [&] { kernels::linear_backward(dy, Tensor(), x, w, Activation::Sigmoid, 3, true, true, true); });
  CHECK(test::contains(msg, "output"));
  msg = test::error_message<ValueError>(
      [&] { kernels::linear_backward(dy, Tensor(), x, Tensor(), Activation::None, 3, true, false, false); });
  CHECK(test::contains(msg, "weight"));
  msg = test::error_message<ShapeError>(
      [&] { kernels::linear_backward(dy, Tensor(), x, uniform({2, 5}, -1.0, 1.0), Activation::None, 3, true, true, true); });
  CHECK(test::contains(msg, shape_str({2, 5})));
  // Nothing asked for: nothing computed, nothing needed.
  const kernels::LinearGrads none =
      kernels::linear_backward(dy, Tensor(), Tensor(), Tensor(), Activation::Relu, 3, false, false, false);
  CHECK_FALSE(none.dx.defined());
}
