// Layers against values computed by hand; model shapes and parameter counts.
#include <algorithm>
#include <cmath>
#include <vector>

#include "autograd/ops.h"
#include "helpers.h"
#include "nn/nn.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::f64;
using tandem::test::values;

namespace {

std::vector<double> host_random(size_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Generator gen(seed);
  std::vector<double> v(n);
  gen.uniform(v.data(), static_cast<int64_t>(n), lo, hi);
  return v;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want,
                 double tol = 1e-5) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    CHECK(got[i] == Approx(want[i]).margin(tol));
  }
}

}  // namespace

TEST_CASE("Linear forward matches a hand computation", "[nn]") {
  const int64_t n = 3, in = 5, out = 4;
  auto x = host_random(n * in, 1), w = host_random(out * in, 2), b = host_random(out, 3);
  for (bool with_bias : {true, false}) {
    Linear lin(in, out, with_bias);
    CHECK(lin.weight().shape() == Shape{out, in});
    CHECK(lin.bias().defined() == with_bias);
    lin.weight().copy_(f64(w, {out, in}));
    if (with_bias) lin.bias().copy_(f64(b, {out}));
    std::vector<double> want(n * out);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t o = 0; o < out; ++o) {
        double acc = with_bias ? b[o] : 0.0;
        for (int64_t k = 0; k < in; ++k) acc += x[i * in + k] * w[o * in + k];
        want[i * out + o] = acc;
      }
    }
    Tensor y = lin(f64(x, {n, in}).to(kFloat32));
    CHECK(y.shape() == Shape{n, out});
    check_close(values(y), want);
  }
  Linear lin(in, out);
  std::string msg = error_message<ShapeError>([&] { lin(zeros({2, in + 1})); });
  CHECK(contains(msg, "[2,6]"));
  // PyTorch's default init: U(-1/sqrt(in), 1/sqrt(in)).
  for (double v : values(lin.weight())) CHECK(std::abs(v) <= 1.0 / std::sqrt(5.0));
}

TEST_CASE("Conv2d forward matches a hand computation", "[nn]") {
  const int64_t N = 2, C = 3, H = 6, W = 5, K = 4, R = 3;
  struct Case {
    int64_t stride, pad;
  };
  for (Case c : {Case{1, 0}, Case{2, 1}, Case{1, 2}}) {
    INFO("stride " << c.stride << " padding " << c.pad);
    Conv2d conv(C, K, R, c.stride, c.pad);
    CHECK(conv.weight().shape() == Shape{K, C, R, R});
    auto x = host_random(N * C * H * W, 4), w = host_random(K * C * R * R, 5);
    auto b = host_random(K, 6);
    conv.weight().copy_(f64(w, {K, C, R, R}));
    conv.bias().copy_(f64(b, {K}));
    const int64_t P = (H + 2 * c.pad - R) / c.stride + 1, Q = (W + 2 * c.pad - R) / c.stride + 1;
    std::vector<double> want(N * K * P * Q);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t p = 0; p < P; ++p)
          for (int64_t q = 0; q < Q; ++q) {
            double acc = b[k];
            for (int64_t ch = 0; ch < C; ++ch)
              for (int64_t r = 0; r < R; ++r)
                for (int64_t s = 0; s < R; ++s) {
                  int64_t h = p * c.stride - c.pad + r, wi = q * c.stride - c.pad + s;
                  if (h < 0 || h >= H || wi < 0 || wi >= W) continue;
                  acc += x[((n * C + ch) * H + h) * W + wi] * w[((k * C + ch) * R + r) * R + s];
                }
            want[((n * K + k) * P + p) * Q + q] = acc;
          }
    Tensor y = conv(f64(x, {N, C, H, W}).to(kFloat32));
    CHECK(y.shape() == Shape{N, K, P, Q});
    check_close(values(y), want);
  }
  Conv2d conv(C, K, R);
  CHECK_THROWS_AS(conv(zeros({N, C + 1, H, W})), ShapeError);
  CHECK_THROWS_AS(conv(zeros({N, C, H})), ShapeError);
  // Default init bound 1/sqrt(fan_in), fan_in = C * R * R.
  for (double v : values(conv.weight())) CHECK(std::abs(v) <= 1.0 / std::sqrt(27.0));
  Conv2d no_bias(C, K, R, 1, 0, false);
  CHECK_FALSE(no_bias.bias().defined());
  CHECK(no_bias.num_parameters() == K * C * R * R);
}

TEST_CASE("pooling, flatten and activations", "[nn]") {
  // One 4x4 channel with values 0..15, and its negation as a second channel.
  std::vector<double> v(32);
  for (int i = 0; i < 16; ++i) v[i] = i, v[16 + i] = -i;
  Tensor x = f64(v, {1, 2, 4, 4});
  CHECK(values(MaxPool2d(2)(x)) == std::vector<double>{5, 7, 13, 15, 0, -2, -8, -10});
  CHECK(values(AvgPool2d(2, 2)(x)) ==
        std::vector<double>{2.5, 4.5, 10.5, 12.5, -2.5, -4.5, -10.5, -12.5});
  CHECK(MaxPool2d(3, 1)(x).shape() == Shape{1, 2, 2, 2});
  CHECK(values(GlobalAvgPool2d()(x)) == std::vector<double>{7.5, -7.5});
  CHECK(GlobalAvgPool2d()(x).shape() == Shape{1, 2});
  CHECK(Flatten()(x).shape() == Shape{1, 32});
  CHECK(values(ReLU()(f64({-1, 0, 2}, {3}))) == std::vector<double>{0, 0, 2});
  check_close(values(Sigmoid()(f64({0, 1}, {2}))), {0.5, 1.0 / (1.0 + std::exp(-1.0))}, 1e-12);
  CHECK_THROWS_AS(MaxPool2d(2)(f64(v, {2, 16})), ShapeError);
  CHECK_THROWS_AS(MaxPool2d(0), ValueError);
}

TEST_CASE("BatchNorm2d: train vs eval and running statistics", "[nn]") {
  const int64_t N = 4, C = 3, H = 2, W = 3, M = N * H * W;
  BatchNorm2d bn(C);
  CHECK(bn.named_parameters().keys() == std::vector<std::string>{"weight", "bias"});
  CHECK(bn.named_buffers().keys() ==
        std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"});
  auto x1 = host_random(N * C * H * W, 7, -2, 3), x2 = host_random(N * C * H * W, 8, 0, 1);
  // Per-channel mean and biased variance of a [N, C, H, W] host array.
  auto stats = [&](const std::vector<double>& x, int64_t c) {
    double s = 0, ss = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < H * W; ++i) s += x[(n * C + c) * H * W + i];
    double mean = s / M;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < H * W; ++i) {
        double d = x[(n * C + c) * H * W + i] - mean;
        ss += d * d;
      }
    return std::pair<double, double>{mean, ss / M};
  };
  std::vector<double> gamma{1.5, -0.5, 2.0}, beta{0.1, 0.2, -0.3};
  bn.weight().copy_(f64(gamma, {C}));
  bn.bias().copy_(f64(beta, {C}));

  // Training: batch statistics.
  Tensor y1 = bn(f64(x1, {N, C, H, W}).to(kFloat32));
  auto got = values(y1);
  for (int64_t c = 0; c < C; ++c) {
    auto [mean, var] = stats(x1, c);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < H * W; ++i) {
        size_t at = (n * C + c) * H * W + i;
        CHECK(got[at] ==
              Approx((x1[at] - mean) / std::sqrt(var + 1e-5) * gamma[c] + beta[c]).margin(1e-4));
      }
  }
  bn(f64(x2, {N, C, H, W}).to(kFloat32));

  // Two updates with momentum 0.1 and the unbiased variance.
  std::vector<double> rm(C), rv(C);
  for (int64_t c = 0; c < C; ++c) {
    auto [m1, v1] = stats(x1, c);
    auto [m2, v2] = stats(x2, c);
    const double u = static_cast<double>(M) / (M - 1);
    rm[c] = 0.9 * (0.9 * 0.0 + 0.1 * m1) + 0.1 * m2;
    rv[c] = 0.9 * (0.9 * 1.0 + 0.1 * v1 * u) + 0.1 * v2 * u;
  }
  check_close(values(bn.running_mean()), rm);
  check_close(values(bn.running_var()), rv);

  // Eval: running statistics, which stay unchanged.
  bn.eval();
  Tensor y3 = bn(f64(x1, {N, C, H, W}).to(kFloat32));
  got = values(y3);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < H * W; ++i) {
        size_t at = (n * C + c) * H * W + i;
        CHECK(got[at] ==
              Approx((x1[at] - rm[c]) / std::sqrt(rv[c] + 1e-5) * gamma[c] + beta[c]).margin(1e-4));
      }
  check_close(values(bn.running_mean()), rm);

  SECTION("[N, C] input as BatchNorm1d") {
    BatchNorm2d bn1(2);
    Tensor y = bn1(f64({1, 10, 3, 20, 5, 30}, {3, 2}).to(kFloat32));
    CHECK(y.shape() == Shape{3, 2});
    check_close(values(bn1.running_mean()), {0.1 * 3.0, 0.1 * 20.0});
    check_close(values(bn1.running_var()), {0.9 + 0.1 * 4.0, 0.9 + 0.1 * 100.0});
  }
  CHECK_THROWS_AS(bn(zeros({2, C + 1, 2, 2})), ShapeError);
  CHECK_THROWS_AS(bn(zeros({2, C, 2})), ShapeError);
}

TEST_CASE("LeNet output shape and parameters", "[nn]") {
  for (auto act : {models::LeNetActivation::Sigmoid, models::LeNetActivation::ReLU}) {
    Generator gen(3);
    auto net = models::lenet({act}, gen);
    CHECK(net->size() == 12);
    CHECK(net->num_parameters() == 61706);
    CHECK(net->named_parameters().keys() ==
          std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias",
                                   "9.weight", "9.bias", "11.weight", "11.bias"});
    bool relu = act == models::LeNetActivation::ReLU;
    CHECK((*net)[1]->name() == (relu ? "ReLU" : "Sigmoid"));
    CHECK((*net)[2]->name() == (relu ? "MaxPool2d" : "AvgPool2d"));
    Tensor y = (*net)(randn({3, 1, 28, 28}));
    CHECK(y.shape() == Shape{3, 10});
    // d2l's recipe: zero biases, Xavier-uniform weights (bound sqrt(6 / (fan_in + fan_out))).
    for (double v : values(net->at<Linear>(7).bias())) CHECK(v == 0.0);
    for (double v : values(net->at<Conv2d>(3).weight()))
      CHECK(std::abs(v) <= std::sqrt(6.0 / (150 + 400)) + 1e-7);
    // A seed gives the same network.
    Generator again(3);
    CHECK(values(models::lenet({act}, again)->parameters()[6]) == values(net->parameters()[6]));
  }
}

TEST_CASE("ResNet-18 output shape, gradients and parameter count", "[nn]") {
  auto net = models::resnet18(10, 1);
  // stem 64*9+64 + 2*64; stage s: Residual(in, out, 1x1, 2) + Residual(out, out); fc 512*10+10.
  auto conv = [](int64_t in, int64_t out, int64_t k) { return out * in * k * k + out; };
  auto block = [&](int64_t in, int64_t out, bool proj) {
    return conv(in, out, 3) + conv(out, out, 3) + 4 * out + (proj ? conv(in, out, 1) : 0);
  };
  int64_t expected = conv(1, 64, 3) + 2 * 64 + 2 * block(64, 64, false) + block(64, 128, true) +
                     block(128, 128, false) + block(128, 256, true) + block(256, 256, false) +
                     block(256, 512, true) + block(512, 512, false) + 512 * 10 + 10;
  CHECK(expected == 11175818);
  CHECK(net->num_parameters() == 11175818);
  CHECK(net->named_parameters().size() == 2 + 2 + 8 * 8 + 3 * 2 + 2);
  CHECK(net->named_buffers().size() == 3 * (1 + 8 * 2));  // mean, var, num_batches_tracked
  CHECK(net->named_parameters().contains("4.0.conv3.weight"));
  CHECK_FALSE(net->named_parameters().contains("1.0.conv3.weight"));
  // init_cnn: Xavier-uniform conv/linear weights, zero biases; BatchNorm weight 1, bias 0.
  auto named = net->named_parameters();
  for (double v : values(named.at("4.1.conv2.bias"))) CHECK(v == 0.0);
  double max_w = 0;
  for (double v : values(named.at("4.1.conv2.weight"))) max_w = std::max(max_w, std::abs(v));
  CHECK(max_w <= std::sqrt(6.0 / (2 * 512 * 9)) + 1e-7);
  CHECK(max_w > 0.9 * std::sqrt(6.0 / (2 * 512 * 9)));
  for (double v : values(named.at("4.1.bn2.weight"))) CHECK(v == 1.0);

  Tensor x = randn({2, 1, 28, 28});
  Tensor y = (*net)(x);
  CHECK(y.shape() == Shape{2, 10});
  cross_entropy(y, from_vector<int64_t>({3, 7}, {2})).backward();
  for (const auto& [name, p] : net->named_parameters()) {
    INFO(name);
    REQUIRE(p.grad().defined());
    CHECK(p.grad().shape() == p.shape());
  }
  net->eval();
  CHECK((*net)(x).shape() == Shape{2, 10});
  CHECK(contains(net->str(), "(0): Residual("));
  CHECK_THROWS_AS(Residual(64, 128, false, 1), ValueError);
}
