// Float64 finite-difference checks of the elementwise ops and reductions.
#include "autograd/ops.h"
#include "gradcheck_util.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::check_gradients;
using tandem::test::leaf;
using tandem::test::leaf_away_from_zero;
using V = std::vector<Tensor>;

TEST_CASE("gradcheck add sub mul div with and without broadcasting", "[autograd]") {
  manual_seed(11);
  struct Case {
    Shape a, b;
  };
  const std::vector<Case> cases = {
      {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{4}, {3, 4}}, {{2, 1, 3}, {4, 1}}, {{2, 3}, {}}};
  for (const auto& c : cases) {
    INFO("a " << shape_str(c.a) << " b " << shape_str(c.b));
    Tensor a = leaf(c.a), b = leaf(c.b);
    check_gradients([](const V& in) { return add(in[0], in[1]); }, {a, b});
    check_gradients([](const V& in) { return sub(in[0], in[1]); }, {a, b});
    check_gradients([](const V& in) { return mul(in[0], in[1]); }, {a, b});
    Tensor d = leaf(c.b, 0.5, 2.0);  // divisor away from zero
    check_gradients([](const V& in) { return div(in[0], in[1]); }, {a, d});
  }
}

TEST_CASE("gradcheck binary ops where only one side requires grad", "[autograd]") {
  manual_seed(12);
  Tensor a = leaf({3, 4});
  Tensor b = uniform({4}, 0.5, 2.0, kFloat64);  // constant
  check_gradients([](const V& in) { return mul(in[0], in[1]); }, {a, b});
  check_gradients([](const V& in) { return div(in[1], in[0]); }, {leaf({3, 4}, 0.5, 2.0), b});
  check_gradients([](const V& in) { return sub(in[1], in[0]); }, {a, b});
}

TEST_CASE("gradcheck scalar ops and pow", "[autograd]") {
  manual_seed(13);
  Tensor a = leaf({2, 5});
  check_gradients([](const V& in) { return add(in[0], 2.5); }, {a});
  check_gradients([](const V& in) { return mul(in[0], -1.5); }, {a});
  check_gradients([](const V& in) { return pow(in[0], 2.0); }, {a});
  check_gradients([](const V& in) { return pow(in[0], 3.0); }, {a});
  check_gradients([](const V& in) { return pow(in[0], 1.0); }, {a});
  check_gradients([](const V& in) { return pow(in[0], 0.0); }, {a});
  Tensor p = leaf({2, 5}, 0.5, 2.0);  // fractional and negative exponents need x > 0
  check_gradients([](const V& in) { return pow(in[0], 0.5); }, {p});
  check_gradients([](const V& in) { return pow(in[0], -1.5); }, {p});
}

TEST_CASE("gradcheck unary ops", "[autograd]") {
  manual_seed(14);
  Tensor x = leaf({3, 4}, -2.0, 2.0);
  Tensor pos = leaf({3, 4}, 0.3, 3.0);
  check_gradients([](const V& in) { return neg(in[0]); }, {x});
  check_gradients([](const V& in) { return exp(in[0]); }, {x});
  check_gradients([](const V& in) { return log(in[0]); }, {pos});
  check_gradients([](const V& in) { return sqrt(in[0]); }, {pos});
  check_gradients([](const V& in) { return sigmoid(in[0]); }, {x});
  check_gradients([](const V& in) { return tanh(in[0]); }, {x});
  check_gradients([](const V& in) { return relu(in[0]); }, {leaf_away_from_zero({3, 4})});
}

TEST_CASE("gradcheck operators compose", "[autograd]") {
  manual_seed(15);
  Tensor a = leaf({2, 3}), b = leaf({3}, 0.5, 2.0), c = leaf({2, 1});
  check_gradients([](const V& in) { return (in[0] + in[1]) * in[2] - in[0] / in[1] + (-in[2]); },
                  {a, b, c});
  check_gradients([](const V& in) { return 2.0 * ((in[0] + 1.0) - 3.0) * 0.5 / 4.0; }, {a});
}

TEST_CASE("gradcheck sum and mean", "[autograd]") {
  manual_seed(16);
  Tensor x = leaf({2, 3, 4});
  using Dims = std::vector<int64_t>;
  const std::vector<std::pair<Dims, bool>> cases = {
      {{}, false}, {{0}, false}, {{-1}, true}, {{0, 2}, false}, {{1}, true}, {{0, 1, 2}, true}};
  for (const auto& [dims, keep] : cases) {
    INFO("dims size " << dims.size() << " keepdim " << keep);
    check_gradients([d = dims, k = keep](const V& in) { return sum(in[0], d, k); }, {x});
    check_gradients([d = dims, k = keep](const V& in) { return mean(in[0], d, k); }, {x});
  }
}

TEST_CASE("gradcheck max over dims (distinct values)", "[autograd]") {
  manual_seed(17);
  // Continuous random values are distinct with gaps far above the finite-difference step.
  Tensor x = leaf({3, 4, 5});
  using Dims = std::vector<int64_t>;
  const std::vector<std::pair<Dims, bool>> cases = {
      {{}, false}, {{1}, false}, {{-1}, true}, {{0, 2}, true}, {{0}, false}};
  for (const auto& [dims, keep] : cases) {
    INFO("dims size " << dims.size() << " keepdim " << keep);
    check_gradients([d = dims, k = keep](const V& in) { return max(in[0], d, k); }, {x});
  }
}

TEST_CASE("max routes the gradient to the first maximum of a tie", "[autograd]") {
  Tensor x = from_vector<double>({1, 3, 3, 2, 5, 5, 5, 0}, {2, 4});
  x.set_requires_grad();
  sum(max(x, {1})).backward();
  REQUIRE(x.grad().to_vector<double>() == std::vector<double>{0, 1, 0, 0, 1, 0, 0, 0});
}

TEST_CASE("add_relu is relu(a + b) bit for bit, with its gradient", "[autograd]") {
  manual_seed(13);
  for (const auto& [sa, sb] : {std::pair<Shape, Shape>{{3, 4}, {3, 4}}, {{2, 3, 4}, {4}}}) {
    INFO("a " << shape_str(sa) << " b " << shape_str(sb));
    // Values away from the kink a + b = 0, where the finite difference would straddle it.
    Tensor a = leaf(sa), b = leaf(sb);
    check_gradients([](const V& in) { return add_relu(in[0], in[1]); }, {a, b});
    for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
      INFO(dtype_name(dt));
      const Tensor x = uniform(sa, -1.0, 1.0).to(dt), y = uniform(sb, -1.0, 1.0).to(dt);
      const Tensor fused = add_relu(x, y), plain = relu(add(x, y));
      REQUIRE(fused.dtype() == dt);
      CHECK(tandem::test::values(fused) == tandem::test::values(plain));
      if (tandem::test::have_cuda()) {
        const Device g = Device::cuda(0);
        CHECK(tandem::test::values(add_relu(x.to(g), y.to(g))) == tandem::test::values(plain));
      }
    }
  }
}
