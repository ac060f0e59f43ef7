// An activation and the pooling after it as one op (Note [activation + pooling] in
// kernels/backend.h): a float64 gradcheck; the values and gradients of the two ops, bit for bit
// on the CPU (the reference composes them) and within rounding on CUDA, whose own kernels
// take tiling windows (the rest is composed there too); ties and NaN in max pooling routed to
// the first maximum on both; a Sequential with the fusion on equal to it off; bad input named.
#include <cmath>
#include <limits>
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
#include "kernels/ops.h"
#include "nn/activation.h"
#include "nn/container.h"
#include "nn/conv.h"
#include "nn/pooling.h"
#include "nn_test_util.h"

using namespace tandem;
using tandem::test::check_gradients;
using tandem::test::leaf_away_from_zero;
using tandem::test::values;
using V = std::vector<Tensor>;

namespace {

constexpr Activation kActivations[] = {Activation::None, Activation::Relu, Activation::Sigmoid};
constexpr PoolMode kModes[] = {PoolMode::Avg, PoolMode::Max};

Pool2dParams pool(int64_t k, int64_t s, int64_t pad) {
  Pool2dParams p;
  p.kernel_h = p.kernel_w = k;
  p.stride_h = p.stride_w = s;
  p.pad_h = p.pad_w = pad;
  return p;
}

// 2x2 tiling (LeNet's), 3x2 tiling with rows and columns left over, and an overlapping padded
// window that every backend composes.
const Pool2dParams kParams[] = {pool(2, 2, 0), {3, 2, 3, 2, 0, 0}, pool(3, 2, 1)};

Tensor act_of(const Tensor& z, Activation act) {
  return act == Activation::Relu ? relu(z) : act == Activation::Sigmoid ? sigmoid(z) : z;
}

Tensor pool_of(const Tensor& a, PoolMode mode, const Pool2dParams& p) {
  return mode == PoolMode::Max ? max_pool2d(a, p) : avg_pool2d(a, p);
}

struct Run {
  Tensor y, dz;
};

// The same values, a NaN equal to a NaN.
bool same_values(const Tensor& a, const Tensor& b) {
  const std::vector<double> va = values(a), vb = values(b);
  if (va.size() != vb.size()) return false;
  for (size_t i = 0; i < va.size(); ++i) {
    if (!(va[i] == vb[i] || (std::isnan(va[i]) && std::isnan(vb[i])))) return false;
  }
  return true;
}

Run run(const Tensor& z0, const Tensor& dy, Activation act, PoolMode mode, const Pool2dParams& p, bool fused) {
  Tensor z = z0.detach().clone();
  z.set_requires_grad(true);
  Run r;
  r.y = fused ? activation_pool2d(z, act, mode, p) : pool_of(act_of(z, act), mode, p);
  r.y.backward(dy);
  r.dz = z.grad();
  return r;
}

// Every dtype, activation, mode and window of the tests that compare the fused op with the
// composed one, each with its name for the failure messages.
struct Case {
  DType dt;
  Activation act;
  PoolMode mode;
  Pool2dParams p;
  std::string name() const {
    return detail::str(dtype_name(dt), " act ", static_cast<int>(act), " mode ", static_cast<int>(mode), " kernel ",
                       p.kernel_h, "x", p.kernel_w, " stride ", p.stride_h, " pad ", p.pad_h);
  }
};

std::vector<Case> cases() {
  std::vector<Case> all;
  for (DType dt : {kFloat32, kFloat64}) {
    for (Activation act : kActivations) {
      for (PoolMode mode : kModes) {
        for (const Pool2dParams& p : kParams) all.push_back({dt, act, mode, p});
      }
    }
  }
  return all;
}

}  // namespace

TEST_CASE("gradcheck activation_pool2d", "[autograd]") {
  manual_seed(71);
  for (Activation act : kActivations) {
    for (PoolMode mode : kModes) {
      for (const Pool2dParams& p : kParams) {
        INFO(static_cast<int>(act) << " " << static_cast<int>(mode) << " kernel " << p.kernel_h << "x" << p.kernel_w);
        // Distinct values away from zero: no tie in a max window, no ReLU kink in reach.
        Tensor z = leaf_away_from_zero({2, 2, 7, 6});
        check_gradients([=](const V& in) { return activation_pool2d(in[0], act, mode, p); }, {z});
      }
    }
  }
}

TEST_CASE("activation_pool2d is pooling of the activation, forward and backward", "[nn][cuda]") {
  const Tensor ties = [] {
    // ReLU's zeros tie in a max window, and a NaN must win its window.
    std::vector<double> v = uniform({3, 2, 8, 9}, -1.0, 1.0, kFloat64).to_vector<double>();
    v[5] = std::numeric_limits<double>::quiet_NaN();
    return from_vector(v, {3, 2, 8, 9});
  }();
  for (const Case& c : cases()) {
    INFO(c.name());
    const auto& [dt, act, mode, p] = c;
    const Tensor z = uniform({3, 2, 8, 9}, -2.0, 2.0, dt);
    const Tensor zt = ties.to(dt);
    const Shape ys = kernels::pool2d(PoolMode::Avg, z, p).shape();
    const Tensor dy = uniform(ys, -1.0, 1.0, dt);
    for (const Tensor* input : {&z, &zt}) {
      // The CPU composes the two ops: the same bits.
      const Run want = run(*input, dy, act, mode, p, false);
      const Run fused = run(*input, dy, act, mode, p, true);
      CHECK(same_values(fused.y, want.y));
      CHECK(same_values(fused.dz, want.dz));
      if (!test::have_cuda()) continue;
      // CUDA, fused kernels or composed, within rounding of the CPU; the first maximum
      // and a NaN's window route the gradient exactly as there.
      const Device g = Device::cuda(0);
      const Run got = run(input->to(g), dy.to(g), act, mode, p, true);
      const Run plain = run(input->to(g), dy.to(g), act, mode, p, false);
      const double t = dt == kFloat32 ? 1e-6 : 1e-14;
      const auto close = [t](const Tensor& a, const Tensor& b) {
        const std::vector<double> va = values(a), vb = values(b);
        REQUIRE(va.size() == vb.size());
        for (size_t i = 0; i < va.size(); ++i) {
          if (std::isnan(vb[i])) {
            REQUIRE(std::isnan(va[i]));
          } else {
            REQUIRE(std::abs(va[i] - vb[i]) <= t * std::max(1.0, std::abs(vb[i])));
          }
        }
      };
      close(got.y, want.y);
      close(got.dz, want.dz);
      close(plain.dz, got.dz);
    }
  }
}

TEST_CASE("A Sequential runs its activation and the pooling after it as one op", "[nn][cuda]") {
  const test::SettingRestore restore(set_fuse_activation_pool, fuse_activation_pool);
  Generator gen(17);
  // Conv -> Sigmoid -> AvgPool (fused), Conv -> ReLU -> MaxPool (fused), a ReLU at the end.
  const auto model = std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Conv2d>(1, 3, 3, 1, 1, true, gen), std::make_shared<nn::Sigmoid>(),
      std::make_shared<nn::AvgPool2d>(2, 2), std::make_shared<nn::Conv2d>(3, 4, 3, 1, 1, true, gen),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2, 2), std::make_shared<nn::ReLU>()});
  const Tensor x = uniform({2, 1, 12, 10}, -1.0, 1.0, kFloat32);
  // The CPU composes the two ops: the same bits.
  test::check_fusion_changes_nothing(model, x, kCPU, set_fuse_activation_pool, fuse_activation_pool);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    nn::SequentialImpl pair({std::make_shared<nn::Sigmoid>(), std::make_shared<nn::AvgPool2d>(2, 2)});
    pair.to(d);
    Tensor h = uniform({2, 3, 4, 4}, -1.0, 1.0, kFloat32).to(d);
    h.set_requires_grad(true);
    set_fuse_activation_pool(true);
    const Tensor fused = pair(h);
    CHECK(autograd::meta(fused).grad_fn->name() == "SigmoidAvgPool2d");
    set_fuse_activation_pool(false);
    const Tensor plain = pair(h);
    CHECK(autograd::meta(plain).grad_fn->name() == "AvgPool2d");
    CHECK(test::rel_error(fused, plain) < 1e-6);
    // A wrong input is named by the pooling module, fused or not.
    set_fuse_activation_pool(true);
    const std::string msg =
        test::error_message<ShapeError>([&] { pair(uniform({2, 3, 1, 1}, -1.0, 1.0).to(d)); });
    CHECK(test::contains(msg, "AvgPool2d"));
  }
}

TEST_CASE("activation_pool2d and its backward name the shapes at fault", "[kernels]") {
  const Pool2dParams p = pool(2, 2, 0);
  std::string msg = test::error_message<ShapeError>(
      [&] { kernels::activation_pool2d(uniform({4, 3}, -1.0, 1.0), Activation::Relu, PoolMode::Max, p); });
  CHECK(test::contains(msg, shape_str({4, 3})));
  const Tensor z = uniform({1, 2, 4, 4}, -1.0, 1.0), y = zeros({1, 2, 2, 2});
  msg = test::error_message<ShapeError>([&] {
    kernels::activation_pool2d_backward(zeros({1, 2, 3, 3}), z, y, Activation::Sigmoid, PoolMode::Avg, p);
  });
  CHECK(test::contains(msg, "dy"));
  CHECK(test::contains(msg, shape_str({1, 2, 3, 3})));
  test::error_message<DTypeError>([&] {
    kernels::activation_pool2d_backward(zeros({1, 2, 2, 2}, kFloat64), z, y, Activation::Relu, PoolMode::Max, p);
  });
}

// Note [conv bias in activation + pooling] (kernels/ops.h): a convolution's bias added by the
// activation + pooling op as it reads z, forward and backward.
TEST_CASE("activation_pool2d with a conv's bias is pooling of the activation of z + bias", "[nn][cuda]") {
  for (const Case& c : cases()) {
    INFO(c.name());
    const auto& [dt, act, mode, p] = c;
    const Tensor z = uniform({3, 4, 8, 9}, -2.0, 2.0, dt), bias = uniform({4}, -1.0, 1.0, dt);
    const Tensor dy = uniform(kernels::pool2d(PoolMode::Avg, z, p).shape(), -1.0, 1.0, dt);
    for (const Device d : test::test_devices()) {
      INFO("on " << d.str());
      const Tensor zd = z.to(d), bd = bias.to(d), dyd = dy.to(d);
      // The bias added first by the add op: on every backend the same add, the same bits.
      const Tensor a = kernels::binary(BinaryOp::Add, zd, bd.reshape({1, 4, 1, 1}));
      const Tensor want = kernels::activation_pool2d(a, act, mode, p);
      const Tensor got = kernels::activation_pool2d(zd, act, mode, p, bd);
      CHECK(same_values(got, want));
      CHECK(same_values(kernels::activation_pool2d_backward(dyd, zd, got, act, mode, p, bd),
                        kernels::activation_pool2d_backward(dyd, a, want, act, mode, p)));
    }
  }
}

TEST_CASE("gradcheck conv2d with its bias added by activation_pool2d", "[autograd]") {
  manual_seed(73);
  Conv2dParams cp;
  cp.pad_h = cp.pad_w = 1;
  for (Activation act : {Activation::Sigmoid, Activation::None}) {  // smooth: no kink in reach
    for (PoolMode mode : kModes) {
      INFO(static_cast<int>(act) << " " << static_cast<int>(mode));
      Tensor x = leaf_away_from_zero({2, 2, 6, 6}), w = leaf_away_from_zero({3, 2, 3, 3});
      Tensor b = leaf_away_from_zero({3});
      check_gradients(
          [=](const V& in) {
            return activation_pool2d(conv2d(in[0], in[1], in[2], cp, /*add_bias=*/false), act, mode, pool(2, 2, 0),
                                     in[2]);
          },
          {x, w, b});
    }
  }
}

TEST_CASE("A Sequential's Conv2d leaves its bias to the activation + pooling after it", "[nn][cuda]") {
  const test::SettingRestore restore(set_fuse_conv_bias, fuse_conv_bias);
  const test::SettingRestore restore_pool(set_fuse_activation_pool, fuse_activation_pool);
  set_fuse_activation_pool(true);
  const Tensor x = uniform({3, 1, 20, 20}, -1.0, 1.0, kFloat32);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    // A fresh model on each device (one with the gradients of the last device's run would add to them).
    // LeNet's pattern twice (a 1-channel input as its first layer), and a Conv2d without a bias.
    Generator gen(19);
    const auto model = std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Conv2d>(1, 3, 5, 1, 2, true, gen), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(2, 2), std::make_shared<nn::Conv2d>(3, 4, 3, 1, 0, true, gen),
        std::make_shared<nn::Sigmoid>(), std::make_shared<nn::AvgPool2d>(2, 2),
        std::make_shared<nn::Conv2d>(4, 2, 1, 1, 0, false, gen), std::make_shared<nn::ReLU>(),
        std::make_shared<nn::MaxPool2d>(2, 2)});
    // Every backend adds the bias with the same add wherever it is: the same bits.
    test::check_fusion_changes_nothing(model, x, d, set_fuse_conv_bias, fuse_conv_bias);
    // The conv's node still computes the bias gradient; the op after it names the pooling.
    set_fuse_conv_bias(true);
    auto& conv = dynamic_cast<nn::Conv2d&>(*model->named_children().item(0).second);
    const Tensor z = conv.forward_bias_deferred(x.to(d));
    CHECK(autograd::meta(z).grad_fn->name() == "Conv2d");
    CHECK(same_values(kernels::binary(BinaryOp::Add, z.detach(), conv.bias().detach().reshape({1, 3, 1, 1})),
                      conv(x.to(d)).detach()));
  }
}

TEST_CASE("activation_pool2d names a bias that does not fit", "[kernels]") {
  const Pool2dParams p = pool(2, 2, 0);
  const Tensor z = uniform({1, 2, 4, 4}, -1.0, 1.0), y = zeros({1, 2, 2, 2});
  std::string msg = test::error_message<ShapeError>(
      [&] { kernels::activation_pool2d(z, Activation::Relu, PoolMode::Max, p, zeros({3})); });
  CHECK(test::contains(msg, "bias"));
  CHECK(test::contains(msg, shape_str({3})));
  msg = test::error_message<DTypeError>(
      [&] { kernels::activation_pool2d(z, Activation::Relu, PoolMode::Max, p, zeros({2}, kFloat64)); });
  CHECK(test::contains(msg, "bias"));
  test::error_message<ShapeError>([&] {
    kernels::activation_pool2d_backward(zeros({1, 2, 2, 2}), z, y, Activation::Relu, PoolMode::Max, p, zeros({2, 1}));
  });
}
