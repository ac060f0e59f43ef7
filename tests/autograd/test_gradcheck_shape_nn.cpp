// Float64 finite-difference checks of the shape ops and the neural-network ops.
#include "autograd/ops.h"
#include "gradcheck_util.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::check_gradients;
using tandem::test::leaf;
using tandem::test::values;
using V = std::vector<Tensor>;

TEST_CASE("gradcheck reshape flatten transpose slice", "[autograd]") {
  manual_seed(21);
  Tensor x = leaf({2, 3, 4});
  check_gradients([](const V& in) { return reshape(in[0], {4, -1}); }, {x});
  check_gradients([](const V& in) { return reshape(in[0], {2, 3, 4}); }, {x});
  check_gradients([](const V& in) { return flatten(in[0]); }, {x});
  check_gradients([](const V& in) { return flatten(in[0], 0); }, {x});
  check_gradients([](const V& in) { return transpose(in[0], 0, 2); }, {x});
  // A transposed (non-contiguous) gradient flowing into an op that reshapes it.
  check_gradients([](const V& in) { return reshape(transpose(in[0], 1, 2), {2, 12}); }, {x});
  check_gradients([](const V& in) { return slice(in[0], 1, 1, 3); }, {x});
  check_gradients([](const V& in) { return slice(in[0], 2, 0, 1); }, {x});
  check_gradients([](const V& in) { return slice(in[0], 0, 1, 2) * slice(in[0], 0, 0, 1); }, {x});
}

TEST_CASE("gradcheck index_select with repeated indices", "[autograd]") {
  manual_seed(22);
  Tensor x = leaf({4, 3});
  Tensor idx = from_vector<int64_t>({2, 0, 2, 3}, {4});
  check_gradients([idx](const V& in) { return index_select(in[0], idx); }, {x});
}

TEST_CASE("gradcheck cat along several dims with a constant input", "[autograd]") {
  manual_seed(23);
  Tensor a = leaf({2, 3}), b = leaf({1, 3}), c = uniform({3, 3}, -1, 1, kFloat64);
  check_gradients([](const V& in) { return cat(in, 0); }, {a, b, c});
  Tensor d = leaf({2, 1}), e = leaf({2, 4});
  check_gradients([](const V& in) { return cat(in, 1); }, {a, d, e});
  check_gradients([](const V& in) { return cat(in, -1); }, {a, d});
}

TEST_CASE("gradcheck to_device between virtual CPU devices", "[autograd]") {
  manual_seed(24);
  Tensor x = leaf({2, 3});
  check_gradients([](const V& in) { return exp(to_device(in[0], Device::cpu(1))); }, {x});
  Tensor y = to_device(x, Device::cpu(1));
  REQUIRE(y.device() == Device::cpu(1));
  sum(y).backward();
  REQUIRE(x.grad().device() == kCPU);
}

TEST_CASE("gradcheck matmul and linear", "[autograd]") {
  manual_seed(25);
  Tensor a = leaf({3, 4}), b = leaf({4, 5});
  check_gradients([](const V& in) { return matmul(in[0], in[1]); }, {a, b});
  Tensor x = leaf({5, 4}), w = leaf({3, 4}), bias = leaf({3});
  check_gradients([](const V& in) { return linear(in[0], in[1], in[2]); }, {x, w, bias});
  check_gradients([](const V& in) { return linear(in[0], in[1], Tensor()); }, {x, w});
}

TEST_CASE("gradcheck conv2d", "[autograd]") {
  manual_seed(26);
  Tensor x = leaf({2, 3, 6, 5}), w = leaf({4, 3, 3, 2}), b = leaf({4});
  SECTION("stride 1, no padding, bias") {
    check_gradients([](const V& in) { return conv2d(in[0], in[1], in[2]); }, {x, w, b});
  }
  SECTION("stride 2x1, padding 1x2, bias") {
    Conv2dParams p{2, 1, 1, 2};
    check_gradients([p](const V& in) { return conv2d(in[0], in[1], in[2], p); }, {x, w, b});
  }
  SECTION("stride 2, padding 1, no bias") {
    Conv2dParams p{2, 2, 1, 1};
    check_gradients([p](const V& in) { return conv2d(in[0], in[1], Tensor(), p); }, {x, w});
  }
}

TEST_CASE("gradcheck max and avg pooling", "[autograd]") {
  manual_seed(27);
  Tensor x = leaf({2, 2, 6, 7});
  const std::vector<Pool2dParams> params = {
      {2, 2, 2, 2, 0, 0},  // non-overlapping
      {3, 3, 1, 1, 0, 0},  // overlapping
      {3, 2, 2, 1, 1, 0},  // overlapping, padded
  };
  for (const auto& p : params) {
    INFO("kernel " << p.kernel_h << "x" << p.kernel_w << " stride " << p.stride_h << "x"
                   << p.stride_w << " pad " << p.pad_h << "x" << p.pad_w);
    check_gradients([p](const V& in) { return max_pool2d(in[0], p); }, {x});
    check_gradients([p](const V& in) { return avg_pool2d(in[0], p); }, {x});
  }
}

TEST_CASE("gradcheck log_softmax and cross_entropy", "[autograd]") {
  manual_seed(28);
  Tensor x = leaf({4, 5}, -2.0, 2.0);
  check_gradients([](const V& in) { return log_softmax(in[0]); }, {x});
  Tensor target = from_vector<int64_t>({1, 0, 4, 4}, {4});
  check_gradients([target](const V& in) { return cross_entropy(in[0], target); }, {x});
  // A non-unit upstream gradient reaches the fused backward as a tensor.
  check_gradients([target](const V& in) { return mul(cross_entropy(in[0], target), 3.0); }, {x});
}

TEST_CASE("gradcheck batch_norm train and eval", "[autograd]") {
  manual_seed(29);
  for (const Shape& shape : {Shape{4, 3, 2, 3}, Shape{6, 3}}) {
    INFO("x " << shape_str(shape));
    Tensor x = leaf(shape, -2.0, 2.0);
    Tensor gamma = leaf({3}, 0.5, 1.5), beta = leaf({3});
    Tensor rmean = uniform({3}, -0.5, 0.5, kFloat64), rvar = uniform({3}, 0.5, 2.0, kFloat64);
    for (bool training : {true, false}) {
      INFO("training " << training);
      check_gradients(
          [&](const V& in) {
            return batch_norm(in[0], in[1], in[2], rmean, rvar, training, 0.1, 1e-5);
          },
          {x, gamma, beta});
      check_gradients(  // no affine part: gamma and beta undefined
          [&](const V& in) {
            return batch_norm(in[0], Tensor(), Tensor(), rmean, rvar, training, 0.1, 1e-5);
          },
          {x});
    }
  }
}

TEST_CASE("batch_norm train updates running stats once per call", "[autograd]") {
  manual_seed(31);
  Tensor x = leaf({8, 2}, -1.0, 3.0);
  Tensor rmean = zeros({2}, kFloat64), rvar = ones({2}, kFloat64);
  Tensor y = batch_norm(x, Tensor(), Tensor(), rmean, rvar, true, 0.5, 1e-5);
  auto xm = values(mean(x, {0}));
  auto rm = values(rmean);
  REQUIRE(rm[0] == Approx(0.5 * xm[0]));
  REQUIRE(rm[1] == Approx(0.5 * xm[1]));
  sum(y).backward();  // backward does not touch the running stats
  REQUIRE(values(rmean) == rm);
}

TEST_CASE("batch_norm eval backward matches the affine map", "[autograd]") {
  manual_seed(30);
  Tensor x = leaf({5, 2});
  Tensor gamma = from_vector<double>({2.0, -1.0}, {2}), beta = from_vector<double>({0.5, 0.0}, {2});
  Tensor rmean = from_vector<double>({0.1, -0.2}, {2}),
         rvar = from_vector<double>({4.0, 0.25}, {2});
  sum(batch_norm(x, gamma, beta, rmean, rvar, false, 0.1, 0.0)).backward();
  auto g = x.grad().to_vector<double>();
  for (size_t i = 0; i < g.size(); i += 2) {
    REQUIRE(g[i] == Approx(2.0 / 2.0));
    REQUIRE(g[i + 1] == Approx(-1.0 / 0.5));
  }
}
