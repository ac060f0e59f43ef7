// The bucketing policy on its own, with a fake transport: bucket assignment, gradients as bucket
// views, launches during backward and in bucket order, no_sync, unused parameters.
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn.h"
#include "parallel/reducer.h"

using namespace tandem;
using tandem::parallel::Reducer;
using tandem::parallel::assign_buckets;

namespace {

std::vector<Tensor> floats(const std::vector<int64_t>& numels) {
  std::vector<Tensor> ts;
  for (int64_t n : numels) ts.push_back(zeros({n}, kFloat32));
  return ts;
}

}  // namespace

TEST_CASE("assign_buckets fills buckets in reverse order up to the caps", "[parallel][reducer]") {
  // 4-byte floats: 10, 20, 30, 40 elements = 40, 80, 120, 160 bytes.
  auto ps = floats({10, 20, 30, 40});
  SECTION("one bucket when everything fits") {
    CHECK(assign_buckets(ps, 1000, 1000) == std::vector<std::vector<size_t>>{{3, 2, 1, 0}});
  }
  SECTION("a small first bucket, then the cap") {
    // first cap 200: 160 fits, +120 does not; then cap 200: 120 + 80 = 200 fits, +40 does not.
    CHECK(assign_buckets(ps, 200, 200) == std::vector<std::vector<size_t>>{{3}, {2, 1}, {0}});
    CHECK(assign_buckets(ps, 1000, 1) == std::vector<std::vector<size_t>>{{3}, {2, 1, 0}});
  }
  SECTION("a parameter larger than the cap gets a bucket of its own") {
    CHECK(assign_buckets(ps, 1, 1) == std::vector<std::vector<size_t>>{{3}, {2}, {1}, {0}});
  }
  SECTION("a dtype change starts a bucket") {
    std::vector<Tensor> mixed = {zeros({2}, kFloat32), zeros({2}, kFloat64), zeros({2}, kFloat64)};
    CHECK(assign_buckets(mixed, 1000, 1000) == std::vector<std::vector<size_t>>{{2, 1}, {0}});
  }
  SECTION("bad caps are errors") {
    CHECK(test::contains(test::error_message<ValueError>([&] { assign_buckets(ps, 0, 10); }), "caps must be"));
  }
}

namespace {

// An MLP whose reduction is recorded: launch(b) doubles the bucket (a stand-in for "sum over
// two identical ranks") and logs when it ran.
struct Fixture {
  Generator gen{11};
  std::shared_ptr<nn::Module> net = std::make_shared<nn::SequentialImpl>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(6, 8, true, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(8, 8, true, gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(8, 3, true, gen)});
  std::vector<std::string> log;
  int hooks_seen = 0;
  std::unique_ptr<Reducer> reducer;

  explicit Fixture(int64_t cap_bytes, Reducer::Options o = {}) {
    std::vector<Tensor> params = net->parameters();
    std::vector<std::string> names;
    for (const auto& [name, p] : net->named_parameters()) names.push_back(name);
    // Counts every gradient hook, registered before the reducer's, to see launches mid-backward.
    for (const Tensor& p : params) p.register_grad_hook([this](const Tensor&) { ++hooks_seen; });
    auto buckets = assign_buckets(params, cap_bytes, cap_bytes);
    reducer = std::make_unique<Reducer>(
        params, names, buckets,
        [this](size_t b, const Tensor& flat) -> Reducer::Wait {
          log.push_back("launch " + std::to_string(b) + " after " + std::to_string(hooks_seen) + " hooks");
          kernels::axpby_(2.0, flat.clone(), 0.0, flat);
          return [this, b] { log.push_back("wait " + std::to_string(b)); };
        },
        o);
  }
  Tensor loss() {
    Generator g(5);
    Tensor x = randn({4, 6}, kFloat32, kCPU, &g);
    return cross_entropy(net->forward(x), from_vector<int64_t>({0, 1, 2, 1}, {4}));
  }
};

}  // namespace

TEST_CASE("Reducer launches each bucket during backward, in order, and waits at the end", "[parallel][reducer]") {
  Fixture f(/*cap_bytes=*/40 * 4);  // small buckets: several for this net
  const size_t nb = f.reducer->num_buckets();
  REQUIRE(nb >= 3);
  // The reference gradient, without a reducer.
  Fixture plain(1 << 20);
  plain.reducer.reset();
  plain.net->zero_grad();
  plain.loss().backward();

  f.reducer->prepare_for_backward();
  f.loss().backward();
  REQUIRE(f.log.size() == 2 * nb);
  for (size_t b = 0; b < nb; ++b) CHECK(test::contains(f.log[b], "launch " + std::to_string(b) + " "));
  for (size_t b = 0; b < nb; ++b) CHECK(f.log[nb + b] == "wait " + std::to_string(b));
  // Overlap: the first bucket went out before the last gradient was final.
  CHECK(f.log[0] != "launch 0 after 6 hooks");
  CHECK(f.reducer->reductions() == 1);
  // .grad is the bucket view, reduced (doubled) in place.
  const auto ps = f.net->parameters(), ref = plain.net->parameters();
  for (size_t k = 0; k < ps.size(); ++k) {
    const Tensor g = ps[k].grad();
    REQUIRE(g.defined());
    bool in_a_bucket = false;
    for (size_t b = 0; b < nb; ++b) in_a_bucket |= g.storage() == f.reducer->bucket_flat(b).storage();
    CHECK(in_a_bucket);
    CHECK(test::rel_error(g, kernels::binary(BinaryOp::Mul, ref[k].grad(), full(ref[k].shape(), 2.0))) < 1e-6);
  }
}

TEST_CASE("Reducer: assign_buckets' buckets are slices of one buffer in parameter order, other buckets are not",
          "[parallel][reducer]") {
  Fixture f(/*cap_bytes=*/40 * 4);
  const size_t nb = f.reducer->num_buckets();
  REQUIRE(nb >= 3);
  const Tensor& all = f.reducer->flat_gradients();
  REQUIRE(all.defined());
  const auto ps = f.net->parameters();
  int64_t total = 0;
  for (const Tensor& p : ps) total += p.numel();
  CHECK(all.numel() == total);
  // The gradients, in parameter order, are exactly that buffer: what the optimizer's flat step needs.
  std::vector<Tensor> grads;
  for (const Tensor& p : ps) grads.push_back(p.grad());
  const Tensor span = contiguous_span(grads);
  REQUIRE(span.defined());
  CHECK(span.raw_data() == all.raw_data());
  CHECK(span.numel() == total);
  // Bucket 0 holds the last parameters: the end of the buffer.
  const Tensor& first = f.reducer->bucket_flat(0);
  CHECK(first.storage() == all.storage());
  CHECK(static_cast<const char*>(first.raw_data()) + first.nbytes() ==
        static_cast<const char*>(all.raw_data()) + all.nbytes());
  // zero_grad, then the next forward's attach: one buffer of zeros, the views again.
  f.reducer->prepare_for_backward();
  f.loss().backward();
  f.net->zero_grad();
  f.reducer->prepare_for_backward();
  for (double v : test::values(all)) CHECK(v == 0.0);
  for (const Tensor& p : ps) CHECK(p.grad().storage() == all.storage());

  // Buckets that are not runs of consecutive parameters, last first: one allocation each, and
  // the reduction is the same.
  Fixture g(1 << 20);
  std::vector<std::string> names;
  for (const auto& [name, p] : g.net->named_parameters()) names.push_back(name);
  g.reducer.reset();
  g.net->zero_grad();
  Reducer shuffled(
      g.net->parameters(), names, {{5, 3, 4}, {2, 1, 0}},
      [](size_t, const Tensor& flat) -> Reducer::Wait {
        kernels::axpby_(2.0, flat.clone(), 0.0, flat);
        return [] {};
      },
      {});
  CHECK(!shuffled.flat_gradients().defined());
  CHECK(shuffled.bucket_flat(0).storage() != shuffled.bucket_flat(1).storage());
  shuffled.prepare_for_backward();
  g.loss().backward();
  f.net->zero_grad();
  f.reducer->prepare_for_backward();
  f.loss().backward();
  const auto a = f.net->parameters(), b = g.net->parameters();
  for (size_t k = 0; k < a.size(); ++k) CHECK(test::values(a[k].grad()) == test::values(b[k].grad()));
}

TEST_CASE("Reducer with overlap off launches everything after backward", "[parallel][reducer]") {
  Reducer::Options o;
  o.overlap = false;
  Fixture f(40 * 4, o);
  f.reducer->prepare_for_backward();
  f.loss().backward();
  for (size_t b = 0; b < f.reducer->num_buckets(); ++b) CHECK(f.log[b] == "launch " + std::to_string(b) + " after 6 hooks");
}

TEST_CASE("Reducer: zero_grad, no_sync accumulation and unused parameters", "[parallel][reducer]") {
  SECTION("zero_grad (set to none) then prepare_for_backward: views again, zeroed") {
    Fixture f(1 << 20);
    f.reducer->prepare_for_backward();
    f.loss().backward();
    f.net->zero_grad();
    f.reducer->prepare_for_backward();
    for (const Tensor& p : f.net->parameters()) {
      REQUIRE(p.grad().defined());
      CHECK(p.grad().storage() == f.reducer->bucket_flat(0).storage());
      for (double v : test::values(p.grad())) CHECK(v == 0.0);
    }
  }
  SECTION("after zero_grad, prepare_for_backward lends the zeroed views: gradients written straight into them") {
    Fixture f(40 * 4);
    f.net->zero_grad();
    f.reducer->prepare_for_backward();
    // A tensor hook on each parameter runs before its accumulator: a gradient written in place
    // is the bucket view itself (Note [gradients written in place]).
    const auto ps = f.net->parameters();
    std::vector<char> lent(ps.size(), 0);
    for (size_t k = 0; k < ps.size(); ++k) {
      ps[k].register_hook([&lent, k, view = ps[k].grad()](const Tensor& g) {
        lent[k] = g.raw_data() == view.raw_data();
        return Tensor();
      });
    }
    f.loss().backward();
    CHECK(f.reducer->reductions() == 1);
    for (size_t k = 0; k < ps.size(); ++k) CHECK(lent[k]);
    // The values of the usual way, doubled by the fake reduction, bit for bit.
    Fixture plain(1 << 20);
    plain.reducer.reset();
    plain.net->zero_grad();
    plain.loss().backward();
    const auto ref = plain.net->parameters();
    for (size_t k = 0; k < ps.size(); ++k) {
      CHECK(test::values(ps[k].grad()) == test::values(kernels::binary(BinaryOp::Mul, ref[k].grad(),
                                                                         full(ref[k].shape(), 2.0))));
    }
  }
  SECTION("unarmed (no_sync): nothing launched, gradients accumulate; the next armed pass reduces the sum") {
    Fixture f(1 << 20);
    f.reducer->attach_grads();
    f.loss().backward();
    f.loss().backward();
    CHECK(f.log.empty());
    f.reducer->prepare_for_backward();
    f.loss().backward();
    CHECK(f.reducer->reductions() == 1);
    Fixture plain(1 << 20);
    plain.reducer.reset();
    plain.net->zero_grad();
    plain.loss().backward();
    const auto ps = f.net->parameters(), ref = plain.net->parameters();
    // 3 passes accumulated, then doubled by the fake reduction.
    for (size_t k = 0; k < ps.size(); ++k)
      CHECK(test::rel_error(ps[k].grad(), kernels::binary(BinaryOp::Mul, ref[k].grad(), full(ref[k].shape(), 6.0))) < 1e-6);
  }
  SECTION("a parameter without a gradient is an error naming it, or zero with find_unused_parameters") {
    for (bool find_unused : {false, true}) {
      Reducer::Options o;
      o.find_unused_parameters = find_unused;
      Fixture f(1 << 20, o);
      f.reducer->prepare_for_backward();
      // Only the first layer takes part: the loss of its output alone.
      Generator g(5);
      Tensor x = randn({4, 6}, kFloat32, kCPU, &g);
      Tensor loss = sum((*(*std::static_pointer_cast<nn::SequentialImpl>(f.net))[0])(x));
      if (!find_unused) {
        const std::string msg = test::error_message<ValueError>([&] { loss.backward(); });
        CHECK(test::contains(msg, "'2.weight'"));
        CHECK(test::contains(msg, "find_unused_parameters"));
      } else {
        loss.backward();
        CHECK(f.reducer->reductions() == 1);
        for (double v : test::values(f.net->parameters().back().grad())) CHECK(v == 0.0);
      }
    }
  }
}

// Note [the forward arms the reducer]: only a backward that prepare_for_backward armed is
// reduced; any other accumulates locally and launches nothing.
TEST_CASE("Reducer reduces only a backward that prepare_for_backward armed, once", "[parallel][reducer]") {
  Fixture plain(1 << 20);
  plain.reducer.reset();
  plain.net->zero_grad();
  plain.loss().backward();
  const auto ref = plain.net->parameters();
  auto grads_are = [&](Fixture& f, double factor) {
    const auto ps = f.net->parameters();
    for (size_t k = 0; k < ps.size(); ++k) {
      REQUIRE(ps[k].grad().defined());
      CHECK(test::rel_error(ps[k].grad(), kernels::binary(BinaryOp::Mul, ref[k].grad(), full(ref[k].shape(), factor))) <
            1e-6);
    }
  };
  SECTION("a backward nothing armed: no launch, the local gradient") {
    Fixture f(40 * 4);
    CHECK_FALSE(f.reducer->armed());
    f.loss().backward();
    CHECK(f.log.empty());
    CHECK(f.reducer->reductions() == 0);
    grads_are(f, 1.0);
  }
  SECTION("armed once: the first backward is reduced, the next one is local") {
    Fixture f(40 * 4);
    f.reducer->prepare_for_backward();
    CHECK(f.reducer->armed());
    f.loss().backward();
    CHECK_FALSE(f.reducer->armed());
    const size_t launched = f.log.size();
    CHECK(launched == 2 * f.reducer->num_buckets());
    grads_are(f, 2.0);
    f.loss().backward();  // not armed again: accumulates 1x onto the reduced 2x
    CHECK(f.log.size() == launched);
    CHECK(f.reducer->reductions() == 1);
    grads_are(f, 3.0);
  }
  SECTION("two arms before one backward arm it once") {
    Fixture f(40 * 4);
    f.net->zero_grad();
    f.reducer->prepare_for_backward();
    f.reducer->prepare_for_backward();
    Tensor both = add(f.loss(), f.loss());  // two forwards, one backward of their sum
    both.backward();
    CHECK(f.reducer->reductions() == 1);
    CHECK(f.log.size() == 2 * f.reducer->num_buckets());
    grads_are(f, 4.0);  // (1 + 1) summed over both graphs, doubled once
    f.loss().backward();
    CHECK(f.reducer->reductions() == 1);
  }
}
