// CPU log-softmax, cross-entropy, accuracy counting, row indexing and batch norm.
#include <cmath>

#include "tests/kernels/test_cpu_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

std::vector<double> ref_log_softmax(const std::vector<double>& x, int64_t n, int64_t c) {
  std::vector<double> y(x.size());
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int64_t j = 0; j < c; ++j) s += std::exp(x[i * c + j]);
    for (int64_t j = 0; j < c; ++j) y[i * c + j] = x[i * c + j] - std::log(s);
  }
  return y;
}

}  // namespace

TEST_CASE("cpu log_softmax and its backward", "[kernels]") {
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Tensor x = rnd({4, 6}, dt, -3, 3);
    const std::vector<double> want = ref_log_softmax(values(x), 4, 6);
    Tensor y = kernels::log_softmax(x);
    require_close(y, want, tol(dt));
    Tensor dy = rnd({4, 6}, dt);
    std::vector<double> g = values(dy), dx(24);
    for (int64_t i = 0; i < 4; ++i) {
      double s = 0;
      for (int64_t j = 0; j < 6; ++j) s += g[i * 6 + j];
      for (int64_t j = 0; j < 6; ++j) dx[i * 6 + j] = g[i * 6 + j] - std::exp(want[i * 6 + j]) * s;
    }
    require_close(kernels::log_softmax_backward(dy, y), dx, tol(dt) * 4);
    // Large logits: the max is subtracted before exp.
    Tensor big = from_vector<double>({1000, 1001, 1002}, {1, 3}).to(dt);
    require_close(kernels::log_softmax(big), ref_log_softmax({0, 1, 2}, 1, 3), tol(dt) * 10);
  }
}

TEST_CASE("cpu cross_entropy forward and backward", "[kernels]") {
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const int64_t n = 5, c = 4;
    Tensor logits = rnd({n, c}, dt, -2, 2);
    Tensor target = from_vector<int64_t>({3, 0, 1, 3, 2}, {n});
    const std::vector<double> lp = ref_log_softmax(values(logits), n, c);
    const std::vector<int64_t> t = target.to_vector<int64_t>();
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) loss -= lp[i * c + t[i]];
    loss /= n;
    auto [l, log_probs] = kernels::cross_entropy(logits, target);
    REQUIRE(l.shape() == Shape{});
    REQUIRE(l.dtype() == dt);
    require_close(l, {loss}, tol(dt));
    require_close(log_probs, lp, tol(dt));

    Tensor dloss = full({}, 2.5, dt);
    std::vector<double> want(n * c);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < c; ++j)
        want[i * c + j] = (std::exp(lp[i * c + j]) - (j == t[i] ? 1.0 : 0.0)) * 2.5 / n;
    require_close(kernels::cross_entropy_backward(log_probs, target, dloss), want, tol(dt));
  }
}

TEST_CASE("cpu count_correct accumulates on the device", "[kernels]") {
  Tensor logits =
      from_vector<float>({0.1f, 0.9f, 0.0f, 2.0f, 1.0f, 0.5f, 0.3f, 0.3f, 0.1f}, {3, 3});
  Tensor target = from_vector<int64_t>({1, 1, 0}, {3});
  Tensor correct = zeros({1}, kInt64);
  kernels::count_correct(logits, target, correct);  // rows 0 and 2 (first of a tie) are right
  REQUIRE(correct.item() == 2);
  kernels::count_correct(logits, target, correct);
  REQUIRE(correct.item() == 4);
  REQUIRE_THROWS_AS(kernels::count_correct(logits, target, zeros({1}, kFloat32)), DTypeError);
}

TEST_CASE("cpu cross_entropy rejects bad targets", "[kernels]") {
  Tensor logits = rnd({3, 4}, kFloat32);
  REQUIRE_THROWS_AS(kernels::cross_entropy(logits, from_vector<int64_t>({0, 4, 1}, {3})),
                    ValueError);
  REQUIRE_THROWS_AS(kernels::cross_entropy(logits, from_vector<int64_t>({0, -1, 1}, {3})),
                    ValueError);
  REQUIRE_THROWS_AS(kernels::cross_entropy(logits, from_vector<int64_t>({0, 1}, {2})), ShapeError);
  REQUIRE_THROWS_AS(kernels::cross_entropy(logits, from_vector<float>({0, 1, 2}, {3})), DTypeError);
  REQUIRE_THROWS_AS(
      kernels::cross_entropy(rnd({3, 4, 1}, kFloat32), from_vector<int64_t>({0, 1, 2}, {3})),
      ShapeError);
  auto [loss, lp] = kernels::cross_entropy(logits, from_vector<int64_t>({0, 1, 2}, {3}));
  REQUIRE_THROWS_AS(
      kernels::cross_entropy_backward(lp, from_vector<int64_t>({0, 9, 2}, {3}), ones({}, kFloat32)),
      ValueError);
  REQUIRE_THROWS_AS(kernels::cross_entropy_backward(lp, from_vector<int64_t>({0, 1, 2}, {3}),
                                                    ones({2}, kFloat32)),
                    ShapeError);
}

TEST_CASE("cpu index_select and index_add", "[kernels]") {
  for (DType dt : {kFloat32, kFloat64, kInt64}) {
    INFO(dtype_name(dt));
    Tensor x = from_vector<double>({0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32}, {4, 3}).to(dt);
    Tensor idx = from_vector<int64_t>({2, 0, 2, 3}, {4});
    require_close(kernels::index_select(x, idx), {20, 21, 22, 0, 1, 2, 20, 21, 22, 30, 31, 32}, 0);
    require_close(kernels::index_select(x.select(1, 1), idx), {21, 1, 21, 31}, 0);  // strided 1-D
    Tensor src = from_vector<double>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {4, 3}).to(dt);
    Tensor out = kernels::index_add(src, idx, {5, 3});
    require_close(out, {4, 5, 6, 0, 0, 0, 8, 10, 12, 10, 11, 12, 0, 0, 0}, 0);
    kernels::index_add_(out, from_vector<int64_t>({4}, {1}), src.slice(0, 0, 1));  // in place, onto what is there
    require_close(out, {4, 5, 6, 0, 0, 0, 8, 10, 12, 10, 11, 12, 1, 2, 3}, 0);
  }
  REQUIRE_THROWS_AS(kernels::index_add_(zeros({5, 3}), from_vector<int64_t>({0}, {1}), zeros({1, 3}, kFloat64)),
                    DTypeError);
  REQUIRE_THROWS_AS(kernels::index_add_(zeros({5, 3}), from_vector<int64_t>({0}, {1}), zeros({1, 2})), ShapeError);
  const Tensor out5 = zeros({5, 3});
  REQUIRE_THROWS_AS(kernels::index_add_(out5, from_vector<int64_t>({0}, {1}), out5.slice(0, 4, 5)), ValueError);
  Tensor x = rnd({4, 2}, kFloat32);
  {  // into: the rows written where the caller says, the same values; a wrong one named
    const Tensor idx = from_vector<int64_t>({3, 1, 3}, {3});
    const Tensor into = empty({3, 2}, kFloat32);
    const Tensor got = kernels::index_select(x, idx, into);
    REQUIRE(got.same(into));
    require_close(into, kernels::index_select(x, idx).to_vector<double>(), 0);
    REQUIRE_THROWS_AS(kernels::index_select(x, idx, empty({2, 2}, kFloat32)), ShapeError);
    REQUIRE_THROWS_AS(kernels::index_select(x, idx, empty({2, 3}, kFloat32).transpose(0, 1)), ShapeError);  // not packed
    REQUIRE_THROWS_AS(kernels::index_select(x, idx, empty({3, 2}, kFloat64)), DTypeError);
    REQUIRE_THROWS_AS(kernels::index_select(x, from_vector<int64_t>({3, 1, 3, 0}, {4}), x), ValueError);  // itself
  }
  REQUIRE_THROWS_AS(kernels::index_select(x, from_vector<int64_t>({0, 4}, {2})), ValueError);
  REQUIRE_THROWS_AS(kernels::index_select(x, from_vector<int64_t>({-1}, {1})), ValueError);
  REQUIRE_THROWS_AS(kernels::index_select(x, from_vector<float>({0}, {1})), DTypeError);
  REQUIRE_THROWS_AS(kernels::index_add(x, from_vector<int64_t>({0, 1, 2, 7}, {4}), {5, 2}),
                    ValueError);
  REQUIRE_THROWS_AS(kernels::index_add(x, from_vector<int64_t>({0, 1}, {2}), {5, 2}), ShapeError);
}

namespace {

struct BnRef {
  std::vector<double> y, mean, invstd, rmean, rvar;
};

// Direct batch norm over x [N, C, HW] in float64.
BnRef bn_ref(const std::vector<double>& x, int64_t n, int64_t c, int64_t hw,
             const std::vector<double>& g, const std::vector<double>& b, std::vector<double> rm,
             std::vector<double> rv, double momentum, double eps) {
  BnRef r{std::vector<double>(x.size()), {}, {}, {}, {}};
  const double m = static_cast<double>(n * hw);
  for (int64_t ch = 0; ch < c; ++ch) {
    double s = 0, ss = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hw; ++j) s += x[(i * c + ch) * hw + j];
    const double mean = s / m;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hw; ++j) ss += std::pow(x[(i * c + ch) * hw + j] - mean, 2);
    const double invstd = 1 / std::sqrt(ss / m + eps);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hw; ++j) {
        const size_t o = static_cast<size_t>((i * c + ch) * hw + j);
        r.y[o] = (x[o] - mean) * invstd * g[ch] + b[ch];
      }
    r.mean.push_back(mean);
    r.invstd.push_back(invstd);
    r.rmean.push_back((1 - momentum) * rm[ch] + momentum * mean);
    r.rvar.push_back((1 - momentum) * rv[ch] + momentum * ss / (m - 1));
  }
  return r;
}

}  // namespace

TEST_CASE("cpu batch norm training, eval and backward", "[kernels]") {
  for (DType dt : kFloatTypes) {
    for (const Shape& xs : {Shape{4, 3, 2, 5}, Shape{6, 3}}) {
      INFO(dtype_name(dt) << " " << shape_str(xs));
      const int64_t n = xs[0], c = xs[1], hw = shape_numel(xs) / (n * c);
      Tensor x = rnd(xs, dt, -1, 3), gamma = rnd({c}, dt, 0.5, 1.5), beta = rnd({c}, dt);
      Tensor rm = rnd({c}, dt), rv = rnd({c}, dt, 0.5, 2);
      const BnRef r = bn_ref(values(x), n, c, hw, values(gamma), values(beta), values(rm),
                             values(rv), 0.1, 1e-5);
      auto res = kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5);
      require_close(res.y, r.y, tol(dt) * 10);
      require_close(res.save_mean, r.mean, tol(dt));
      require_close(res.save_invstd, r.invstd, tol(dt) * 10);
      require_close(rm, r.rmean, tol(dt));
      require_close(rv, r.rvar, tol(dt));

      // Eval with the updated running statistics.
      std::vector<double> xv = values(x), ye(xv.size()), g = values(gamma), b = values(beta);
      std::vector<double> m = values(rm), v = values(rv);
      for (size_t o = 0; o < xv.size(); ++o) {
        const size_t ch = (o / hw) % c;
        ye[o] = (xv[o] - m[ch]) / std::sqrt(v[ch] + 1e-5) * g[ch] + b[ch];
      }
      require_close(kernels::batch_norm_eval(x, gamma, beta, rm, rv, 1e-5), ye, tol(dt) * 10);
      // No affine part: gamma = 1, beta = 0.
      auto plain = kernels::batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5);
      std::vector<double> yp(xv.size());
      for (size_t o = 0; o < xv.size(); ++o) {
        const size_t ch = (o / hw) % c;
        yp[o] = (xv[o] - r.mean[ch]) * r.invstd[ch];
      }
      require_close(plain.y, yp, tol(dt) * 10);
    }
  }
}

TEST_CASE("cpu batch norm backward matches finite differences", "[kernels]") {
  const Shape xs{3, 2, 2, 2};
  Tensor x = rnd(xs, kFloat64, -1, 2), gamma = rnd({2}, kFloat64, 0.5, 1.5),
         beta = rnd({2}, kFloat64);
  Tensor dy = rnd(xs, kFloat64);
  Tensor rm = zeros({2}, kFloat64), rv = ones({2}, kFloat64);
  // loss(x, gamma, beta) = sum(y * dy): its gradients are what backward returns.
  auto loss = [&](const Tensor& xx, const Tensor& gg, const Tensor& bb) {
    Tensor y = kernels::batch_norm_train(xx, gg, bb, rm, rv, 0.1, 1e-5).y;
    return kernels::sum(kernels::binary(BinaryOp::Mul, y, dy)).item();
  };
  auto fwd = kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5);
  auto grads = kernels::batch_norm_backward(dy, x, gamma, fwd.save_mean, fwd.save_invstd);
  auto numeric = [&](const Tensor& t, int which) {
    std::vector<double> v = values(t), out(v.size());
    const double h = 1e-6;
    for (size_t i = 0; i < v.size(); ++i) {
      std::vector<double> p = v, q = v;
      p[i] += h;
      q[i] -= h;
      Tensor tp = from_vector(p, t.shape()), tq = from_vector(q, t.shape());
      const double lp = which == 0   ? loss(tp, gamma, beta)
                        : which == 1 ? loss(x, tp, beta)
                                     : loss(x, gamma, tp);
      const double lq = which == 0   ? loss(tq, gamma, beta)
                        : which == 1 ? loss(x, tq, beta)
                                     : loss(x, gamma, tq);
      out[i] = (lp - lq) / (2 * h);
    }
    return out;
  };
  require_close(grads.dx, numeric(x, 0), 1e-6);
  require_close(grads.dgamma, numeric(gamma, 1), 1e-6);
  require_close(grads.dbeta, numeric(beta, 2), 1e-6);
}

TEST_CASE("cpu batch norm argument errors", "[kernels]") {
  Tensor rm = zeros({3}), rv = ones({3});
  REQUIRE_THROWS_AS(
      kernels::batch_norm_train(rnd({1, 3}, kFloat32), Tensor(), Tensor(), rm, rv, 0.1, 1e-5),
      ValueError);
  REQUIRE_THROWS_AS(
      kernels::batch_norm_train(rnd({4, 2, 3}, kFloat32), Tensor(), Tensor(), rm, rv, 0.1, 1e-5),
      ShapeError);
  REQUIRE_THROWS_AS(
      kernels::batch_norm_train(rnd({4, 4}, kFloat32), Tensor(), Tensor(), rm, rv, 0.1, 1e-5),
      ShapeError);
  REQUIRE_THROWS_AS(
      kernels::batch_norm_train(rnd({4, 3}, kFloat64), Tensor(), Tensor(), rm, rv, 0.1, 1e-5),
      DTypeError);
}
