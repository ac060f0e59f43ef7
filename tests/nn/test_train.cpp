// Short CPU training runs on tiny synthetic, separable data: the loss must fall.
#include <vector>

#include "autograd/ops.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn.h"

using namespace tandem;
using namespace tandem::nn;

namespace {

// Three Gaussian blobs in 2-D, one per class: X [n, 2] float32, y [n] int64.
std::pair<Tensor, Tensor> blobs(int64_t n, Generator& gen) {
  const double centers[3][2] = {{2.0, 0.0}, {-1.0, 1.7}, {-1.0, -1.7}};
  std::vector<double> noise(2 * n);
  gen.normal(noise.data(), 2 * n, 0.0, 0.4);
  std::vector<float> x(2 * n);
  std::vector<int64_t> y(n);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = i % 3;
    x[2 * i] = static_cast<float>(centers[y[i]][0] + noise[2 * i]);
    x[2 * i + 1] = static_cast<float>(centers[y[i]][1] + noise[2 * i + 1]);
  }
  return {from_vector<float>(x, {n, 2}), from_vector<int64_t>(y, {n})};
}

// 28x28 images: class 0 is bright in the top half, class 1 in the bottom half, plus noise.
std::pair<Tensor, Tensor> halves(int64_t n, Generator& gen) {
  std::vector<double> noise(n * 28 * 28);
  gen.normal(noise.data(), static_cast<int64_t>(noise.size()), 0.0, 0.3);
  std::vector<float> x(noise.size());
  std::vector<int64_t> y(n);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = i % 2;
    for (int64_t r = 0; r < 28; ++r)
      for (int64_t c = 0; c < 28; ++c) {
        size_t at = (i * 28 + r) * 28 + c;
        bool bright = (r < 14) == (y[i] == 0);
        x[at] = static_cast<float>((bright ? 1.0 : 0.0) + noise[at]);
      }
  }
  return {from_vector<float>(x, {n, 1, 28, 28}), from_vector<int64_t>(y, {n})};
}

int64_t correct(const Tensor& logits, const Tensor& target) {
  Tensor count = zeros({1}, kInt64);
  kernels::count_correct(logits, target, count);
  return static_cast<int64_t>(count.item());
}

}  // namespace

TEST_CASE("an MLP learns separable blobs with SGD", "[nn]") {
  Generator gen(11);
  auto [x, y] = blobs(96, gen);
  SequentialImpl net{std::make_shared<Linear>(2, 16, true, gen), std::make_shared<ReLU>(),
                 std::make_shared<Linear>(16, 3, true, gen)};
  optim::SGD opt(net.parameters(), 0.1, 0.9);
  CrossEntropyLoss loss_fn;
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    opt.zero_grad();
    Tensor loss = loss_fn(net(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.25 * first);
  NoGradGuard no_grad;
  CHECK(correct(net(x), y) >= 90);
}

TEST_CASE("LeNet learns a two-class image task with Adam", "[nn]") {
  Generator gen(12);
  auto [x, y] = halves(16, gen);
  auto net = models::lenet({models::LeNetActivation::ReLU}, gen);
  optim::Adam opt(net->parameters(), 1e-3);
  double first = 0, last = 0;
  for (int step = 0; step < 25; ++step) {
    opt.zero_grad();
    Tensor loss = cross_entropy((*net)(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.5 * first);
  net->eval();
  NoGradGuard no_grad;
  CHECK(correct((*net)(x), y) == 16);
}

TEST_CASE("a small conv net with BatchNorm and a residual block trains", "[nn]") {
  Generator gen(13);
  auto [x, y] = halves(8, gen);
  SequentialImpl net{std::make_shared<Conv2d>(1, 4, 3, 2, 1, true, gen),  // [8, 4, 14, 14]
                 std::make_shared<BatchNorm2d>(4),
                 std::make_shared<ReLU>(),
                 std::make_shared<Residual>(4, 8, true, 2, gen),  // [8, 8, 7, 7]
                 std::make_shared<GlobalAvgPool2d>(),
                 std::make_shared<Linear>(8, 2, true, gen)};
  optim::SGD opt(net.parameters(), 0.05, 0.9, 0.0, 1e-4);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    Tensor loss = cross_entropy(net(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(last < 0.5 * first);
}
