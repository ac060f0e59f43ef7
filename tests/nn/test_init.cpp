// Initialization: fans, gains, bounds, spread and determinism.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "helpers.h"
#include "nn/init.h"
#include "nn/models/lenet.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::values;

namespace {

double stddev(const std::vector<double>& v) {
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  double ss = 0;
  for (double x : v) ss += (x - mean) * (x - mean);
  return std::sqrt(ss / static_cast<double>(v.size()));
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace

TEST_CASE("init: fans and gains as PyTorch computes them", "[nn]") {
  CHECK(init::fan_in_and_fan_out({120, 400}) == std::pair<int64_t, int64_t>{400, 120});
  CHECK(init::fan_in_and_fan_out({6, 1, 5, 5}) == std::pair<int64_t, int64_t>{25, 150});
  CHECK(init::fan_in_and_fan_out({16, 6, 5, 5}) == std::pair<int64_t, int64_t>{150, 400});
  CHECK_THROWS_AS(init::fan_in_and_fan_out({7}), ValueError);
  CHECK(init::calculate_gain(init::Nonlinearity::Relu) == Approx(std::sqrt(2.0)));
  CHECK(init::calculate_gain(init::Nonlinearity::Tanh) == Approx(5.0 / 3.0));
  CHECK(init::calculate_gain(init::Nonlinearity::Sigmoid) == 1.0);
  CHECK(init::calculate_gain(init::Nonlinearity::LeakyRelu, std::sqrt(5.0)) ==
        Approx(std::sqrt(1.0 / 3.0)));
}

TEST_CASE("init: bounds, spread and determinism", "[nn]") {
  const int64_t out = 64, in = 32, k = 3;  // fan_in 288, fan_out 576
  Tensor w = empty({out, in, k, k});
  Generator gen(21);

  init::xavier_uniform_(w, 1.0, gen);
  double a = std::sqrt(6.0 / (288 + 576));
  auto v = values(w);
  CHECK(max_abs(v) <= a + 1e-7);
  CHECK(stddev(v) == Approx(a / std::sqrt(3.0)).epsilon(0.03));

  init::xavier_normal_(w, 2.0, gen);
  CHECK(stddev(values(w)) == Approx(2.0 * std::sqrt(2.0 / (288 + 576))).epsilon(0.03));

  init::kaiming_uniform_(w, 0.0, init::FanMode::FanIn, init::Nonlinearity::Relu, gen);
  double bound = std::sqrt(2.0) * std::sqrt(3.0 / 288);
  CHECK(max_abs(values(w)) <= bound + 1e-7);
  CHECK(max_abs(values(w)) > 0.9 * bound);

  init::kaiming_normal_(w, 0.0, init::FanMode::FanOut, init::Nonlinearity::Relu, gen);
  CHECK(stddev(values(w)) == Approx(std::sqrt(2.0 / 576)).epsilon(0.03));

  init::uniform_(w, 2.0, 3.0, gen);
  v = values(w);
  CHECK(*std::min_element(v.begin(), v.end()) >= 2.0);
  CHECK(*std::max_element(v.begin(), v.end()) < 3.0);

  init::zeros_(w);
  CHECK(max_abs(values(w)) == 0.0);
  init::ones_(w);
  CHECK(values(w) == std::vector<double>(w.numel(), 1.0));

  // The same seed gives the same values, in any dtype.
  Tensor w32 = empty({5, 7}), w64 = empty({5, 7}, kFloat64);
  Generator g1(5), g2(5);
  init::xavier_uniform_(w32, 1.0, g1);
  init::xavier_uniform_(w64, 1.0, g2);
  auto v32 = values(w32), v64 = values(w64);
  for (size_t i = 0; i < v32.size(); ++i) CHECK(v32[i] == Approx(v64[i]).margin(1e-7));
  init::xavier_uniform_(w64, 1.0, g2);
  CHECK(values(w64) != v64);

  CHECK_THROWS_AS(init::xavier_uniform_(empty({3}), 1.0, gen), ValueError);
  CHECK_THROWS_AS(init::uniform_(empty({3}, kInt64), 0, 1, gen), DTypeError);
}

TEST_CASE("init: the models draw each weight once, Xavier-uniform, under SkipDefaultInitGuard", "[nn]") {
  // Under the guard, default_layer_init_ draws nothing.
  {
    Generator g(9), ref(9);
    Tensor w = zeros({4, 3}), b = zeros({4});
    {
      init::SkipDefaultInitGuard skip;
      CHECK(init::SkipDefaultInitGuard::active());
      init::default_layer_init_(w, b, g);
    }
    CHECK(!init::SkipDefaultInitGuard::active());
    CHECK(values(w) == std::vector<double>(12, 0.0));
    CHECK(g.next_u64() == ref.next_u64());
  }
  // LeNet from a seed: each Conv2d/Linear weight is the next xavier_uniform_ draw (in module
  // order), biases are zero, and nothing else was drawn.
  Generator g(3), ref(3);
  auto net = models::lenet({}, g);
  for (const auto& [name, t] : net->state_dict()) {
    INFO(name);
    Tensor want = zeros(t.shape());
    if (name.find("weight") != std::string::npos) init::xavier_uniform_(want, 1.0, ref);
    CHECK(values(t) == values(want));
  }
  CHECK(g.next_u64() == ref.next_u64());
}
