// CPU reductions (sum/mean/max over any dims, sum_to, argmax) and matmul.
#include <cmath>
#include <limits>

#include "tests/kernels/test_cpu_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// Reference reduction of a [A, B, C] array over the flagged dims, keepdim layout.
std::vector<double> ref_reduce(ReduceOp op, const std::vector<double>& x, const Shape& s,
                               std::array<bool, 3> red) {
  const int64_t oa = red[0] ? 1 : s[0], ob = red[1] ? 1 : s[1], oc = red[2] ? 1 : s[2];
  std::vector<double> out(static_cast<size_t>(oa * ob * oc),
                          op == ReduceOp::Max ? -std::numeric_limits<double>::infinity() : 0.0);
  std::vector<int64_t> count(out.size(), 0);
  for (int64_t i = 0; i < s[0]; ++i)
    for (int64_t j = 0; j < s[1]; ++j)
      for (int64_t k = 0; k < s[2]; ++k) {
        const size_t o =
            static_cast<size_t>(((red[0] ? 0 : i) * ob + (red[1] ? 0 : j)) * oc + (red[2] ? 0 : k));
        const double v = x[flat(s, {i, j, k})];
        out[o] = op == ReduceOp::Max ? std::max(out[o], v) : out[o] + v;
        ++count[o];
      }
  if (op == ReduceOp::Mean)
    for (size_t o = 0; o < out.size(); ++o) out[o] /= static_cast<double>(count[o]);
  return out;
}

}  // namespace

TEST_CASE("cpu reductions over any dims", "[kernels]") {
  const Shape s{3, 4, 5};
  const std::vector<std::pair<std::vector<int64_t>, std::array<bool, 3>>> cases = {
      {{}, {true, true, true}},       {{0}, {true, false, false}},   {{1}, {false, true, false}},
      {{-1}, {false, false, true}},   {{0, 2}, {true, false, true}}, {{2, 1}, {false, true, true}},
      {{0, 1, 2}, {true, true, true}}};
  for (DType dt : kFloatTypes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max}) {
      for (const auto& [dims, red] : cases) {
        for (bool strided : {false, true}) {
          INFO(dtype_name(dt) << " op " << static_cast<int>(op) << " dims " << dims.size()
                              << " strided " << strided);
          // The strided input is a permuted view of a [5, 3, 4] tensor.
          Tensor x = strided ? rnd({5, 3, 4}, dt).permute({1, 2, 0}) : rnd(s, dt);
          REQUIRE(x.shape() == s);
          const std::vector<double> want = ref_reduce(op, values(x), s, red);
          Tensor kept = kernels::reduce(op, x, dims, true);
          Shape ks;
          for (int d = 0; d < 3; ++d) ks.push_back(red[d] ? 1 : s[d]);
          REQUIRE(kept.shape() == ks);
          require_close(kept, want, tol(dt) * 10);
          Tensor dropped = kernels::reduce(op, x, dims, false);
          Shape ds;
          for (int d = 0; d < 3; ++d)
            if (!red[d]) ds.push_back(s[d]);
          REQUIRE(dropped.shape() == ds);
          require_close(dropped, want, tol(dt) * 10);
        }
      }
    }
  }
}

TEST_CASE("cpu float32 sums accumulate in float64", "[kernels]") {
  Tensor x = full({1000000}, 0.1, kFloat32);
  // A float32 running sum drifts by ~1%; float64 accumulation is exact to float32 rounding.
  REQUIRE(kernels::sum(x).item() == Approx(1000000.0 * static_cast<double>(0.1f)).epsilon(1e-7));
  Tensor ints = from_vector<int64_t>({4, -1, 9, 2}, {2, 2});
  require_close(kernels::sum(ints, {1}), {3, 11}, 0);
  require_close(kernels::max(ints, {0}), {9, 2}, 0);
}

TEST_CASE("cpu sum_to inverts broadcasting", "[kernels]") {
  for (DType dt : kFloatTypes) {
    Tensor x = rnd({2, 3, 4}, dt);
    const std::vector<double> xv = values(x);
    require_close(kernels::sum_to(x, {3, 1}),
                  ref_reduce(ReduceOp::Sum, xv, {2, 3, 4}, {true, false, true}), tol(dt));
    require_close(kernels::sum_to(x, {4}),
                  ref_reduce(ReduceOp::Sum, xv, {2, 3, 4}, {true, true, false}), tol(dt));
    require_close(kernels::sum_to(x, {1, 1, 4}),
                  ref_reduce(ReduceOp::Sum, xv, {2, 3, 4}, {true, true, false}), tol(dt));
    REQUIRE(kernels::sum_to(x, {1, 1, 4}).shape() == Shape{1, 1, 4});
    require_close(kernels::sum_to(x, {2, 3, 4}), xv, 0);
    require_close(kernels::sum_to(x, {}),
                  ref_reduce(ReduceOp::Sum, xv, {2, 3, 4}, {true, true, true}), tol(dt));
    Tensor row = rnd({1, 3}, dt);
    Tensor r = kernels::sum_to(row, {3});  // only a leading 1 to drop
    REQUIRE(r.shape() == Shape{3});
    require_close(r, values(row), 0);
    REQUIRE_THROWS_AS(kernels::sum_to(x, {3}), ShapeError);
    REQUIRE_THROWS_AS(kernels::sum_to(x, {5, 2, 3, 4}), ShapeError);
  }
}

TEST_CASE("cpu argmax picks the first maximum", "[kernels]") {
  Tensor x = from_vector<double>({1, 5, 5, 2, 7, 0, 7, 3}, {2, 4});
  require_close(kernels::argmax(x, 1), {1, 0}, 0);
  require_close(kernels::argmax(x, 0), {1, 0, 1, 1}, 0);
  require_close(kernels::argmax(x.to(kFloat32), -1), {1, 0}, 0);
  REQUIRE(kernels::argmax(x, 1).dtype() == kInt64);
}

TEST_CASE("cpu reduction errors", "[kernels]") {
  Tensor x = rnd({2, 3}, kFloat32);
  REQUIRE_THROWS_AS(kernels::sum(x, {2}), ShapeError);
  REQUIRE_THROWS_AS(kernels::sum(x, {1, -1}), ShapeError);
  REQUIRE_THROWS_AS(kernels::mean(from_vector<int64_t>({1, 2}, {2})), DTypeError);
  REQUIRE_THROWS_AS(kernels::max(empty({2, 0}), {1}), ValueError);
  REQUIRE_THROWS_AS(kernels::argmax(x, 3), ShapeError);
}

TEST_CASE("cpu matmul in all transpose combinations", "[kernels]") {
  const int64_t m = 5, k = 7, n = 3;
  for (DType dt : kFloatTypes) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        INFO(dtype_name(dt) << " ta=" << ta << " tb=" << tb);
        Tensor a = ta ? rnd({k, m}, dt) : rnd({m, k}, dt);
        Tensor b = tb ? rnd({n, k}, dt) : rnd({k, n}, dt);
        const std::vector<double> av = values(a), bv = values(b);
        std::vector<double> want(m * n, 0.0);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            for (int64_t p = 0; p < k; ++p)
              want[i * n + j] +=
                  (ta ? av[p * m + i] : av[i * k + p]) * (tb ? bv[j * k + p] : bv[p * n + j]);
        Tensor c = kernels::matmul(a, b, ta, tb);
        REQUIRE(c.shape() == Shape{m, n});
        require_close(c, want, tol(dt) * 10);
        // The same product from transposed views (no flag) and from sliced, strided operands.
        Tensor av_ = ta ? a.transpose(0, 1) : a;
        Tensor bv_ = tb ? b.transpose(0, 1) : b;
        require_close(kernels::matmul(av_, bv_), want, tol(dt) * 10);
        Tensor wide = zeros({av_.size(0), av_.size(1) + 2}, dt);
        Tensor sliced = wide.slice(1, 1, 1 + av_.size(1));
        sliced.copy_(av_);
        require_close(kernels::matmul(sliced, bv_), want, tol(dt) * 10);
      }
    }
  }
}

TEST_CASE("cpu matmul edge cases and errors", "[kernels]") {
  Tensor a = rnd({4, 0}, kFloat32), b = rnd({0, 3}, kFloat32);
  require_close(kernels::matmul(a, b), std::vector<double>(12, 0.0), 0);
  REQUIRE(kernels::matmul(rnd({0, 2}, kFloat64), rnd({2, 3}, kFloat64)).shape() == Shape{0, 3});

  Tensor x = rnd({256, 400}, kFloat32), w = rnd({120, 84}, kFloat32);
  const std::string msg = error_message([&] { kernels::matmul(x, w); });
  INFO(msg);
  REQUIRE(msg.find("matmul: [256,400] @ [120,84]: inner dims 400 != 120") != std::string::npos);
  REQUIRE_THROWS_AS(kernels::matmul(x, w), ShapeError);
  REQUIRE_THROWS_AS(kernels::matmul(x, rnd({400}, kFloat32)), ShapeError);
  REQUIRE_THROWS_AS(kernels::matmul(x, rnd({400, 2}, kFloat64)), DTypeError);
  REQUIRE_THROWS_AS(
      kernels::matmul(from_vector<int64_t>({1}, {1, 1}), from_vector<int64_t>({1}, {1, 1})),
      DTypeError);
}
