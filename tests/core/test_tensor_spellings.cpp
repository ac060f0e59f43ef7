// libtorch's spellings of tensor operations, each checked against the function it stands for:
// item<T>, sizes, the reduction methods, comparisons, softmax / log_softmax over a dim, the
// tensor() / from_vector() factories deducing their type, and operator<<.
#include <cmath>
#include <limits>
#include <sstream>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "kernels/ops.h"

using namespace tandem;
using tandem::test::have_cuda;
using tandem::test::values;

namespace {

std::string printed(const Tensor& t) {
  std::ostringstream s;
  s << t;
  return s.str();
}

// The devices a test runs on: the CPU, and cuda:0 when there is a GPU.
std::vector<Device> devices() { return tandem::test::test_devices(); }

}  // namespace

TEST_CASE("item<T> reads the one element as T", "[core][spellings]") {
  const Tensor f = full({1}, 2.75);
  CHECK(f.item<float>() == 2.75f);
  CHECK(f.item<double>() == f.item());
  CHECK(f.item<int>() == 2);
  CHECK(f.item<bool>());
  // int64 is read exactly, where item()'s double would round.
  const int64_t big = (int64_t{1} << 60) + 1;
  const Tensor i = from_vector<int64_t>({big}, {});
  CHECK(i.item<int64_t>() == big);
  CHECK(static_cast<int64_t>(i.item()) != big);
  CHECK_THROWS_AS(zeros({2}).item<float>(), ShapeError);
  CHECK(zeros({2, 3}).sizes() == Shape{2, 3});
}

TEST_CASE("sum and mean methods are the free functions with dims", "[core][spellings]") {
  const Tensor x = randn({3, 4, 5});
  CHECK(values(x.sum()) == values(sum(x)));
  CHECK(values(x.sum(1)) == values(sum(x, {1})));
  CHECK(x.sum(1).shape() == Shape{3, 5});
  CHECK(x.sum(-1, true).shape() == Shape{3, 4, 1});
  CHECK(values(x.sum({0, 2})) == values(sum(x, {0, 2})));
  CHECK(values(x.mean(2)) == values(mean(x, {2})));
  CHECK(values(x.mean()) == values(mean(x)));
  CHECK_THROWS_AS(x.sum(3), ShapeError);
  // PyTorch sums integers in int64: 300 ones of uint8 are 300, not 300 mod 256.
  const Tensor ones8 = ones({300}, kUInt8);
  CHECK(ones8.sum().dtype() == kInt64);
  CHECK(ones8.sum().item<int64_t>() == 300);
  CHECK_THROWS_AS(ones({3}, kInt64).mean(), DTypeError);
  // Differentiable as sum() is.
  Tensor w = randn({2, 3}).set_requires_grad();
  w.sum(1).sum().backward();
  CHECK(values(w.grad()) == std::vector<double>(6, 1.0));
}

TEST_CASE("max and min with a dim return values and indices", "[core][spellings]") {
  for (Device d : devices()) {
    SECTION(d.str()) {
      // Rows 0 and 2 have ties (5 twice, 3 twice): the first index is returned, as PyTorch's CPU does.
      const Tensor x = from_vector<float>({1, 5, 5, -2, 7, 0, 3, 3, -4}, {3, 3}, d);
      auto [mx, imx] = x.max(1);
      CHECK(values(mx) == values(kernels::max(x, {1})));
      CHECK(imx.dtype() == kInt64);
      CHECK(values(imx) == std::vector<double>{1, 1, 0});
      CHECK(values(imx) == values(kernels::argmax(x, 1)));
      auto [mn, imn] = x.min(1);
      CHECK(values(mn) == std::vector<double>{1, -2, -4});
      CHECK(values(imn) == std::vector<double>{0, 0, 2});
      auto [mk, ik] = x.max(0, true);
      CHECK(mk.shape() == Shape{1, 3});
      CHECK(ik.shape() == Shape{1, 3});
      CHECK(values(mk) == std::vector<double>{3, 7, 5});
      CHECK(values(ik) == std::vector<double>{2, 1, 0});
      CHECK(x.max().dim() == 0);
      CHECK(x.max().item<float>() == 7);
      CHECK(x.min().item<float>() == -4);
      CHECK(x.argmax().item<int64_t>() == 4);
      CHECK(x.argmin().item<int64_t>() == 8);
      CHECK(values(x.argmax(0)) == std::vector<double>{2, 1, 0});
      CHECK(values(x.argmin(-1)) == std::vector<double>{0, 0, 2});
      CHECK(x.argmin(1, true).shape() == Shape{3, 1});
      // Integers too: uint8 and int64 compare as numbers.
      const Tensor u = from_vector<uint8_t>({3, 250, 0, 9}, {4}, d);
      CHECK(u.argmax().item<int64_t>() == 1);
      CHECK(u.argmin().item<int64_t>() == 2);
      CHECK(u.min().item<int64_t>() == 0);
      CHECK(u.min().dtype() == kUInt8);
      CHECK_THROWS_AS(x.max(2), ShapeError);
    }
  }
}

TEST_CASE("min's gradient reaches the first minimum", "[core][spellings]") {
  Tensor x = from_vector<double>({3, 1, 1, 2, 0, 5}, {2, 3}).set_requires_grad();
  std::get<0>(x.min(1)).sum().backward();
  CHECK(values(x.grad()) == std::vector<double>{0, 1, 0, 0, 1, 0});
  Tensor y = from_vector<double>({3, 1, 1}, {3}).set_requires_grad();
  y.min().backward();
  CHECK(values(y.grad()) == std::vector<double>{0, 1, 0});
}

TEST_CASE("comparisons give uint8 masks that convert", "[core][spellings]") {
  for (Device d : devices()) {
    SECTION(d.str()) {
      const Tensor a = from_vector<float>({1, 2, 3}, {3}, d);
      const Tensor b = from_vector<float>({3, 2, 1}, {3}, d);
      CHECK((a == b).dtype() == kUInt8);
      CHECK(values(a == b) == std::vector<double>{0, 1, 0});
      CHECK(values(a != b) == std::vector<double>{1, 0, 1});
      CHECK(values(a < b) == std::vector<double>{1, 0, 0});
      CHECK(values(a <= b) == std::vector<double>{1, 1, 0});
      CHECK(values(a > b) == std::vector<double>{0, 0, 1});
      CHECK(values(a >= b) == std::vector<double>{0, 1, 1});
      // eq is the elementwise Eq kernel's answer, as a mask.
      CHECK(values(a == b) == values(kernels::binary(BinaryOp::Eq, a, b)));
      // Scalars, either side.
      CHECK(values(a > 1.5) == std::vector<double>{0, 1, 1});
      CHECK(values(2.0 <= a) == std::vector<double>{0, 1, 1});
      CHECK(values(a == 3) == std::vector<double>{0, 0, 1});
      // Broadcasting [3, 1] against [3].
      const Tensor col = from_vector<float>({1, 2, 3}, {3, 1}, d);
      CHECK((col < b).shape() == Shape{3, 3});
      CHECK(values(col < b) == std::vector<double>{1, 1, 0, 1, 0, 0, 0, 0, 0});
      // Conversions, and counting.
      CHECK((a >= b).to(kInt64).dtype() == kInt64);
      CHECK(values((a >= b).to(kFloat32)) == std::vector<double>{0, 1, 1});
      CHECK((a >= b).sum().item<int64_t>() == 2);
      // Mixed dtypes compare in the wider one; an integer tensor against 1.5 in float64.
      const Tensor labels = from_vector<int64_t>({0, 1, 2}, {3}, d);
      const Tensor pred = from_vector<float>({0, 1, 1}, {3}, d);
      CHECK(values(labels == pred) == std::vector<double>{1, 1, 0});
      CHECK(values(labels > 1.5) == std::vector<double>{0, 0, 1});
      // NaN is false everywhere but !=.
      const float nan = std::numeric_limits<float>::quiet_NaN();
      const Tensor n = from_vector<float>({nan, 1}, {2}, d);
      const Tensor one = from_vector<float>({1, nan}, {2}, d);
      for (const Tensor& m : {n == one, n < one, n <= one, n > one, n >= one}) {
        CHECK(values(m) == std::vector<double>{0, 0});
      }
      CHECK(values(n != one) == std::vector<double>{1, 1});
      CHECK(values(n == n) == std::vector<double>{0, 1});
      CHECK_THROWS_AS(a == from_vector<float>({1, 2}, {2}, d), ShapeError);
    }
  }
}

TEST_CASE("softmax and log_softmax over a dim", "[core][spellings]") {
  const Tensor x = randn({4, 5}, kFloat64);
  CHECK(test::rel_error(log_softmax(x, 1), log_softmax(x)) == 0);
  CHECK(test::rel_error(log_softmax(x, -1), log_softmax(x)) == 0);
  CHECK(test::rel_error(softmax(x, 1), exp(log_softmax(x))) == 0);
  // Over dim 0: the same as over dim 1 of the transpose.
  CHECK(test::rel_error(softmax(x, 0), transpose(softmax(transpose(x, 0, 1), 1), 0, 1)) < 1e-15);
  // 1-D and 3-D, against the definition.
  const Tensor v = from_vector<double>({1, 2, 3}, {3});
  const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  const auto sv = values(softmax(v, 0));
  CHECK(std::abs(sv[2] - std::exp(3.0) / z) < 1e-12);
  const Tensor x3 = randn({2, 3, 4}, kFloat64);
  const auto s3 = values(softmax(x3, 1));
  const auto e3 = values(x3);
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t k = 0; k < 4; ++k) {
      double total = 0;
      for (int64_t j = 0; j < 3; ++j) total += std::exp(e3[(i * 3 + j) * 4 + k]);
      CHECK(std::abs(s3[(i * 3 + 1) * 4 + k] - std::exp(e3[(i * 3 + 1) * 4 + k]) / total) < 1e-12);
    }
  }
  const auto r = autograd::gradcheck(
      [](const std::vector<Tensor>& in) { return log_softmax(in[0], 1); },
      {randn({2, 3, 4}, kFloat64).set_requires_grad()});
  CHECK(r.ok);
  CHECK_THROWS_AS(softmax(x, 2), ShapeError);
}

TEST_CASE("tensor() and from_vector() deduce the type from the list", "[core][spellings]") {
  CHECK(tensor({1.0f, 2.0f}).dtype() == kFloat32);
  CHECK(tensor({1.0, 2.0}).dtype() == kFloat32);  // libtorch's default dtype
  CHECK(tensor({1.0, 2.0}, kFloat64).dtype() == kFloat64);
  CHECK(tensor({1, 2, 3}).dtype() == kInt64);
  CHECK(values(tensor({1.5f, 2.0f})) == std::vector<double>{1.5, 2.0});
  const Tensor m = tensor({{1.0f, 2.0f, 3.0f}, {4.0f, 5.0f, 6.0f}});
  CHECK(m.shape() == Shape{2, 3});
  CHECK(values(m) == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK_THROWS_AS(tensor({{1.0f, 2.0f}, {3.0f}}), ShapeError);
  CHECK(from_vector({1.0f, 2.0f}, {2}).dtype() == kFloat32);
  CHECK(from_vector({1.0, 2.0}, {2, 1}).dtype() == kFloat64);
  CHECK(from_vector({1, 2}, {2}).dtype() == kInt64);
  CHECK(values(from_vector({1.0f, 2.0f, 3.0f, 4.0f}, {2, 2})) ==
        values(from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2})));
  CHECK_THROWS_AS(from_vector({1.0f, 2.0f}, {3}), ShapeError);
}

TEST_CASE("operator<< prints tensors as PyTorch does", "[core][spellings]") {
  CHECK(printed(tensor({1.0f, 2.0f})) == "tensor([1., 2.])");
  CHECK(printed(tensor({{1.5f, 2.0f}, {3.0f, 4.0f}})) ==
        "tensor([[1.5000, 2.0000],\n"
        "        [3.0000, 4.0000]])");
  CHECK(printed(tensor({-1.0f, 0.25f})) == "tensor([-1.0000,  0.2500])");
  CHECK(printed(arange(0, 5)) == "tensor([0, 1, 2, 3, 4])");
  CHECK(printed(tensor({1.0, 2.0}, kFloat64)) == "tensor([1., 2.], dtype=torch.float64)");
  CHECK(printed(tensor({1.0f, 2.0f}) < 1.5) == "tensor([1, 0], dtype=torch.uint8)");
  CHECK(printed(full({}, 3.5)) == "tensor(3.5000)");
  CHECK(printed(tensor({1e-5f, 1.0f})) == "tensor([1.0000e-05, 1.0000e+00])");
  CHECK(printed(zeros({2})) == "tensor([0., 0.])");
  CHECK(printed(zeros({0, 3})) == "tensor([], size=(0, 3))");
  CHECK(printed(ones({2}).set_requires_grad()) == "tensor([1., 1.], requires_grad=True)");
  CHECK(printed(Tensor()) == "[ Tensor (undefined) ]");
  // Lines wrap at 80 columns (14 items of width 3).
  CHECK(printed(arange(0, 30, 1, kFloat32)) ==
        "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n"
        "        14., 15., 16., 17., 18., 19., 20., 21., 22., 23., 24., 25., 26., 27.,\n"
        "        28., 29.])");
  // More than 1000 elements: 3 edge items per dim.
  CHECK(printed(arange(0, 2000)) == "tensor([   0,    1,    2,  ..., 1997, 1998, 1999])");
  CHECK(printed(arange(0, 1200).reshape({40, 30})) ==
        "tensor([[   0,    1,    2,  ...,   27,   28,   29],\n"
        "        [  30,   31,   32,  ...,   57,   58,   59],\n"
        "        [  60,   61,   62,  ...,   87,   88,   89],\n"
        "        ...,\n"
        "        [1110, 1111, 1112,  ..., 1137, 1138, 1139],\n"
        "        [1140, 1141, 1142,  ..., 1167, 1168, 1169],\n"
        "        [1170, 1171, 1172,  ..., 1197, 1198, 1199]])");
  if (have_cuda()) {
    CHECK(printed(tensor({1.0f, 2.0f}, Device::cuda(0))) == "tensor([1., 2.], device='cuda:0')");
  }
}
