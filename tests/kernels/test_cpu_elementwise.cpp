// CPU elementwise kernels through the dispatcher: unary, binary with broadcasting, scalar,
// axpby, fill and copy, on contiguous and strided inputs.
#include <cmath>
#include <functional>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"
#include "tests/kernels/test_cpu_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

double ref_unary(UnaryOp op, double x) {
  switch (op) {
    case UnaryOp::Neg:
      return -x;
    case UnaryOp::Exp:
      return std::exp(x);
    case UnaryOp::Log:
      return std::log(x);
    case UnaryOp::Sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
    case UnaryOp::Relu:
      return x > 0 ? x : 0.0;
    case UnaryOp::Tanh:
      return std::tanh(x);
    case UnaryOp::Sqrt:
      return std::sqrt(x);
    case UnaryOp::Abs:
      return std::abs(x);
    case UnaryOp::Square:
      return x * x;
    case UnaryOp::Reciprocal:
      return 1.0 / x;
  }
  return 0;
}

double ref_binary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::Add:
      return a + b;
    case BinaryOp::Sub:
      return a - b;
    case BinaryOp::Mul:
      return a * b;
    case BinaryOp::Div:
      return a / b;
    case BinaryOp::Max:
      return std::max(a, b);
    case BinaryOp::Min:
      return std::min(a, b);
    case BinaryOp::Eq:
      return a == b ? 1.0 : 0.0;
    case BinaryOp::ReluBackward:
      return b > 0 ? a : 0.0;
    case BinaryOp::SigmoidBackward:
      return a * b * (1 - b);
    case BinaryOp::TanhBackward:
      return a * (1 - b * b);
  }
  return 0;
}

const UnaryOp kUnaryOps[] = {UnaryOp::Neg,    UnaryOp::Exp,       UnaryOp::Log,  UnaryOp::Sigmoid,
                             UnaryOp::Relu,   UnaryOp::Tanh,      UnaryOp::Sqrt, UnaryOp::Abs,
                             UnaryOp::Square, UnaryOp::Reciprocal};
const BinaryOp kBinaryOps[] = {
    BinaryOp::Add,         BinaryOp::Sub,          BinaryOp::Mul,
    BinaryOp::Div,         BinaryOp::Max,          BinaryOp::Min,
    BinaryOp::Eq,          BinaryOp::ReluBackward, BinaryOp::SigmoidBackward,
    BinaryOp::TanhBackward};

bool positive_domain(UnaryOp op) {
  return op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Reciprocal;
}

// Reference broadcast of two row-major value arrays to `out` (numpy rules).
std::vector<double> ref_broadcast(BinaryOp op, const std::vector<double>& a, const Shape& sa,
                                  const std::vector<double>& b, const Shape& sb, const Shape& out) {
  const size_t n = out.size();
  std::vector<double> r(static_cast<size_t>(shape_numel(out)));
  std::vector<int64_t> idx(n, 0);
  auto offset = [&](const Shape& s) {
    int64_t off = 0;
    const size_t lead = n - s.size();
    for (size_t d = lead; d < n; ++d) off = off * s[d - lead] + (s[d - lead] == 1 ? 0 : idx[d]);
    return off;
  };
  for (size_t i = 0; i < r.size(); ++i) {
    int64_t rem = static_cast<int64_t>(i);
    for (size_t d = n; d-- > 0;) {
      idx[d] = rem % out[d];
      rem /= out[d];
    }
    r[i] = ref_binary(op, a[offset(sa)], b[offset(sb)]);
  }
  return r;
}

}  // namespace

TEST_CASE("cpu unary ops match std math", "[kernels]") {
  for (DType dt : kFloatTypes) {
    for (UnaryOp op : kUnaryOps) {
      INFO(dtype_name(dt) << " unary op " << static_cast<int>(op));
      const bool pos = positive_domain(op);
      Tensor x = rnd({3, 5}, dt, pos ? 0.1 : -2.0, 2.0);
      std::vector<double> xv = values(x), want;
      for (double v : xv) want.push_back(ref_unary(op, v));
      require_close(kernels::unary(op, x), want, tol(dt));

      // A transposed (non-contiguous) input gives the transposed result.
      Tensor xt = x.transpose(0, 1);
      std::vector<double> want_t;
      for (int64_t j = 0; j < 5; ++j)
        for (int64_t i = 0; i < 3; ++i) want_t.push_back(ref_unary(op, xv[i * 5 + j]));
      Tensor yt = kernels::unary(op, xt);
      REQUIRE(yt.shape() == Shape{5, 3});
      require_close(yt, want_t, tol(dt));
    }
  }
}

TEST_CASE("cpu float32 exp is accurate over its whole range", "[kernels]") {
  std::vector<float> xs;
  for (double v = -110; v <= 90; v += 0.0137) xs.push_back(static_cast<float>(v));
  for (float v : {0.0f, -0.0f, 1e-8f, -1e-8f, 88.72f, 88.73f, -87.33f, -103.9f, -1e30f, 1e30f})
    xs.push_back(v);
  Tensor y = kernels::unary(UnaryOp::Exp, from_vector(xs, {static_cast<int64_t>(xs.size())}));
  const std::vector<float> got = y.to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double want = std::exp(static_cast<double>(xs[i]));
    INFO("exp(" << xs[i] << ") = " << got[i] << ", want " << want);
    if (want > 3.4028234e38) {
      REQUIRE(std::isinf(got[i]));
    } else if (want < 1.1754944e-38) {  // denormal results: absolute error of a few denormal steps
      REQUIRE(std::abs(got[i] - want) <= 4 * 1.4e-45);
    } else {
      REQUIRE(std::abs(got[i] - want) <= 3e-7 * want);
    }
  }
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const std::vector<float> special =
      kernels::unary(UnaryOp::Exp, from_vector<float>({inf, -inf, nan}, {3})).to_vector<float>();
  REQUIRE(std::isinf(special[0]));
  REQUIRE(special[1] == 0.0f);
  REQUIRE(std::isnan(special[2]));
}

TEST_CASE("cpu sigmoid saturates without NaN", "[kernels]") {
  Tensor x = from_vector<float>({-1000.f, -50.f, 0.f, 50.f, 1000.f}, {5});
  require_close(kernels::unary(UnaryOp::Sigmoid, x), {0.0, 1.9287e-22, 0.5, 1.0, 1.0}, 1e-6);
}

TEST_CASE("cpu binary ops with and without broadcasting", "[kernels]") {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{2, 3, 4}, {2, 3, 4}}, {{2, 3, 4}, {3, 1}}, {{2, 3, 4}, {4}}, {{1}, {2, 3}},
      {{2, 1, 4}, {3, 1}},    {{}, {2, 2}},        {{5, 1}, {1, 6}}};
  for (DType dt : kFloatTypes) {
    for (const auto& [sa, sb] : cases) {
      for (BinaryOp op : kBinaryOps) {
        INFO(dtype_name(dt) << " op " << static_cast<int>(op) << " " << shape_str(sa) << " with "
                            << shape_str(sb));
        Tensor a = rnd(sa, dt, -2, 2);
        Tensor b = op == BinaryOp::Div ? rnd(sb, dt, 0.5, 2) : rnd(sb, dt, -2, 2);
        const Shape out = kernels::broadcast_shapes(sa, sb);
        Tensor y = kernels::binary(op, a, b);
        REQUIRE(y.shape() == out);
        require_close(y, ref_broadcast(op, values(a), sa, values(b), sb, out), tol(dt));
      }
    }
  }
}

TEST_CASE("cpu binary ops on strided operands and in place", "[kernels]") {
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Tensor base = rnd({4, 6}, dt);
    Tensor a = base.transpose(0, 1).slice(0, 1, 5);            // [4, 4], strides (1, 6), offset 1
    Tensor b = rnd({4, 8}, dt).slice(1, 0, 8).slice(1, 2, 6);  // [4, 4], row stride 8
    std::vector<double> av = values(a), bv = values(b), want(16);
    for (size_t i = 0; i < 16; ++i) want[i] = av[i] * bv[i];
    require_close(kernels::binary(BinaryOp::Mul, a, b), want, tol(dt));

    // In place into a non-contiguous tensor, with a broadcast row vector.
    Tensor row = rnd({4}, dt);
    std::vector<double> rv = values(row), base_before = values(base);
    kernels::binary_(BinaryOp::Sub, a, row);
    std::vector<double> after = values(base);
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 6; ++j) {
        // a[r, c] = base[c, 1 + r]
        const double expect =
            j >= 1 && j <= 4 ? base_before[i * 6 + j] - rv[i] : base_before[i * 6 + j];
        REQUIRE(after[i * 6 + j] == Approx(expect).epsilon(tol(dt)));
      }
    REQUIRE_THROWS_AS(kernels::binary_(BinaryOp::Add, row, a), ShapeError);
  }
}

TEST_CASE("cpu scalar ops and axpby", "[kernels]") {
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Tensor x = rnd({2, 7}, dt, 0.2, 3.0);
    std::vector<double> xv = values(x);
    auto check = [&](ScalarOp op, double s, const std::function<double(double)>& f) {
      INFO("scalar op " << static_cast<int>(op) << " s=" << s);
      std::vector<double> want;
      for (double v : xv) want.push_back(f(v));
      require_close(kernels::scalar(op, x, s), want, tol(dt) * 4);
    };
    check(ScalarOp::Add, 1.5, [](double v) { return v + 1.5; });
    check(ScalarOp::Mul, -0.25, [](double v) { return v * -0.25; });
    check(ScalarOp::RSub, 2.0, [](double v) { return 2.0 - v; });
    check(ScalarOp::RDiv, 3.0, [](double v) { return 3.0 / v; });
    for (double e : {2.0, 3.0, 0.5, -1.0, 1.0, 1.7})
      check(ScalarOp::Pow, e, [e](double v) { return std::pow(v, e); });

    Tensor out = rnd({2, 7}, dt);
    std::vector<double> ov = values(out), want;
    for (size_t i = 0; i < ov.size(); ++i) want.push_back(0.5 * xv[i] - 2.0 * ov[i]);
    kernels::axpby_(0.5, x, -2.0, out);
    require_close(out, want, tol(dt));

    // beta = 0 ignores whatever out held, even NaN.
    out.fill_(std::nan(""));
    kernels::axpby_(3.0, x, 0.0, out);
    want.clear();
    for (double v : xv) want.push_back(3.0 * v);
    require_close(out, want, tol(dt));
  }
}

TEST_CASE("cpu fill and copy with strides and dtype conversion", "[kernels]") {
  Tensor t = zeros({3, 4}, kFloat64);
  t.slice(1, 1, 3).fill_(2.5);  // columns 1 and 2
  require_close(t, {0, 2.5, 2.5, 0, 0, 2.5, 2.5, 0, 0, 2.5, 2.5, 0}, 0);

  Tensor src = rnd({3, 4}, kFloat64, -10, 10);
  std::vector<double> sv = values(src);
  Tensor dst = empty({4, 3}, kFloat32);
  dst.copy_(src.transpose(0, 1));  // float64 strided -> float32 contiguous
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 3; ++j)
      REQUIRE(values(dst)[i * 3 + j] == Approx(static_cast<float>(sv[j * 4 + i])));

  Tensor ints = from_vector<int64_t>({-3, 0, 7, 255}, {4});
  require_close(ints.to(kFloat32), {-3, 0, 7, 255}, 0);
  require_close(from_vector<double>({1.9, -1.9, 3.0}, {3}).to(kInt64), {1, -1, 3}, 0);
  require_close(from_vector<int64_t>({1, 200, 255}, {3}).to(kUInt8), {1, 200, 255}, 0);

  // Broadcast source (zero strides).
  Tensor col = from_vector<float>({1, 2}, {2, 1});
  Tensor wide = empty({2, 3}, kFloat64);
  wide.copy_(col.expand({2, 3}));
  require_close(wide, {1, 1, 1, 2, 2, 2}, 0);
}

TEST_CASE("cpu integer elementwise ops", "[kernels]") {
  Tensor a = from_vector<int64_t>({1, -2, 3, 4}, {2, 2});
  Tensor b = from_vector<int64_t>({1, 5, -3, 4}, {2, 2});
  require_close(kernels::binary(BinaryOp::Add, a, b), {2, 3, 0, 8}, 0);
  require_close(kernels::binary(BinaryOp::Eq, a, b), {1, 0, 0, 1}, 0);
  require_close(kernels::binary(BinaryOp::Max, a, b), {1, 5, 3, 4}, 0);
  require_close(kernels::unary(UnaryOp::Neg, a), {-1, 2, -3, -4}, 0);
  require_close(kernels::unary(UnaryOp::Abs, a), {1, 2, 3, 4}, 0);
  require_close(kernels::scalar(ScalarOp::Mul, a, 3), {3, -6, 9, 12}, 0);
  REQUIRE_THROWS_AS(kernels::unary(UnaryOp::Exp, a), DTypeError);
  REQUIRE_THROWS_AS(kernels::binary(BinaryOp::Div, a, b), DTypeError);
  REQUIRE_THROWS_AS(kernels::scalar(ScalarOp::Add, a, 0.5), ValueError);
}

TEST_CASE("cpu maximum and minimum propagate NaN", "[kernels]") {
  const double nan = std::nan("");
  Tensor a = from_vector<double>({1, nan, 3}, {3});
  Tensor b = from_vector<double>({nan, 2, 1}, {3});
  require_close(kernels::binary(BinaryOp::Max, a, b), {nan, nan, 3}, 0);
  require_close(kernels::binary(BinaryOp::Min, a, b), {nan, nan, 1}, 0);
}

TEST_CASE("cpu strided loop merges contiguous dims", "[kernels]") {
  // A contiguous [2, 3, 4] walk is one run of 24; a transposed [4, 6] one is 4 runs of stride 4.
  Shape s{2, 3, 4};
  Strides c = contiguous_strides(s);
  int runs = 0;
  cpu::for_each_run<1>(
      s, {&c}, [&](const std::array<int64_t, 1>&, int64_t n, const std::array<int64_t, 1>& st) {
        ++runs;
        REQUIRE(n == 24);
        REQUIRE(st[0] == 1);
      });
  REQUIRE(runs == 1);
  Shape ts{4, 6};
  Strides tst{1, 4};
  runs = 0;
  cpu::for_each_run<1>(
      ts, {&tst},
      [&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& st) {
        REQUIRE(off[0] == runs);
        REQUIRE(n == 6);
        REQUIRE(st[0] == 4);
        ++runs;
      });
  REQUIRE(runs == 4);
}
