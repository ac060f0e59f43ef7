// CPU convolution (forward, backward input, backward weight) against direct loops, and
// max/avg pooling with stride != kernel and padding.
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "tests/kernels/test_cpu_util.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct ConvCase {
  Shape x, w;
  Conv2dParams p;
};

// Direct-loop convolution and its two adjoints, in float64.
struct ConvRef {
  std::vector<double> y, dx, dw, db;
};

ConvRef conv_ref(const std::vector<double>& x, const Shape& xs, const std::vector<double>& w,
                 const Shape& ws, const std::vector<double>& b, const std::vector<double>& dy,
                 const Shape& ys, const Conv2dParams& p) {
  ConvRef r;
  r.y.assign(static_cast<size_t>(shape_numel(ys)), 0.0);
  r.dx.assign(x.size(), 0.0);
  r.dw.assign(w.size(), 0.0);
  r.db.assign(static_cast<size_t>(ws[0]), 0.0);
  for (int64_t n = 0; n < xs[0]; ++n)
    for (int64_t k = 0; k < ws[0]; ++k)
      for (int64_t i = 0; i < ys[2]; ++i)
        for (int64_t j = 0; j < ys[3]; ++j) {
          const size_t yo = flat(ys, {n, k, i, j});
          double acc = b.empty() ? 0.0 : b[k];
          r.db[k] += dy[yo];
          for (int64_t c = 0; c < xs[1]; ++c)
            for (int64_t u = 0; u < ws[2]; ++u)
              for (int64_t v = 0; v < ws[3]; ++v) {
                const int64_t ih = i * p.stride_h - p.pad_h + u, iw = j * p.stride_w - p.pad_w + v;
                if (ih < 0 || ih >= xs[2] || iw < 0 || iw >= xs[3]) continue;
                const size_t xo = flat(xs, {n, c, ih, iw}), wo = flat(ws, {k, c, u, v});
                acc += x[xo] * w[wo];
                r.dx[xo] += dy[yo] * w[wo];
                r.dw[wo] += dy[yo] * x[xo];
              }
          r.y[yo] = acc;
        }
  return r;
}

void check_conv(const ConvCase& cc, DType dt, bool with_bias) {
  Tensor x = rnd(cc.x, dt), w = rnd(cc.w, dt);
  Tensor b = with_bias ? rnd({cc.w[0]}, dt) : Tensor();
  Tensor y = kernels::conv2d(x, w, b, cc.p);
  const Shape ys = y.shape();
  REQUIRE(ys == Shape{cc.x[0], cc.w[0], (cc.x[2] + 2 * cc.p.pad_h - cc.w[2]) / cc.p.stride_h + 1,
                      (cc.x[3] + 2 * cc.p.pad_w - cc.w[3]) / cc.p.stride_w + 1});
  Tensor dy = rnd(ys, dt);
  ConvRef r = conv_ref(values(x), cc.x, values(w), cc.w,
                       with_bias ? values(b) : std::vector<double>{}, values(dy), ys, cc.p);
  const double t = tol(dt) * 20;
  require_close(y, r.y, t);
  require_close(kernels::conv2d_backward_input(dy, w, cc.p, cc.x), r.dx, t);
  auto [dw, db] = kernels::conv2d_backward_weight(x, dy, cc.p, cc.w, with_bias);
  require_close(dw, r.dw, t);
  if (with_bias) {
    require_close(db, r.db, t);
  } else {
    REQUIRE_FALSE(db.defined());
  }
}

// Direct pooling; max windows skip padding, avg divides by the full window.
std::vector<double> pool_ref(PoolMode mode, const std::vector<double>& x, const Shape& xs,
                             const Shape& ys, const Pool2dParams& p, const std::vector<double>& dy,
                             std::vector<double>& dx) {
  std::vector<double> y(static_cast<size_t>(shape_numel(ys)));
  dx.assign(x.size(), 0.0);
  for (int64_t n = 0; n < xs[0]; ++n)
    for (int64_t c = 0; c < xs[1]; ++c)
      for (int64_t i = 0; i < ys[2]; ++i)
        for (int64_t j = 0; j < ys[3]; ++j) {
          double best = -std::numeric_limits<double>::infinity(), sum = 0;
          size_t arg = 0;
          for (int64_t u = 0; u < p.kernel_h; ++u)
            for (int64_t v = 0; v < p.kernel_w; ++v) {
              const int64_t ih = i * p.stride_h - p.pad_h + u, iw = j * p.stride_w - p.pad_w + v;
              if (ih < 0 || ih >= xs[2] || iw < 0 || iw >= xs[3]) continue;
              const size_t xo = flat(xs, {n, c, ih, iw});
              sum += x[xo];
              if (x[xo] > best) {
                best = x[xo];
                arg = xo;
              }
            }
          const size_t yo = flat(ys, {n, c, i, j});
          const double area = static_cast<double>(p.kernel_h * p.kernel_w);
          y[yo] = mode == PoolMode::Max ? best : sum / area;
          if (mode == PoolMode::Max) {
            dx[arg] += dy[yo];
            continue;
          }
          for (int64_t u = 0; u < p.kernel_h; ++u)
            for (int64_t v = 0; v < p.kernel_w; ++v) {
              const int64_t ih = i * p.stride_h - p.pad_h + u, iw = j * p.stride_w - p.pad_w + v;
              if (ih < 0 || ih >= xs[2] || iw < 0 || iw >= xs[3]) continue;
              dx[flat(xs, {n, c, ih, iw})] += dy[yo] / area;
            }
        }
  return y;
}

Pool2dParams pool_params(int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  Pool2dParams p;
  p.kernel_h = kh, p.kernel_w = kw, p.stride_h = sh, p.stride_w = sw, p.pad_h = ph, p.pad_w = pw;
  return p;
}

Conv2dParams conv_params(int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  Conv2dParams p;
  p.stride_h = sh, p.stride_w = sw, p.pad_h = ph, p.pad_w = pw;
  return p;
}

}  // namespace

TEST_CASE("cpu conv2d matches direct loops", "[kernels]") {
  const std::vector<ConvCase> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 2}, conv_params(1, 1, 0, 0)},
      {{2, 3, 7, 6}, {4, 3, 3, 2}, conv_params(2, 1, 1, 0)},
      {{3, 2, 8, 9}, {5, 2, 3, 3}, conv_params(2, 3, 2, 1)},
      {{1, 1, 5, 5}, {2, 1, 5, 5}, conv_params(1, 1, 2, 2)},  // LeNet's first layer, small
      {{2, 4, 4, 4}, {3, 4, 1, 1}, conv_params(1, 1, 0, 0)},
      {{2, 2, 3, 3}, {2, 2, 2, 2}, conv_params(3, 3, 1, 1)},  // stride > kernel
  };
  for (DType dt : kFloatTypes) {
    for (size_t i = 0; i < cases.size(); ++i) {
      for (bool bias : {true, false}) {
        INFO(dtype_name(dt) << " case " << i << " bias " << bias);
        check_conv(cases[i], dt, bias);
      }
    }
  }
}

TEST_CASE("cpu conv2d splits a large batch into chunks", "[kernels]") {
  // 9 * 1100 * 1100 column elements per image exceed the per-chunk bound: 3 chunks of 1 image.
  check_conv({{3, 1, 1100, 1100}, {2, 1, 3, 3}, conv_params(1, 1, 1, 1)}, kFloat64, true);
}

TEST_CASE("cpu conv2d on non-contiguous input", "[kernels]") {
  Tensor x = rnd({3, 2, 6, 6}, kFloat64).permute({1, 0, 2, 3});  // [2, 3, 6, 6] view
  Tensor w = rnd({4, 3, 3, 3}, kFloat64);
  Tensor ref = kernels::conv2d(x.contiguous(), w, Tensor(), {});
  require_close(kernels::conv2d(x, w, Tensor(), {}), values(ref), 0);
}

TEST_CASE("cpu conv2d argument errors", "[kernels]") {
  Tensor x = rnd({2, 3, 8, 8}, kFloat32), w = rnd({4, 3, 3, 3}, kFloat32);
  REQUIRE_THROWS_AS(kernels::conv2d(x, rnd({4, 2, 3, 3}, kFloat32), Tensor(), {}), ShapeError);
  REQUIRE_THROWS_AS(kernels::conv2d(x, w, rnd({5}, kFloat32), {}), ShapeError);
  REQUIRE_THROWS_AS(kernels::conv2d(rnd({3, 8, 8}, kFloat32), w, Tensor(), {}), ShapeError);
  REQUIRE_THROWS_AS(kernels::conv2d(x, rnd({4, 3, 9, 9}, kFloat32), Tensor(), {}), ShapeError);
  REQUIRE_THROWS_AS(kernels::conv2d(x, w, Tensor(), conv_params(0, 1, 0, 0)), ValueError);
  REQUIRE_THROWS_AS(kernels::conv2d(x, w.to(kFloat64), Tensor(), {}), DTypeError);
  REQUIRE_THROWS_AS(kernels::conv2d_backward_input(rnd({2, 4, 5, 5}, kFloat32), w, {}, x.shape()),
                    ShapeError);
  REQUIRE_THROWS_AS(
      kernels::conv2d_backward_weight(x, rnd({2, 4, 5, 5}, kFloat32), {}, w.shape(), true),
      ShapeError);
}

TEST_CASE("cpu max and avg pooling with stride and padding", "[kernels]") {
  const std::vector<std::pair<Shape, Pool2dParams>> cases = {
      {{2, 3, 8, 8}, pool_params(2, 2, 2, 2, 0, 0)},
      {{2, 3, 7, 8}, pool_params(3, 3, 2, 2, 1, 1)},
      {{1, 2, 6, 7}, pool_params(3, 2, 1, 2, 1, 0)},
      {{2, 1, 9, 9}, pool_params(2, 2, 3, 3, 0, 0)},
      {{1, 2, 5, 5}, pool_params(4, 4, 1, 1, 2, 2)},
      // Tiling windows (stride = kernel, no padding) that leave rows and columns uncovered.
      {{2, 2, 7, 9}, pool_params(2, 2, 2, 2, 0, 0)},
      {{1, 3, 8, 5}, pool_params(3, 2, 3, 2, 0, 0)}};
  for (DType dt : kFloatTypes) {
    for (PoolMode mode : {PoolMode::Max, PoolMode::Avg}) {
      for (size_t i = 0; i < cases.size(); ++i) {
        INFO(dtype_name(dt) << (mode == PoolMode::Max ? " max" : " avg") << " case " << i);
        const auto& [xs, p] = cases[i];
        // Integer-valued inputs create ties, so max routing to the *first* maximum is tested.
        std::vector<double> xv = values(rnd(xs, kFloat64, 0, 4));
        for (double& v : xv) v = std::floor(v);
        Tensor x = from_vector(xv, xs).to(dt);
        Tensor y = kernels::pool2d(mode, x, p);
        Tensor dy = rnd(y.shape(), dt);
        std::vector<double> dx_ref;
        std::vector<double> y_ref = pool_ref(mode, xv, xs, y.shape(), p, values(dy), dx_ref);
        require_close(y, y_ref, tol(dt));
        require_close(kernels::pool2d_backward(mode, x, y, dy, p), dx_ref, tol(dt) * 4);
      }
    }
  }
}

TEST_CASE("cpu pooling argument errors", "[kernels]") {
  Tensor x = rnd({1, 1, 4, 4}, kFloat32);
  REQUIRE_THROWS_AS(kernels::pool2d(PoolMode::Max, x, pool_params(3, 3, 1, 1, 2, 2)), ValueError);
  REQUIRE_THROWS_AS(kernels::pool2d(PoolMode::Avg, x, pool_params(5, 5, 1, 1, 0, 0)), ShapeError);
  REQUIRE_THROWS_AS(kernels::pool2d(PoolMode::Avg, x, pool_params(2, 2, 0, 1, 0, 0)), ValueError);
  REQUIRE_THROWS_AS(kernels::pool2d(PoolMode::Max, rnd({4, 4}, kFloat32), {}), ShapeError);
  Tensor y = kernels::pool2d(PoolMode::Max, x, {});
  REQUIRE_THROWS_AS(kernels::pool2d_backward(PoolMode::Max, x, y, rnd({1, 1, 3, 3}, kFloat32), {}),
                    ShapeError);
}

TEST_CASE("row_conv_passes: letters f, d, w or -, bad values refused", "[kernels]") {
  const std::string prev = row_conv_passes();
  if (std::getenv("TANDEM_ROW_CONV") == nullptr) CHECK(prev == "dw");  // the default
  set_row_conv_passes("wfd");
  CHECK(row_conv_passes() == "fdw");
  set_row_conv_passes("-");
  CHECK(row_conv_passes() == "-");
  CHECK_THROWS_AS(set_row_conv_passes("fx"), ValueError);
  CHECK_THROWS_AS(set_row_conv_passes(""), ValueError);
  CHECK(row_conv_passes() == "-");  // a refused value changes nothing
  set_row_conv_passes(prev);
  CHECK(row_conv_passes() == prev);
}

TEST_CASE("direct_wgrad_shape: defaults, a set shape, bad values refused", "[kernels]") {
  CHECK(direct_wgrad_shape().images_per_block == 0);
  CHECK(direct_wgrad_shape().threads == 0);
  set_direct_wgrad_shape({3, 512});
  CHECK(direct_wgrad_shape().images_per_block == 3);
  CHECK(direct_wgrad_shape().threads == 512);
  CHECK_THROWS_AS(set_direct_wgrad_shape({-1, 0}), ValueError);
  CHECK_THROWS_AS(set_direct_wgrad_shape({1, 2048}), ValueError);
  CHECK(direct_wgrad_shape().images_per_block == 3);  // a refused value changes nothing
  set_direct_wgrad_shape({});
  CHECK(direct_wgrad_shape().threads == 0);
}
