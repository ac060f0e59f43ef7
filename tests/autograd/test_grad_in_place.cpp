// Note [gradients written in place] (autograd/node.h): after FlatBuffer::zero_(), the
// backward functions of linear and conv2d write their parameters' gradients straight into the
// buffer. The gradients must be those of the usual way (written apart, then added) bit for bit,
// in every case the add covered: a parameter used twice, two backwards into one zeroing, a tensor
// hook that replaces the gradient, a gradient set by hand after the zeroing.
#include <memory>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/function.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "parallel/flat_buffer.h"

using namespace tandem;
using tandem::test::values;

namespace {

struct Params {
  Tensor w1, b1, w2, b2, cw, cb;
  std::vector<Tensor> all() const { return {w1, b1, w2, b2, cw, cb}; }
};

Tensor leaf(const Shape& shape, Device d, uint64_t seed) {
  Generator gen(seed);
  Tensor t = uniform(shape, -0.5, 0.5, kFloat64, kCPU, &gen).to(d);
  t.set_requires_grad();
  return t;
}

// Fresh leaves with the same values on every call (seeded).
Params make_params(Device d) {
  return {leaf({3, 4}, d, 1), leaf({3}, d, 2), leaf({2, 3}, d, 3), leaf({2}, d, 4),
          leaf({2, 1, 3, 3}, d, 5), leaf({2}, d, 6)};
}

// A small network of both kinds of layer: conv2d, its output as rows of 4, two linear layers.
Tensor loss_of(const Params& p, Device d) {
  Generator gen(7);
  const Tensor img = uniform({2, 1, 4, 4}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d);
  const Tensor c = conv2d(img, p.cw, p.cb, {1, 1, 1, 1});           // [2, 2, 4, 4]
  const Tensor x = reshape(c, {16, 4});                              // [16, 4]
  const Tensor h = linear_activation(x, p.w1, p.b1, Activation::Sigmoid);  // [16, 3]
  const Tensor y = linear(h, p.w2, p.b2);                            // [16, 2]
  return sum(mul(y, y));
}

std::vector<std::vector<double>> grads_of(const Params& p) {
  std::vector<std::vector<double>> out;
  for (const Tensor& t : p.all()) out.push_back(values(t.grad()));
  return out;
}

// Attaches and zeroes fb and hooks `param`, fb's k-th tensor: the flag it returns says whether
// the gradient that reached param's accumulator was fb's own view, written in place.
std::shared_ptr<bool> zero_and_watch(parallel::FlatBuffer& fb, const Tensor& param, size_t k) {
  fb.attach();
  fb.zero_();
  auto lent = std::make_shared<bool>(false);
  param.register_hook([lent, view = fb.views()[k]](const Tensor& g) {
    *lent = g.raw_data() == view.raw_data();
    return Tensor();
  });
  return lent;
}

}  // namespace

TEST_CASE("gradients written into a zeroed FlatBuffer equal the gradients added to it", "[autograd][grad_in_place]") {
  for (Device d : test::test_devices()) {
    INFO(d.str());
    // The usual way: each gradient written apart, then copied into the fresh .grad.
    const Params ref = make_params(d);
    loss_of(ref, d).backward();

    const Params p = make_params(d);
    parallel::FlatBuffer fb(p.all());
    // The weight's gradient reaches its accumulator as the buffer's own view: written in place.
    const std::shared_ptr<bool> lent = zero_and_watch(fb, p.w1, 0);
    loss_of(p, d).backward();
    CHECK(*lent);
    CHECK(grads_of(p) == grads_of(ref));
    for (size_t k = 0; k < p.all().size(); ++k) CHECK(p.all()[k].grad().same(fb.views()[k]));

    // Two backwards into one zeroing: the second adds, as without the buffer.
    const Params ref2 = make_params(d);
    loss_of(ref2, d).backward();
    loss_of(ref2, d).backward();
    loss_of(p, d).backward();
    CHECK(grads_of(p) == grads_of(ref2));

    // A new zeroing lends again, and the result is again one backward's.
    fb.zero_();
    *lent = false;
    loss_of(p, d).backward();
    CHECK(*lent);
    CHECK(grads_of(p) == grads_of(ref));
  }
}

TEST_CASE("an autocast weight's gradient is cast straight into a zeroed FlatBuffer", "[autograd][grad_in_place][bf16]") {
  for (Device d : test::test_devices()) {
    INFO(d.str());
    const auto leaf32 = [&](const Shape& shape, uint64_t seed) {
      Generator gen(seed);
      Tensor t = uniform(shape, -0.5, 0.5, kFloat32, kCPU, &gen).to(d);
      t.set_requires_grad();
      return t;
    };
    // Under autocast the float32 weights are cast to bfloat16 for the conv and the linear layer;
    // their bfloat16 gradients are cast back by the conversion's backward.
    const auto loss = [&](const Tensor& cw, const Tensor& w) {
      AutocastGuard autocast(kBFloat16);
      Generator gen(17);
      const Tensor img = uniform({2, 1, 4, 4}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d);
      const Tensor c = conv2d(img, cw, Tensor(), {1, 1, 1, 1});  // [2, 2, 4, 4] bfloat16
      const Tensor y = linear(reshape(c, {16, 4}), w, Tensor());  // [16, 3]
      return sum(mul(y, y));
    };
    const Tensor rcw = leaf32({2, 1, 3, 3}, 5), rw = leaf32({3, 4}, 1);
    loss(rcw, rw).backward();
    const Tensor cw = leaf32({2, 1, 3, 3}, 5), w = leaf32({3, 4}, 1);
    parallel::FlatBuffer fb({cw, w});
    const std::shared_ptr<bool> lent = zero_and_watch(fb, cw, 0);
    loss(cw, w).backward();
    CHECK(*lent);
    REQUIRE(cw.grad().dtype() == kFloat32);
    CHECK(values(cw.grad()) == values(rcw.grad()));
    CHECK(values(w.grad()) == values(rw.grad()));
    CHECK(w.grad().same(fb.views()[1]));
    // Without the zeroing the conversion's gradient is added, as before.
    loss(cw, w).backward();
    CHECK(test::rel_error(cw.grad(), rcw.grad() * 2.0) == 0.0);
  }
}

TEST_CASE("a channels-last autocast weight's gradient is cast into its channels-last .grad", "[autograd][grad_in_place][bf16][memory_format]") {
  // A channels-last model's 4-D weights are channels-last, and so are their views in the
  // FlatBuffer (split_views keeps a dense tensor's strides): the conversion's backward writes
  // into that layout too, instead of casting apart and adding.
  for (Device d : test::test_devices()) {
    INFO(d.str());
    const auto weight = [&] {
      Generator gen(23);
      Tensor t = restrided(uniform({4, 3, 3, 3}, -0.5, 0.5, kFloat32, kCPU, &gen).to(d), MemoryFormat::ChannelsLast);
      t.set_requires_grad();
      return t;
    };
    const auto loss = [&](const Tensor& cw) {
      AutocastGuard autocast(kBFloat16);
      Generator gen(29);
      const Tensor img =
          restrided(uniform({2, 3, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d), MemoryFormat::ChannelsLast);
      const Tensor c = conv2d(img, cw, Tensor(), {1, 1, 1, 1});  // [2, 4, 5, 5] bfloat16
      return sum(mul(c, c));
    };
    const Tensor ref = weight();
    loss(ref).backward();
    const Tensor cw = weight();
    REQUIRE(cw.is_contiguous(MemoryFormat::ChannelsLast));
    REQUIRE_FALSE(cw.is_contiguous());
    parallel::FlatBuffer fb({cw});
    REQUIRE(fb.views()[0].is_contiguous(MemoryFormat::ChannelsLast));
    const std::shared_ptr<bool> lent = zero_and_watch(fb, cw, 0);
    loss(cw).backward();
    CHECK(*lent);
    CHECK(cw.grad().same(fb.views()[0]));
    CHECK(values(cw.grad()) == values(ref.grad()));
  }
}

TEST_CASE("a conversion used by two layers, or hooked, is not looked through", "[autograd][grad_in_place][bf16]") {
  // weight_grad_destination looks through a dtype conversion only when the layer's gradient is
  // all the conversion receives and no hook sees it: here one bfloat16 copy feeds two linear
  // layers (the engine sums their bfloat16 gradients before the cast), then a hook on the copy
  // must see a bfloat16 gradient.
  for (Device d : test::test_devices()) {
    INFO(d.str());
    const auto weight = [&] {
      Generator gen(31);
      Tensor t = uniform({3, 4}, -0.5, 0.5, kFloat32, kCPU, &gen).to(d);
      t.set_requires_grad();
      return t;
    };
    Generator gen(37);
    const Tensor x1 = uniform({5, 4}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d).to(kBFloat16);
    const Tensor x2 = uniform({6, 4}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d).to(kBFloat16);
    const auto loss = [&](const Tensor& w, bool hook, DType* seen) {
      const Tensor wb = to(w, kBFloat16);
      if (hook) {
        wb.register_hook([seen](const Tensor& g) {
          *seen = g.dtype();
          return Tensor();
        });
      }
      const Tensor y1 = linear(x1, wb, Tensor()), y2 = hook ? Tensor() : linear(x2, wb, Tensor());
      return hook ? sum(mul(y1, y1)) : add(sum(mul(y1, y1)), sum(mul(y2, y2)));
    };
    for (const bool hook : {false, true}) {
      INFO((hook ? "hooked" : "used twice"));
      DType seen = kFloat64;
      const Tensor ref = weight();
      loss(ref, hook, &seen).backward();
      const Tensor w = weight();
      parallel::FlatBuffer fb({w});
      fb.attach();
      fb.zero_();
      seen = kFloat64;
      loss(w, hook, &seen).backward();
      CHECK(values(w.grad()) == values(ref.grad()));
      CHECK(w.grad().same(fb.views()[0]));
      if (hook) CHECK(seen == kBFloat16);
    }
  }
}

TEST_CASE("a parameter used twice, a hook that replaces the gradient, set_grad after zero_", "[autograd][grad_in_place]") {
  for (Device d : test::test_devices()) {
    INFO(d.str());
    Generator gen(11);
    const Tensor x = uniform({5, 4}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d);
    // The same [4, 4] layer twice: its gradients are the sum of two uses, summed by the engine
    // after the first use's gradient was written into the buffer.
    const auto twice = [&](const Tensor& w, const Tensor& b) {
      return sum(mul(linear(linear_activation(x, w, b, Activation::Relu), w, b), x));
    };
    Tensor rw = leaf({4, 4}, d, 12), rb = leaf({4}, d, 13);
    twice(rw, rb).backward();
    Tensor w = leaf({4, 4}, d, 12), b = leaf({4}, d, 13);
    parallel::FlatBuffer fb({w, b});
    fb.attach();
    fb.zero_();
    twice(w, b).backward();
    CHECK(values(w.grad()) == values(rw.grad()));
    CHECK(values(b.grad()) == values(rb.grad()));
    CHECK(w.grad().same(fb.views()[0]));

    // A tensor hook's replacement is what .grad receives.
    Tensor hw = leaf({4, 4}, d, 12), hb = leaf({4}, d, 13);
    parallel::FlatBuffer hfb({hw, hb});
    hfb.attach();
    hfb.zero_();
    hw.register_hook([](const Tensor& g) { return g * 2.0; });
    twice(hw, hb).backward();
    CHECK(test::rel_error(hw.grad(), rw.grad() * 2.0) == 0.0);
    CHECK(values(hb.grad()) == values(rb.grad()));

    // A gradient set by hand after the zeroing is added to, not overwritten.
    fb.zero_();
    const Tensor ones_w = ones({4, 4}, kFloat64, d);
    w.set_grad(ones_w);
    twice(w, b).backward();
    CHECK(test::rel_error(w.grad(), rw.grad() + 1.0) < 1e-15);
    CHECK(w.grad().same(ones_w));
  }
}

TEST_CASE("a backward that throws after a gradient was lent leaves the zeros, and the next one adds", "[autograd][grad_in_place]") {
  for (Device d : test::test_devices()) {
    INFO(d.str());
    Generator gen(21);
    const Tensor x = uniform({5, 4}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d);
    Tensor w = leaf({3, 4}, d, 22), b = leaf({3}, d, 23);
    parallel::FlatBuffer fb({w, b});
    fb.attach();
    fb.zero_();
    // w is used twice: by an op whose backward throws, recorded first (so it runs last), and
    // by a linear layer, whose backward writes w's gradient into the buffer first.
    Tensor boom = w.detach().clone();
    autograd::record("Boom", {w}, {boom}, [](autograd::TensorList&&) -> autograd::TensorList {
      throw ValueError("boom");
    });
    const Tensor loss = sum(linear(x, w, b)) + sum(boom);
    CHECK_THROWS_AS(loss.backward(), ValueError);
    // w's accumulator never ran: its gradient holds the zeros, as without the buffer; b's ran.
    CHECK(values(w.grad()) == std::vector<double>(12, 0.0));
    CHECK(w.grad().same(fb.views()[0]));
    // The next backward (no zeroing) adds into those zeros: one backward's gradients.
    Tensor rw = leaf({3, 4}, d, 22), rb = leaf({3}, d, 23);
    sum(linear(x, rw, rb)).backward();
    sum(linear(x, w, b)).backward();
    CHECK(values(w.grad()) == values(rw.grad()));
    CHECK(test::rel_error(b.grad(), rb.grad() * 2.0) < 1e-15);
  }
}

TEST_CASE("linear_backward and conv2d_backward_weight write into the tensors given, or name them", "[kernels][grad_in_place]") {
  const Tensor x = uniform({6, 4}, -1.0, 1.0), w = uniform({3, 4}, -1.0, 1.0), dy = uniform({6, 3}, -1.0, 1.0);
  const Tensor dw = zeros({3, 4}), db = zeros({3});
  const kernels::LinearGrads want = kernels::linear_backward(dy, Tensor(), x, w, Activation::None, 4, true, true, true);
  const kernels::LinearGrads got =
      kernels::linear_backward(dy, Tensor(), x, w, Activation::None, 4, true, true, true, dw, db);
  CHECK(got.dw.same(dw));
  CHECK(got.db.same(db));
  CHECK(values(dw) == values(want.dw));
  CHECK(values(db) == values(want.db));
  std::string msg = test::error_message<ShapeError>([&] {
    kernels::linear_backward(dy, Tensor(), x, w, Activation::None, 4, false, true, false, zeros({4, 3}));
  });
  CHECK(test::contains(msg, "dw"));
  CHECK(test::contains(msg, shape_str({4, 3})));
  test::error_message<DTypeError>([&] {
    kernels::linear_backward(dy, Tensor(), x, w, Activation::None, 4, false, false, true, Tensor(),
                             zeros({3}, kFloat64));
  });
  // Not packed: a transposed view is refused.
  msg = test::error_message<ShapeError>([&] {
    kernels::linear_backward(dy, Tensor(), x, w, Activation::None, 4, false, true, false,
                             zeros({4, 3}).transpose(0, 1));
  });
  CHECK(test::contains(msg, "not packed"));

  const Tensor img = uniform({2, 1, 5, 5}, -1.0, 1.0), cdy = uniform({2, 2, 3, 3}, -1.0, 1.0);
  const auto [cw, cb] = kernels::conv2d_backward_weight(img, cdy, {}, {2, 1, 3, 3}, true);
  const Tensor cdw = zeros({2, 1, 3, 3}), cdb = zeros({2});
  const auto [gw, gb] = kernels::conv2d_backward_weight(img, cdy, {}, {2, 1, 3, 3}, true, cdw, cdb);
  CHECK(gw.same(cdw));
  CHECK(gb.same(cdb));
  CHECK(values(cdw) == values(cw));
  CHECK(values(cdb) == values(cb));
  msg = test::error_message<ShapeError>(
      [&] { kernels::conv2d_backward_weight(img, cdy, {}, {2, 1, 3, 3}, true, Tensor(), zeros({3})); });
  CHECK(test::contains(msg, "db"));

  const Tensor bx = uniform({4, 3, 2, 2}, -1.0, 1.0), bdy = uniform({4, 3, 2, 2}, -1.0, 1.0);
  const Tensor gamma = uniform({3}, 0.5, 1.5), rm = zeros({3}), rv = ones({3});
  const kernels::BatchNormResult r = kernels::batch_norm_train(bx, gamma, zeros({3}), rm, rv, 0.1, 1e-5);
  const kernels::BatchNormGrads bw = kernels::batch_norm_backward(bdy, bx, gamma, r.save_mean, r.save_invstd);
  const Tensor dg = zeros({3}), dbeta = zeros({3});
  const kernels::BatchNormGrads bg = kernels::batch_norm_backward(bdy, bx, gamma, r.save_mean, r.save_invstd,
                                                                  Tensor(), Tensor(), false, dg, dbeta);
  CHECK(bg.dgamma.same(dg));
  CHECK(bg.dbeta.same(dbeta));
  CHECK(values(dg) == values(bw.dgamma));
  CHECK(values(dbeta) == values(bw.dbeta));
  CHECK(values(bg.dx) == values(bw.dx));
  msg = test::error_message<ShapeError>([&] {
    kernels::batch_norm_backward(bdy, bx, gamma, r.save_mean, r.save_invstd, Tensor(), Tensor(), false, zeros({4}));
  });
  CHECK(test::contains(msg, "dgamma"));
  msg = test::error_message<DTypeError>([&] {
    kernels::batch_norm_backward(bdy, bx, gamma, r.save_mean, r.save_invstd, Tensor(), Tensor(), false, Tensor(),
                                 zeros({3}, kFloat64));
  });
  CHECK(test::contains(msg, "dbeta"));
}

TEST_CASE("batch norm's gamma and beta gradients are written into a zeroed FlatBuffer", "[autograd][grad_in_place]") {
  for (Device d : test::test_devices()) {
    INFO(d.str());
    Generator gen(23);
    const Tensor x = uniform({4, 3, 5, 5}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d);
    const Tensor rm = zeros({3}, kFloat64, d), rv = ones({3}, kFloat64, d);
    const auto loss = [&](const Tensor& gamma, const Tensor& beta, bool relu) {
      const Tensor y = relu ? batch_norm_relu(x, gamma, beta, rm, rv, true, 0.1, 1e-5)
                            : batch_norm(x, gamma, beta, rm, rv, true, 0.1, 1e-5);
      return sum(mul(y, y));
    };
    for (bool relu : {false, true}) {
      INFO("relu " << relu);
      const Tensor rg = leaf({3}, d, 24), rb = leaf({3}, d, 25);
      loss(rg, rb, relu).backward();
      const Tensor gamma = leaf({3}, d, 24), beta = leaf({3}, d, 25);
      parallel::FlatBuffer fb({gamma, beta});
      const std::shared_ptr<bool> lent = zero_and_watch(fb, beta, 1);
      loss(gamma, beta, relu).backward();
      CHECK(*lent);
      CHECK(values(gamma.grad()) == values(rg.grad()));
      CHECK(values(beta.grad()) == values(rb.grad()));
      CHECK(gamma.grad().same(fb.views()[0]));
    }
  }
}

TEST_CASE("an autocast conv bias's gradient is written by batch norm into its zeroed float32 .grad", "[autograd][grad_in_place][bf16]") {
  // Under autocast the float32 bias reaches batch_norm_bias (and the join) as its bfloat16 copy;
  // its gradient, each sum rounded to bfloat16, is written into the lent float32 .grad (Note
  // [the conv bias's gradient in float32] in kernels/cuda/batchnorm_backward.cu): the bits the
  // conversion's cast wrote before.
  for (Device d : test::test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      for (bool join : {false, true}) {
        INFO(d.str() << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : "") << (join ? " joined" : ""));
        Generator gen(29);
        const Tensor z = uniform({4, 3, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen).to(kBFloat16).contiguous(fmt).to(d);
        const Tensor res = uniform({4, 3, 5, 5}, -1.0, 1.0, kFloat32, kCPU, &gen).to(kBFloat16).contiguous(fmt).to(d);
        const Tensor rm = zeros({3}, kFloat32, d), rv = ones({3}, kFloat32, d);
        const auto loss = [&](const Tensor& bias) {
          AutocastGuard autocast(kBFloat16);
          const Tensor y = join ? batch_norm_add_relu(z, res, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, bias)
                                : batch_norm_bias(z, bias, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, true);
          const Tensor yf = to(y, kFloat32);
          return sum(mul(yf, yf));
        };
        const auto bias_leaf = [&] {
          Generator g(31);
          Tensor t = uniform({3}, -0.5, 0.5, kFloat32, kCPU, &g).to(d);
          t.set_requires_grad();
          return t;
        };
        const Tensor ref = bias_leaf();
        loss(ref).backward();
        const Tensor bias = bias_leaf();
        parallel::FlatBuffer fb({bias});
        const std::shared_ptr<bool> lent = zero_and_watch(fb, bias, 0);
        loss(bias).backward();
        CHECK(*lent);
        REQUIRE(bias.grad().dtype() == kFloat32);
        CHECK(bias.grad().same(fb.views()[0]));
        CHECK(values(bias.grad()) == values(ref.grad()));
        // The values are bfloat16's: the float32 .grad holds the rounded sums.
        CHECK(values(bias.grad().to(kBFloat16)) == values(bias.grad()));
        for (const double v : values(bias.grad())) CHECK(v != 0.0);
      }
    }
  }
}

TEST_CASE("batch_norm_backward writes dbias into the tensor given, or names it", "[kernels][grad_in_place]") {
  const Tensor x = uniform({4, 3, 2, 2}, -1.0, 1.0), dy = uniform({4, 3, 2, 2}, -1.0, 1.0);
  const Tensor mean = zeros({3}), invstd = ones({3}), bias = uniform({3}, -0.5, 0.5);
  const Tensor into = zeros({3});
  const auto d = kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), bias, true, Tensor(), Tensor(),
                                              false, Tensor(), into);
  CHECK(d.dbias.same(into));
  const auto ref = kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), bias, true);
  CHECK(values(into) == values(ref.dbias));
  std::string msg = test::error_message<DTypeError>([&] {
    kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), bias, true, Tensor(), Tensor(), false,
                                 Tensor(), zeros({3}, kFloat64));
  });
  CHECK(test::contains(msg, "dbias_into"));
  msg = test::error_message<ShapeError>([&] {
    kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), bias, true, Tensor(), Tensor(), false,
                                 Tensor(), zeros({4}));
  });
  CHECK(test::contains(msg, shape_str({4})));
  test::error_message<ValueError>([&] {
    kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), bias, false, Tensor(), Tensor(), false,
                                 Tensor(), zeros({3}));
  });
}
