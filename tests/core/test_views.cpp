// Views and strides: slicing, select, transpose/permute, expand, unsqueeze/squeeze, view and
// reshape, contiguous(), offsets into a shared storage, and contiguous_span / split_views.
#include <numeric>

#include "catch.h"
#include "core/error.h"
#include "core/tensor.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

// 0, 1, ..., numel-1 as float64, contiguous.
Tensor iota(const Shape& shape) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.0);
  return from_vector(v, shape);
}

// The value of t at a multi-index, read through strides and offset by hand.
double at(const Tensor& t, const std::vector<int64_t>& idx) {
  int64_t pos = t.offset();
  for (size_t d = 0; d < idx.size(); ++d) pos += idx[d] * t.stride(static_cast<int64_t>(d));
  return static_cast<const double*>(t.storage()->data())[pos];
}

}  // namespace

TEST_CASE("a contiguous tensor has row-major strides and offset 0", "[core]") {
  Tensor t = iota({2, 3, 4});
  CHECK(t.strides() == Strides{12, 4, 1});
  CHECK(t.offset() == 0);
  CHECK(t.is_contiguous());
  CHECK(contiguous_strides({5, 0, 2}) == Strides{2, 2, 1});  // size-0 dims count as 1
  CHECK(contiguous_strides({}).empty());
}

TEST_CASE("slice and select share storage and move the offset", "[core]") {
  Tensor t = iota({4, 5});
  Tensor rows = t.slice(0, 1, 3);
  CHECK(rows.shape() == Shape{2, 5});
  CHECK(rows.offset() == 5);
  CHECK(rows.strides() == t.strides());
  CHECK(rows.storage() == t.storage());
  CHECK(rows.is_contiguous());
  CHECK(values(rows) == std::vector<double>{5, 6, 7, 8, 9, 10, 11, 12, 13, 14});

  Tensor cols = t.slice(1, 2, 4);  // [4, 2], offset 2, not contiguous
  CHECK(cols.offset() == 2);
  CHECK_FALSE(cols.is_contiguous());
  CHECK(values(cols) == std::vector<double>{2, 3, 7, 8, 12, 13, 17, 18});

  Tensor both = t.slice(0, 1, 3).slice(-1, 1, 2);  // offsets add up; negative dim counts from the end
  CHECK(both.offset() == 6);
  CHECK(values(both) == std::vector<double>{6, 11});

  Tensor row = t.select(0, -1);
  CHECK(row.shape() == Shape{5});
  CHECK(row.offset() == 15);
  Tensor col = t.select(1, 3);
  CHECK(col.strides() == Strides{5});
  CHECK(values(col) == std::vector<double>{3, 8, 13, 18});

  CHECK(t.slice(0, 2, 2).numel() == 0);
  // Writes through a view land in the base tensor.
  cols.fill_(-1.0);
  CHECK(at(t, {3, 3}) == -1.0);
  CHECK(at(t, {3, 4}) == 19.0);
}

TEST_CASE("transpose and permute swap strides without copying", "[core]") {
  Tensor t = iota({2, 3, 4});
  Tensor tt = t.transpose(0, 2);
  CHECK(tt.shape() == Shape{4, 3, 2});
  CHECK(tt.strides() == Strides{1, 4, 12});
  CHECK(tt.storage() == t.storage());
  CHECK_FALSE(tt.is_contiguous());
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 4; ++k) CHECK(at(tt, {k, j, i}) == at(t, {i, j, k}));

  Tensor p = t.permute({1, 2, 0});
  CHECK(p.shape() == Shape{3, 4, 2});
  CHECK(p.strides() == Strides{4, 1, 12});
  CHECK(at(p, {2, 1, 1}) == at(t, {1, 2, 1}));
  CHECK(t.permute({-3, -2, -1}).strides() == t.strides());
  // Transposing twice is the identity.
  CHECK(t.transpose(1, 2).transpose(1, 2).is_contiguous());
}

TEST_CASE("contiguous copies only when needed and keeps the values", "[core]") {
  Tensor t = iota({3, 4});
  CHECK(t.contiguous().same(t));
  Tensor row = t.slice(0, 1, 2);  // contiguous although offset
  CHECK(row.contiguous().same(row));

  Tensor tt = t.transpose(0, 1);  // [4, 3]
  Tensor c = tt.contiguous();
  CHECK(c.storage() != t.storage());
  CHECK(c.is_contiguous());
  CHECK(c.offset() == 0);
  CHECK(c.strides() == Strides{3, 1});
  CHECK(values(c) == std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});

  Tensor sliced = iota({4, 6}).slice(1, 1, 5).slice(0, 2, 4);  // offset 13, strides [6, 1]
  Tensor sc = sliced.contiguous();
  CHECK(sc.offset() == 0);
  CHECK(values(sc) == std::vector<double>{13, 14, 15, 16, 19, 20, 21, 22});
  // A size-1 dim with any stride is still contiguous.
  CHECK(iota({3, 1}).transpose(0, 1).is_contiguous());
}

TEST_CASE("expand, unsqueeze, squeeze, view and reshape", "[core]") {
  Tensor v = iota({3});
  Tensor e = v.expand({2, 3});
  CHECK(e.strides() == Strides{0, 1});
  CHECK(values(e) == std::vector<double>{0, 1, 2, 0, 1, 2});
  Tensor u = v.unsqueeze(1);
  CHECK(u.shape() == Shape{3, 1});
  CHECK(values(u.expand({3, 2})) == std::vector<double>{0, 0, 1, 1, 2, 2});
  CHECK(u.squeeze(1).shape() == Shape{3});
  CHECK(v.unsqueeze(-1).shape() == Shape{3, 1});

  Tensor t = iota({2, 6});
  CHECK(t.view({3, -1}).shape() == Shape{3, 4});
  CHECK(t.view({3, 4}).storage() == t.storage());
  CHECK(t.slice(0, 1, 2).view({2, 3}).offset() == 6);
  Tensor r = t.transpose(0, 1).reshape({12});  // not a view: copies
  CHECK(r.storage() != t.storage());
  CHECK(values(r) == std::vector<double>{0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11});
  CHECK(t.flatten().shape() == Shape{12});
}

TEST_CASE("bad view arguments name the dim, range and shape", "[core]") {
  Tensor t = iota({2, 3});
  CHECK(contains(error_message<ShapeError>([&] { t.slice(1, 2, 4); }), "[2, 4) out of range for dim 1 of size 3"));
  CHECK(contains(error_message<ShapeError>([&] { t.slice(2, 0, 1); }), "slice: dim 2 out of range for a 2-d tensor"));
  CHECK(contains(error_message<ShapeError>([&] { t.select(0, 2); }), "index 2 out of range for dim 0 of size 2"));
  CHECK(contains(error_message<ShapeError>([&] { t.transpose(0, -3); }), "transpose: dim -3"));
  CHECK(contains(error_message<ShapeError>([&] { t.permute({0}); }), "1 dims given for a 2-d tensor"));
  CHECK(contains(error_message<ShapeError>([&] { t.permute({1, 1}); }), "dim 1 repeated"));
  CHECK(contains(error_message<ShapeError>([&] { t.expand({2, 4}); }), "cannot expand [2,3] to [2,4]"));
  CHECK(contains(error_message<ShapeError>([&] { t.squeeze(0); }), "dim 0 of [2,3] is not 1"));
  CHECK(contains(error_message<ShapeError>([&] { t.transpose(0, 1).view({6}); }), "not contiguous"));
  CHECK(contains(error_message<ShapeError>([&] { t.view({4, -1}); }), "cannot view [2,3] as [4,-1]"));
  CHECK(contains(error_message<ShapeError>([&] { t.view({-1, -1}); }), "only one dimension can be -1"));
  CHECK(contains(error_message<ValueError>([&] { Tensor().slice(0, 0, 1); }), "undefined tensor"));
}

TEST_CASE("contiguous_span covers back-to-back views of one storage, in order", "[core]") {
  Tensor flat = iota({25});
  const std::vector<Tensor> like = {zeros({3, 4}), zeros({5}), zeros({2, 2, 2})};
  std::vector<Tensor> views = split_views(flat, like);
  REQUIRE(views.size() == 3);
  CHECK(views[1].shape() == Shape{5});
  CHECK(views[1].offset() == 12);
  CHECK(views[2].shape() == Shape{2, 2, 2});
  CHECK(values(views[2]).front() == 17.0);
  const Tensor &a = views[0], &b = views[1], &c = views[2];

  Tensor span = contiguous_span({a, b, c});
  REQUIRE(span.defined());
  CHECK(span.numel() == 25);
  CHECK(span.storage() == flat.storage());
  Tensor bc = contiguous_span({b, c});
  CHECK(bc.numel() == 13);
  CHECK(bc.offset() == 12);
  CHECK_FALSE(contiguous_span({a, c}).defined());  // a gap
  CHECK_FALSE(contiguous_span({b, a}).defined());  // out of order
  CHECK_FALSE(contiguous_span({}).defined());
  CHECK_FALSE(contiguous_span({a, iota({5})}).defined());      // another storage
  CHECK_FALSE(contiguous_span({flat.slice(0, 0, 10).view({5, 2}).slice(1, 0, 1)}).defined());  // strided
  // Dense in another order (a transpose, channels-last) still covers one range.
  const Tensor t = flat.slice(0, 0, 10).view({2, 5}).transpose(0, 1);
  CHECK(contiguous_span({t}).numel() == 10);
  CHECK_FALSE(same_layout(t, zeros({5, 2})));
  CHECK(same_layout(t, zeros({2, 5}).transpose(0, 1)));
  CHECK(same_layout(zeros({3, 1, 2}), zeros({3, 2}).unsqueeze(1)));  // size-1 strides do not matter
  CHECK_FALSE(same_layout(zeros({3, 2}), zeros({2, 3})));

  CHECK(contains(error_message<ShapeError>([&] { split_views(iota({24}), like); }), "25 elements"));
}
