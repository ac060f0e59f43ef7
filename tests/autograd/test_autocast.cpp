// The differentiable dtype cast `to` and autocast (autograd/autocast.h): the cast's backward
// directly (gradcheck is float64-only), the autocast state and its scoping, and autocast
// linear/matmul against a float32 reference.
//
// Tolerance of the autocast products: the inputs are rounded to bfloat16 (relative error
// u = 2^-9 each), the float32 sum adds little, the output is rounded (u) and linear's bias add
// rounds once more (u). So |y - y_fp32| <= 4u (|x| |w|^T + |b|) elementwise, 2^-7 times the
// product of the absolute values; the tests check that bound and that the results do differ
// from float32 (bfloat16 really was used).
#include <thread>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/bf16_test_util.h"
#include "kernels/ops.h"
#include "nn/conv.h"
#include "nn/linear.h"
#include "parallel/replicate.h"
#include "parallel/workers.h"

using namespace tandem;
using namespace tandem::test;

namespace {

constexpr double kAutocastTol = 1.0 / 128;  // 4u, u = 2^-9 (see the file comment)

Tensor abs_of(const Tensor& t) {
  return kernels::unary(UnaryOp::Abs, t.to(kFloat64));
}

// Requires |got - want| <= kAutocastTol * bound elementwise, all compared in float64, and
// that got differs from want somewhere.
void require_within_bound(const Tensor& got, const Tensor& want, const Tensor& bound) {
  const std::vector<double> g = values(got), w = values(want), b = values(bound);
  REQUIRE(g.size() == w.size());
  REQUIRE(b.size() == w.size());
  double worst = 0;
  bool differs = false;
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::abs(g[i] - w[i]);
    differs = differs || err > 0;
    worst = std::max(worst, err / (kAutocastTol * b[i] + 1e-30));
  }
  INFO("worst error / bound " << worst);
  CHECK(worst <= 1.0);
  CHECK(differs);
}

}  // namespace

TEST_CASE("to casts dtype and its backward casts the gradient back", "[autograd][bf16]") {
  Tensor x = uniform({4, 6}, -2.0, 2.0, kFloat32).set_requires_grad();
  Tensor y = to(x, kBFloat16);
  REQUIRE(y.dtype() == kBFloat16);
  CHECK(y.requires_grad());
  CHECK(bf16_bits(y) == bf16_bits(x.detach().to(kBFloat16)));
  const Tensor g = rnd_bf16({4, 6});
  y.backward(g);
  REQUIRE(x.grad().defined());
  REQUIRE(x.grad().dtype() == kFloat32);
  CHECK(values(x.grad()) == values(g));  // widening bfloat16 -> float32 is exact

  // float64 -> float32: the gradient comes back as float64 (rounded on the way down only).
  Tensor d = uniform({5}, -1.0, 1.0, kFloat64).set_requires_grad();
  Tensor df = to(d, kFloat32);
  REQUIRE(df.dtype() == kFloat32);
  sum(mul(df, 3.0)).backward();
  REQUIRE(d.grad().dtype() == kFloat64);
  CHECK(values(d.grad()) == std::vector<double>(5, 3.0));

  // A chain float32 -> bfloat16 -> float32 accumulates into the float32 leaf.
  Tensor z = uniform({3}, -1.0, 1.0, kFloat32).set_requires_grad();
  sum(to(mul(to(z, kBFloat16), 0.5), kFloat32)).backward();
  REQUIRE(z.grad().dtype() == kFloat32);
  CHECK(values(z.grad()) == std::vector<double>(3, 0.5));

  // The same dtype is an alias that still passes the gradient; an integer cast records nothing.
  Tensor s = uniform({2}, -1.0, 1.0, kFloat32).set_requires_grad();
  Tensor same = to(s, kFloat32);
  CHECK_FALSE(same.same(s));
  sum(same).backward();
  CHECK(values(s.grad()) == std::vector<double>(2, 1.0));
  CHECK_FALSE(to(s, kInt64).requires_grad());
  {
    NoGradGuard no_grad;
    CHECK_FALSE(to(s, kBFloat16).requires_grad());
  }
}

TEST_CASE("autocast state is scoped and thread-local", "[autograd][bf16]") {
  CHECK_FALSE(is_autocast_enabled());
  {
    AutocastGuard autocast;
    CHECK(is_autocast_enabled());
    CHECK(autocast_dtype() == kBFloat16);
    {
      AutocastGuard off(kBFloat16, false);
      CHECK_FALSE(is_autocast_enabled());
    }
    CHECK(is_autocast_enabled());
    bool other_thread = true;
    std::thread([&] { other_thread = is_autocast_enabled(); }).join();
    CHECK_FALSE(other_thread);
  }
  CHECK_FALSE(is_autocast_enabled());
  // bfloat16 is the only autocast dtype; a bad guard changes nothing.
  CHECK(contains(error_message<DTypeError>([] { AutocastGuard g(kFloat64); }), "float64"));
  CHECK(contains(error_message<DTypeError>([] { set_autocast_dtype(kFloat32); }), "bfloat16"));
  CHECK_FALSE(is_autocast_enabled());
}

TEST_CASE("autocast_input casts float32 only", "[autograd][bf16]") {
  const Tensor f = uniform({3}, -1.0, 1.0, kFloat32);
  const Tensor d = uniform({3}, -1.0, 1.0, kFloat64);
  const Tensor h = rnd_bf16({3});
  const Tensor i = from_vector<int64_t>({1, 2, 3}, {3});
  CHECK(autocast_input(f).same(f));  // off: nothing changes
  AutocastGuard autocast;
  CHECK(autocast_input(f).dtype() == kBFloat16);
  CHECK(autocast_input(d).same(d));  // float64 is never cast down
  CHECK(autocast_input(h).same(h));
  CHECK(autocast_input(i).same(i));
  CHECK_FALSE(autocast_input(Tensor()).defined());
}

TEST_CASE("autocast linear runs in bfloat16 with float32 master gradients", "[autograd][bf16]") {
  Generator gen(7);
  nn::Linear fc(37, 19, true, gen);
  const Tensor x0 = uniform({8, 37}, -1.0, 1.0, kFloat32, kCPU, &gen);
  const Tensor g = rnd_bf16({8, 19});

  // float32 reference with the same upstream gradient.
  Tensor xr = x0.clone().set_requires_grad();
  Tensor yr = fc(xr);
  yr.backward(g.to(kFloat32));
  const Tensor gw_ref = fc.weight().grad().clone(), gb_ref = fc.bias().grad().clone();
  const Tensor gx_ref = xr.grad().clone();
  fc.weight().set_grad(Tensor());
  fc.bias().set_grad(Tensor());

  Tensor x = x0.clone().set_requires_grad();
  Tensor y;
  {
    AutocastGuard autocast;
    y = fc(x);
  }
  REQUIRE(y.dtype() == kBFloat16);
  const Tensor w = fc.weight().detach(), b = fc.bias().detach();
  require_within_bound(
      y, yr,
      kernels::binary(BinaryOp::Add, kernels::matmul(abs_of(x0), abs_of(w), false, true),
                      abs_of(b)));
  // The backward runs after the scope ended: what autocast recorded decides, as in PyTorch.
  y.backward(g);
  REQUIRE(x.grad().dtype() == kFloat32);
  REQUIRE(fc.weight().grad().dtype() == kFloat32);
  REQUIRE(fc.bias().grad().dtype() == kFloat32);
  require_within_bound(x.grad(), gx_ref, kernels::matmul(abs_of(g), abs_of(w)));
  require_within_bound(fc.weight().grad(), gw_ref,
                       kernels::matmul(abs_of(g), abs_of(x0), true, false));
  // The bias gradient is a bfloat16 sum of bfloat16 values: one rounding.
  const std::vector<double> gb = values(fc.bias().grad()), gbr = values(gb_ref);
  const std::vector<double> gsum = values(kernels::reduce(ReduceOp::Sum, abs_of(g), {0}));
  for (size_t j = 0; j < gb.size(); ++j) CHECK(std::abs(gb[j] - gbr[j]) <= gsum[j] / 256);
}

TEST_CASE("autocast matmul and the ops it leaves alone", "[autograd][bf16]") {
  Tensor a = uniform({5, 7}, -1.0, 1.0, kFloat32).set_requires_grad();
  Tensor b = uniform({7, 3}, -1.0, 1.0, kFloat32).set_requires_grad();
  Tensor x = uniform({1, 2, 5, 5}, -1.0, 1.0, kFloat32);
  Tensor w = uniform({3, 2, 3, 3}, -1.0, 1.0, kFloat32);
  Tensor c, r, conv, d64;
  {
    AutocastGuard autocast;
    c = matmul(a, b);
    r = relu(a);                    // elementwise ops keep their input dtype
    conv = conv2d(x, w, Tensor());  // convolutions are autocast too
    const Tensor p = uniform({2, 3}, -1.0, 1.0, kFloat64), q = uniform({3, 2}, -1.0, 1.0, kFloat64);
    d64 = matmul(p, q);  // float64 is never cast down
  }
  REQUIRE(c.dtype() == kBFloat16);
  CHECK(r.dtype() == kFloat32);
  CHECK(conv.dtype() == kBFloat16);
  CHECK(d64.dtype() == kFloat64);
  const Tensor ad = a.detach(), bd = b.detach();
  require_within_bound(c, kernels::matmul(ad, bd), kernels::matmul(abs_of(ad), abs_of(bd)));
  sum(c).backward();
  REQUIRE(a.grad().dtype() == kFloat32);
  REQUIRE(b.grad().dtype() == kFloat32);
  // d(sum(a b))/da = 1 b^T: row sums of b, here of b rounded to bfloat16.
  const Tensor want = kernels::matmul(ones({5, 3}, kBFloat16), bd.to(kBFloat16), false, true);
  CHECK(values(a.grad()) == values(want));
}

TEST_CASE("autocast reaches the DeviceWorkers threads", "[autograd][bf16][parallel]") {
  parallel::DeviceWorkers workers({Device::cpu(0), Device::cpu(1)});
  std::vector<int> seen(2, -1);
  {
    AutocastGuard autocast;
    workers.run([&](size_t rank) { seen[rank] = is_autocast_enabled() ? 1 : 0; });
  }
  CHECK(seen == std::vector<int>{1, 1});
  workers.run([&](size_t rank) { seen[rank] = is_autocast_enabled() ? 1 : 0; });
  CHECK(seen == std::vector<int>{0, 0});
}

TEST_CASE("autocast weight copies: one cast for a coalesced model, the same values and gradients",
          "[autograd][bf16]") {
  for (Device d : test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO(d.str() << (fmt == MemoryFormat::ChannelsLast ? ", channels-last" : ""));
      Generator gen(31);
      nn::Conv2d conv(2, 4, 3, 1, 1, true, gen);
      nn::Linear fc(4 * 5 * 5, 3, true, gen);
      conv.to(d);
      fc.to(d);
      conv.to(fmt);  // a channels-last weight keeps its strides in the copy
      std::vector<Tensor> params = conv.parameters();
      for (const Tensor& p : fc.parameters()) params.push_back(p);
      parallel::coalesce(params);
      const Tensor x = uniform({3, 2, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d).contiguous(fmt);
      const auto step = [&](const AutocastWeights* weights) {
        for (const Tensor& p : params) p.set_grad(Tensor());
        AutocastGuard autocast;
        AutocastWeightsGuard installed(weights);
        const Tensor y = fc(reshape(conv(x), {3, 4 * 5 * 5}));
        sum(mul(y, y)).backward();
        std::vector<std::vector<double>> out{values(y)};
        for (const Tensor& p : params) out.push_back(values(p.grad()));
        return out;
      };
      const auto cast_each = step(nullptr);
      AutocastWeights weights(params);
      weights.refresh();
      CHECK(step(&weights) == cast_each);

      // autocast_input answers a parameter with its slice of the copy, anything else with a cast.
      AutocastGuard autocast;
      AutocastWeightsGuard installed(&weights);
      const Tensor w16 = autocast_input(conv.weight());
      CHECK(w16.dtype() == kBFloat16);
      CHECK(w16.raw_data() == weights.lookup(conv.weight()).raw_data());
      CHECK(w16.strides() == conv.weight().strides());
      const Tensor other = uniform({4}, -1.0, 1.0, kFloat32).to(d);
      CHECK_FALSE(weights.lookup(other).defined());
      CHECK(values(autocast_input(other)) == values(other.to(kBFloat16)));
      // The copy is what the last refresh saw.
      const std::vector<double> before = values(autocast_input(fc.bias()));
      {
        NoGradGuard no_grad;
        fc.bias().fill_(0.5);
      }
      CHECK(values(autocast_input(fc.bias())) == before);
      weights.refresh();
      CHECK(values(autocast_input(fc.bias())) == std::vector<double>(3, 0.5));
    }
  }
}

TEST_CASE("autocast weight copies name what they cannot take", "[autograd][bf16]") {
  Generator gen(37);
  nn::Linear a(3, 2, true, gen), b(2, 2, true, gen);
  // Not coalesced: each parameter in its own storage.
  CHECK(contains(error_message<ValueError>([&] { AutocastWeights w(a.parameters()); }), "back to back"));
  CHECK_FALSE(AutocastWeights::if_fits(a.parameters()).has_value());
  const Tensor f64 = zeros({2}, kFloat64);
  CHECK(contains(error_message<DTypeError>([&] { AutocastWeights w({f64}); }), "parameter 0"));
  CHECK_FALSE(AutocastWeights::if_fits({f64}).has_value());
  std::vector<Tensor> params = a.parameters();
  parallel::coalesce(params);
  CHECK(AutocastWeights::if_fits(params).has_value());
  AutocastWeights weights(params);
  CHECK(contains(error_message<DTypeError>([&] { AutocastWeights w(params, kFloat32); }), "bfloat16"));
  // The parameters moved into another buffer: the copy refuses to refresh from the old one.
  std::vector<Tensor> both = params;
  for (const Tensor& p : b.parameters()) both.push_back(p);
  parallel::coalesce(both);
  CHECK(contains(error_message<ValueError>([&] { weights.refresh(); }), "no longer lie"));
  CHECK(contains(error_message<ShapeError>([&] { to_converted(zeros({2}), zeros({3}, kBFloat16)); }), "to_converted"));
}
