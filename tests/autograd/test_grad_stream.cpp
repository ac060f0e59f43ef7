// Note [weight gradients on a second stream] (autograd/grad_stream.h): the weight gradients of
// linear and conv2d layers computed on a side stream beside the input gradients give the same
// bits as on one stream, eagerly and replayed from a CUDA graph, and everything that reads a
// gradient after them (a leaf's hook, a second use of the parameter, the optimizer after
// backward) waits for the side stream.
#include <functional>
#include <limits>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/grad_stream.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/cuda_graph.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn_test_util.h"
#include "parallel/flat_buffer.h"

using namespace tandem;
using tandem::test::values;

namespace {

// Restores the process-wide switch however a test ends.
struct StreamSwitch {
  explicit StreamSwitch(bool on) : before(autograd::weight_grad_stream()) { autograd::set_weight_grad_stream(on); }
  ~StreamSwitch() { autograd::set_weight_grad_stream(before); }
  bool before;
};

Tensor leaf(const Shape& shape, Device d, uint64_t seed, double scale, bool channels_last = false) {
  Generator gen(seed);
  Tensor t = uniform(shape, -scale, scale, kFloat32, kCPU, &gen).to(d);
  if (channels_last) t = restrided(t, MemoryFormat::ChannelsLast);
  t.set_requires_grad();
  return t;
}

// Two convolutions and two linear layers, large enough that the first linear layer's weight
// gradient (cuBLAS, 1024 x 2048 outputs) takes a while: a reader that did not wait for the
// side stream would see the zeros the gradient held before.
// With channels_last its convolutions' weights are channels-last (as Module::to makes them).
struct Net {
  explicit Net(Device d, bool channels_last = false)
      : c1w(leaf({8, 3, 3, 3}, d, 1, 0.3, channels_last)), c1b(leaf({8}, d, 2, 0.1)),
        c2w(leaf({8, 8, 3, 3}, d, 3, 0.2, channels_last)), c2b(leaf({8}, d, 4, 0.1)),
        l1w(leaf({1024, 2048}, d, 5, 0.02)), l1b(leaf({1024}, d, 6, 0.1)), l2w(leaf({10, 1024}, d, 7, 0.05)),
        l2b(leaf({10}, d, 8, 0.1)) {}
  std::vector<Tensor> params() const { return {c1w, c1b, c2w, c2b, l1w, l1b, l2w, l2b}; }
  Tensor loss(const Tensor& img) const {
    const Tensor a = relu(conv2d(img, c1w, c1b, {1, 1, 1, 1}));        // [N, 8, 16, 16]
    const Tensor c = conv2d(a, c2w, c2b, {1, 1, 1, 1});                // [N, 8, 16, 16]
    const Tensor h = linear_activation(reshape(c, {img.size(0), 2048}), l1w, l1b, Activation::Relu);
    const Tensor y = linear(h, l2w, l2b);                              // [N, 10]
    return sum(mul(y, y));
  }
  Tensor c1w, c1b, c2w, c2b, l1w, l1b, l2w, l2b;
};

Tensor images(Device d, uint64_t seed) {
  Generator gen(seed);
  return uniform({64, 3, 16, 16}, -1.0, 1.0, kFloat32, kCPU, &gen).to(d);
}

std::vector<std::vector<double>> grads_of(const Net& net) {
  std::vector<std::vector<double>> out;
  for (const Tensor& p : net.params()) out.push_back(values(p.grad()));
  return out;
}

// One backward into a zeroed FlatBuffer (so every gradient is lent), with the switch as given;
// with `autocast`, under bfloat16 autocast with channels-last convolutions (a ResNet's recipe:
// every weight reaches its layer through a dtype conversion).
std::vector<std::vector<double>> backward_once(bool side, int64_t* forks, bool autocast = false) {
  const StreamSwitch s(side);
  const Device gpu = Device::cuda(0);
  const Net net(gpu, autocast);
  parallel::FlatBuffer fb(net.params());
  fb.attach();
  fb.zero_();
  const int64_t before = autograd::weight_grad_stream_forks();
  {
    const AutocastGuard cast(kBFloat16, autocast);
    const Tensor img = images(gpu, 9);
    net.loss(autocast ? restrided(img, MemoryFormat::ChannelsLast) : img).backward();
  }
  *forks = autograd::weight_grad_stream_forks() - before;
  return grads_of(net);
}

// Which forks go to the side stream below the main one (Note [the side stream's priority]).
struct BackgroundMacs {
  explicit BackgroundMacs(int64_t macs) : before(autograd::weight_grad_background_macs()) {
    autograd::set_weight_grad_background_macs(macs);
  }
  ~BackgroundMacs() { autograd::set_weight_grad_background_macs(before); }
  int64_t before;
};

// One backward with the side streams and one without: three forks and none, the same bits --
// with every fork at the main stream's priority, every fork below it, and mixed: the first
// linear layer's weight gradient (134 M multiply-adds) below, the second convolution's (9.4 M)
// and the last layer's (0.7 M) beside.
void check_side_stream_equals_one_stream(bool autocast) {
  int64_t forks_off = 0;
  const auto off = backward_once(false, &forks_off, autocast);
  CHECK(forks_off == 0);
  for (const int64_t macs : {std::numeric_limits<int64_t>::max(), int64_t{10} << 20, int64_t{0}}) {
    INFO("forks of " << macs << " multiply-adds or more below the main stream");
    const BackgroundMacs b(macs);
    int64_t forks_on = 0;
    const auto on = backward_once(true, &forks_on, autocast);
    CHECK(forks_on == 3);
    REQUIRE(on.size() == off.size());
    for (size_t k = 0; k < on.size(); ++k) {
      INFO("parameter " << k);
      CHECK(on[k] == off[k]);
    }
  }
}

}  // namespace

#ifdef TANDEM_WITH_CUDA
TEST_CASE("weight gradients on a side stream equal those on one stream", "[autograd][cuda][wgrad_stream]") {
  TANDEM_REQUIRE_CUDA();
  // The second convolution and both linear layers compute dx as well: three forks. The first
  // convolution's input needs no gradient, so its weight gradient stays on the main stream.
  check_side_stream_equals_one_stream(/*autocast=*/false);
}

TEST_CASE("autocast weights' gradients go to the side stream through their conversion", "[autograd][cuda][wgrad_stream][bf16]") {
  // Each bfloat16 weight copy's gradient is cast into the float32 .grad by the layer's own
  // backward (weight_grad_destination), so the layers fork as in float32: the same three.
  TANDEM_REQUIRE_CUDA();
  check_side_stream_equals_one_stream(/*autocast=*/true);
}

TEST_CASE("a leaf's hook and a second use of a parameter wait for the side stream", "[autograd][cuda][wgrad_stream]") {
  TANDEM_REQUIRE_CUDA();
  int64_t forks = 0;
  const auto reference = backward_once(false, &forks);
  const StreamSwitch s(true);
  const Device gpu = Device::cuda(0);
  SECTION("hooks") {
    const Net net(gpu);
    parallel::FlatBuffer fb(net.params());
    fb.attach();
    fb.zero_();
    // Copies enqueued on the current stream the moment each hook runs: a tensor hook (before
    // the leaf's accumulator) and a gradient hook (after it, as DistributedDataParallel's).
    const size_t n = net.params().size();
    std::vector<Tensor> before(n), after(n);
    for (size_t k = 0; k < n; ++k) {
      net.params()[k].register_hook([&before, k](const Tensor& g) {
        before[k] = g.clone();
        return Tensor();
      });
      net.params()[k].register_grad_hook([&after, k](const Tensor& g) { after[k] = g.clone(); });
    }
    net.loss(images(gpu, 9)).backward();
    for (size_t k = 0; k < n; ++k) {
      INFO("parameter " << k);
      REQUIRE(before[k].defined());
      REQUIRE(after[k].defined());
      CHECK(values(before[k]) == reference[k]);
      CHECK(values(after[k]) == reference[k]);
    }
  }
  SECTION("a weight used by two layers: the engine adds the lent gradient to the other") {
    const Tensor w = leaf({1024, 2048}, gpu, 5, 0.02);
    const Tensor b = leaf({1024}, gpu, 6, 0.1);
    const Tensor x = leaf({64, 2048}, gpu, 10, 1.0);
    const auto run = [&](bool side) {
      const StreamSwitch inner(side);
      parallel::FlatBuffer fb({w, b});
      fb.attach();
      fb.zero_();
      const Tensor h = linear_activation(x, w, b, Activation::Relu);               // [64, 1024]
      const Tensor y = linear(reshape(h, {32, 2048}), w, b);                       // the same w again
      sum(mul(y, y)).backward();
      return std::vector<std::vector<double>>{values(w.grad()), values(b.grad()), values(x.grad())};
    };
    const auto with_side = run(true);
    x.set_grad(Tensor());
    const auto without = run(false);
    CHECK(with_side == without);
  }
}

TEST_CASE("a step with its weight gradients on a side stream replays from a CUDA graph", "[autograd][cuda][cuda_graph][wgrad_stream]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  // Five steps of plain SGD on two batches in turn; the first run eager on one stream.
  const auto train = [&](bool side, bool graphed) {
    const StreamSwitch s(side);
    const Net net(gpu);
    parallel::FlatBuffer fb(net.params());
    StepGraph graph(
        [&](const std::vector<Tensor>& in) {
          fb.attach();
          fb.zero_();
          net.loss(in[0]).backward();
          for (const Tensor& p : net.params()) kernels::axpby_(-1e-4, p.grad(), 1.0, p);
        },
        {/*warmup_steps=*/2, /*enabled=*/graphed});
    const Tensor batches[2] = {images(gpu, 11), images(gpu, 12)};
    for (int step = 0; step < 5; ++step) graph({batches[step % 2]});
    CHECK(graph.replays() == (graphed ? 3 : 0));  // the capture replays too
    std::vector<std::vector<double>> out;
    for (const Tensor& p : net.params()) out.push_back(values(p));
    return out;
  };
  const auto eager = train(false, false);
  const int64_t before = autograd::weight_grad_stream_forks();
  const auto replayed = train(true, true);
  CHECK(autograd::weight_grad_stream_forks() - before == 3 * 3);  // two warm-up steps and the capture
  CHECK(replayed == eager);
}

// Note [releasing what the side stream kept]: a chain of residual blocks, each block's input
// used twice (its convolution and the shortcut), so that a second gradient arrives at every
// block: the release points. The weights' gradients equal those of one stream whether the
// engine joins there or waits one release point behind, eagerly and replayed from a graph.
struct ResidualChain {
  explicit ResidualChain(Device d) {
    for (uint64_t k = 0; k < 4; ++k) {
      w.push_back(leaf({16, 16, 3, 3}, d, 20 + 2 * k, 0.08));
      b.push_back(leaf({16}, d, 21 + 2 * k, 0.1));
    }
  }
  std::vector<Tensor> params() const {
    std::vector<Tensor> p;
    for (size_t k = 0; k < w.size(); ++k) {
      p.push_back(w[k]);
      p.push_back(b[k]);
    }
    return p;
  }
  Tensor loss(const Tensor& img) const {
    Tensor h = img;
    for (size_t k = 0; k < w.size(); ++k) h = relu(add(conv2d(h, w[k], b[k], {1, 1, 1, 1}), h));
    return sum(mul(h, h));
  }
  std::vector<Tensor> w, b;
};

struct LaggedSwitch {
  explicit LaggedSwitch(bool on) : before(autograd::weight_grad_lagged_release()) {
    autograd::set_weight_grad_lagged_release(on);
  }
  ~LaggedSwitch() { autograd::set_weight_grad_lagged_release(before); }
  bool before;
};

TEST_CASE("releasing what the side stream kept one block behind gives one stream's gradients, forked before or after dx",
          "[autograd][cuda][cuda_graph][wgrad_stream]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  Generator gen(31);
  const Tensor img = uniform({32, 16, 16, 16}, -1.0, 1.0, kFloat32, kCPU, &gen).to(gpu);
  const Tensor img2 = uniform({32, 16, 16, 16}, -1.0, 1.0, kFloat32, kCPU, &gen).to(gpu);
  // Five steps of plain SGD on two batches in turn, optionally replayed from a graph.
  const auto train = [&](bool side, bool lagged, bool graphed) {
    const StreamSwitch s(side);
    const LaggedSwitch l(lagged);
    const ResidualChain net(gpu);
    parallel::FlatBuffer fb(net.params());
    std::vector<std::vector<double>> first_grads;
    StepGraph graph(
        [&](const std::vector<Tensor>& in) {
          fb.attach();
          fb.zero_();
          net.loss(in[0]).backward();
          for (const Tensor& p : net.params()) kernels::axpby_(-1e-3, p.grad(), 1.0, p);
        },
        {/*warmup_steps=*/2, /*enabled=*/graphed});
    for (int step = 0; step < 5; ++step) {
      graph({step % 2 == 0 ? img : img2});
      if (step == 0) {
        for (const Tensor& p : net.params()) first_grads.push_back(values(p.grad()));
      }
    }
    std::vector<std::vector<double>> out = first_grads;
    for (const Tensor& p : net.params()) out.push_back(values(p));
    return out;
  };
  const auto one_stream = train(false, false, false);
  const int64_t before = autograd::weight_grad_stream_forks();
  CHECK(train(true, false, false) == one_stream);
  CHECK(train(true, true, false) == one_stream);
  CHECK(autograd::weight_grad_stream_forks() - before == 2 * 5 * 3);  // blocks 2-4 fork; block 1's input needs no gradient
  CHECK(train(true, true, true) == one_stream);
  // The weight gradients forked after their input gradients: the same values, graphed too.
  const test::SettingRestore after(autograd::set_weight_grad_after_input_grad,
                                   autograd::weight_grad_after_input_grad);
  autograd::set_weight_grad_after_input_grad(true);
  CHECK(train(true, true, false) == one_stream);
  CHECK(train(true, true, true) == one_stream);
  // And on the side stream below the main one.
  const BackgroundMacs below(0);
  CHECK(train(true, true, true) == one_stream);
}
#endif

TEST_CASE("the weight-gradient stream switch, and a CPU backward never forks", "[autograd][wgrad_stream]") {
  const bool before = autograd::weight_grad_stream();
  autograd::set_weight_grad_stream(!before);
  CHECK(autograd::weight_grad_stream() == !before);
  autograd::set_weight_grad_stream(before);
  CHECK(autograd::weight_grad_stream() == before);
  {
    const BackgroundMacs b(12345);
    CHECK(autograd::weight_grad_background_macs() == 12345);
  }

  const StreamSwitch s(true);
  const Tensor w = leaf({3, 4}, kCPU, 1, 0.5), b = leaf({3}, kCPU, 2, 0.5), x = leaf({5, 4}, kCPU, 3, 1.0);
  parallel::FlatBuffer fb({w, b});
  fb.attach();
  fb.zero_();
  const int64_t forks = autograd::weight_grad_stream_forks();
  sum(linear(x, w, b)).backward();
  CHECK(autograd::weight_grad_stream_forks() == forks);
  // d/dw sum(x w^T + b) = the column sums of x for every row; d/db = the batch size.
  const std::vector<double> xs = values(x);
  const std::vector<double> dw = values(w.grad());
  for (int64_t o = 0; o < 3; ++o) {
    for (int64_t i = 0; i < 4; ++i) {
      double col = 0;
      for (int64_t r = 0; r < 5; ++r) col += xs[static_cast<size_t>(r * 4 + i)];
      CHECK(dw[static_cast<size_t>(o * 4 + i)] == Approx(col).epsilon(1e-6));
    }
  }
  CHECK(values(b.grad()) == std::vector<double>{5, 5, 5});
}
