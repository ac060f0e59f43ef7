// CUDA backend vs the CPU reference, part 2: convolution, pooling, log-softmax, cross-entropy,
// accuracy counting, row indexing, batch norm and the optimizer steps.
#include <string>
#include <vector>

#include "catch.h"
#include "core/device.h"
#include "helpers.h"
#include "kernels/cuda_test_util.h"
#include "kernels/ops.h"

using namespace tandem;
using namespace tandem::test;

namespace {

// Random class indices in [0, classes).
Tensor random_targets(int64_t n, int64_t classes) {
  return uniform({n}, 0.0, static_cast<double>(classes), kFloat64).to(kInt64);
}

struct ConvCase {
  Shape x, w;
  Conv2dParams p;
  bool own_kernels_only = false;  // cuDNN's engine misses the float32 tolerance here (1e-3)
};

}  // namespace

TEST_CASE("cuda conv2d forward and backward through cuDNN", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  const ConvCase cases[] = {
      {{3, 5, 11, 9}, {7, 5, 3, 3}, {1, 1, 1, 1}},
      {{2, 3, 13, 13}, {4, 3, 5, 5}, {2, 2, 0, 0}},   // stride 2: cuDNN
      {{4, 2, 10, 7}, {3, 2, 2, 3}, {2, 1, 1, 2}},
      {{5, 1, 28, 28}, {6, 1, 5, 5}, {1, 1, 2, 2}},   // LeNet's first layer
      {{5, 6, 14, 14}, {16, 6, 5, 5}, {1, 1, 0, 0}},  // LeNet's second: the weight gradient in two channel groups
      {{3, 1, 28, 28}, {64, 1, 3, 3}, {1, 1, 1, 1}},  // ResNet's first: eight channel groups
      {{601, 1, 6, 6}, {4, 1, 3, 3}, {1, 1, 1, 1}},   // many images: the weight gradient in chunks, the last one short
      {{2, 3, 5, 4}, {5, 3, 4, 2}, {1, 1, 2, 0}},     // even filter, padding only in h
      {{2, 2, 6, 7}, {3, 2, 3, 3}, {1, 1, 3, 2}},     // padding past the filter
      {{2, 1, 9, 9}, {3, 1, 1, 1}, {1, 1, 0, 0}},     // 1x1: the forward's generic taps
      {{2, 8, 7, 9}, {3, 8, 5, 6}, {1, 2, 1, 0}},     // 8 channels, stride 2 in w: cuDNN
      {{2, 9, 6, 6}, {3, 9, 3, 3}, {1, 1, 1, 2}},     // 9 channels: cuDNN
      // The row-window kernels (Note [row convolution]): LeNet's layers at full batch (blocks of
      // several images, the last one short; weight-gradient chunks; halves of rows), every
      // column tile (4, 5, 7, 8), 3x3 and 5x5, an output-channel count that is no multiple of
      // the channel tile, and padding in one direction only.
      {{256, 6, 14, 14}, {16, 6, 5, 5}, {1, 1, 0, 0}},
      {{37, 1, 28, 28}, {6, 1, 5, 5}, {1, 1, 2, 2}, true},
      {{7, 3, 16, 12}, {8, 3, 3, 3}, {1, 1, 1, 1}},
      {{3, 4, 9, 16}, {5, 4, 5, 5}, {1, 1, 2, 1}},
      {{5, 2, 11, 8}, {6, 2, 3, 3}, {1, 1, 0, 1}},
      {{2, 2, 5, 3}, {3, 2, 3, 3}, {1, 1, 2, 2}},
  };
  // Both ways of calling cuDNN: cached graph-API plans (the default) and the legacy calls; and
  // tandem's direct kernels for few-channel layers (the default) or cuDNN for every layer.
  // With the own kernels, the row-window kernels for their default passes and for all three.
  const bool graph = GENERATE(true, false);
  const bool direct = GENERATE(true, false);
  const std::string rows = GENERATE(as<std::string>{}, "dw", "fdw");
  if (!direct && rows != "dw") return;  // the row kernels run only with the own kernels on
  struct Restore {
    bool prev = cudnn_graph_api(), prev_direct = direct_conv();
    std::string prev_rows = row_conv_passes();
    ~Restore() {
      set_cudnn_graph_api(prev);
      set_direct_conv(prev_direct);
      set_row_conv_passes(prev_rows);
    }
  } restore;
  set_cudnn_graph_api(graph);
  set_direct_conv(direct);
  set_row_conv_passes(rows);
  INFO("graph api " << graph << ", direct convolution kernels " << direct << ", row kernels for " << rows);
  for (DType dt : kFloatTypes) {
    for (const ConvCase& cc : cases) {
      if (cc.own_kernels_only && !direct) continue;
      INFO(dtype_name(dt) << " x " << shape_str(cc.x) << " w " << shape_str(cc.w) << " stride "
                          << cc.p.stride_h << "," << cc.p.stride_w << " pad " << cc.p.pad_h << ","
                          << cc.p.pad_w);
      Tensor x = uniform(cc.x, -1.0, 1.0, dt), w = uniform(cc.w, -1.0, 1.0, dt);
      Tensor bias = uniform({cc.w[0]}, -1.0, 1.0, dt);
      Tensor y = kernels::conv2d(x, w, bias, cc.p);
      check(kernels::conv2d(gpu(x), gpu(w), gpu(bias), cc.p), y, 4);
      check(kernels::conv2d(gpu(x), gpu(w), Tensor(), cc.p), kernels::conv2d(x, w, Tensor(), cc.p), 4);
      Tensor dy = uniform(y.shape(), -1.0, 1.0, dt);
      check(kernels::conv2d_backward_input(gpu(dy), gpu(w), cc.p, cc.x),
            kernels::conv2d_backward_input(dy, w, cc.p, cc.x), 4);
      auto [dw, db] = kernels::conv2d_backward_weight(x, dy, cc.p, cc.w, true);
      auto [dwg, dbg] = kernels::conv2d_backward_weight(gpu(x), gpu(dy), cc.p, cc.w, true);
      check(dwg, dw, 4);
      check(dbg, db, 4);
      // Without the bias gradient, and deterministic: a second call gives the same bits.
      auto [dwg2, none] = kernels::conv2d_backward_weight(gpu(x), gpu(dy), cc.p, cc.w, false);
      CHECK_FALSE(none.defined());
      check_equal(dwg2, dwg.to(kCPU));
      // The cached plan serves a second call with the same shapes.
      check(kernels::conv2d(gpu(x), gpu(w), gpu(bias), cc.p), y, 4);
    }
  }
}

// A few small layers through every row-window kernel (Note [row convolution]): quick enough to
// run under compute-sanitizer's memcheck and racecheck (the kernels' barriers and shared tiles).
TEST_CASE("cuda row-window convolution kernels, small", "[cuda][rows]") {
  TANDEM_REQUIRE_CUDA();
  struct Restore {
    std::string prev = row_conv_passes();
    bool prev_direct = direct_conv();
    ~Restore() {
      set_row_conv_passes(prev);
      set_direct_conv(prev_direct);
    }
  } restore;
  set_row_conv_passes("fdw");
  set_direct_conv(true);
  const ConvCase cases[] = {
      {{5, 6, 14, 14}, {16, 6, 5, 5}, {1, 1, 0, 0}},  // LeNet's second layer: every row kernel
      {{2, 1, 28, 28}, {6, 1, 5, 5}, {1, 1, 2, 2}},   // LeNet's first: the input gradient's
      {{3, 9, 7, 12}, {4, 9, 3, 3}, {1, 1, 1, 1}},    // 9 channels: the weight gradient's row kernel
  };
  for (const ConvCase& cc : cases) {
    INFO("x " << shape_str(cc.x) << " w " << shape_str(cc.w));
    Tensor x = uniform(cc.x, -1.0, 1.0, kFloat32), w = uniform(cc.w, -1.0, 1.0, kFloat32);
    Tensor bias = uniform({cc.w[0]}, -1.0, 1.0, kFloat32);
    Tensor y = kernels::conv2d(x, w, bias, cc.p);
    check(kernels::conv2d(gpu(x), gpu(w), gpu(bias), cc.p), y, 4);
    Tensor dy = uniform(y.shape(), -1.0, 1.0, kFloat32);
    check(kernels::conv2d_backward_input(gpu(dy), gpu(w), cc.p, cc.x), kernels::conv2d_backward_input(dy, w, cc.p, cc.x),
          4);
    auto [dw, db] = kernels::conv2d_backward_weight(x, dy, cc.p, cc.w, true);
    auto [dwg, dbg] = kernels::conv2d_backward_weight(gpu(x), gpu(dy), cc.p, cc.w, true);
    check(dwg, dw, 4);
    check(dbg, db, 4);
  }
}

// The direct weight-gradient kernel in launch shapes its default does not pick for these layers
// (Note [direct convolution]): several images per block, double-buffered where two stages fit in
// shared memory (LeNet's second layer) and single-buffered where they do not (its first), a
// last block with fewer images, and more lanes per tap. Small enough for compute-sanitizer.
TEST_CASE("cuda direct weight-gradient kernel in every launch shape", "[cuda][direct]") {
  TANDEM_REQUIRE_CUDA();
  struct Restore {
    bool prev_direct = direct_conv();
    ~Restore() {
      set_direct_conv(prev_direct);
      set_direct_wgrad_shape({});
    }
  } restore;
  set_direct_conv(true);
  const ConvCase cases[] = {
      {{7, 6, 14, 14}, {16, 6, 5, 5}, {1, 1, 0, 0}},  // two buffers of 9 KB
      {{7, 1, 28, 28}, {6, 1, 5, 5}, {1, 1, 2, 2}},   // one buffer: two would pass 48 KB
      {{5, 2, 6, 7}, {3, 2, 3, 3}, {1, 1, 1, 0}},
  };
  const DirectWgradShape shapes[] = {{1, 0}, {3, 0}, {3, 512}, {2, 128}, {8, 1024}};
  for (DType dt : kFloatTypes) {
    for (const ConvCase& cc : cases) {
      Tensor x = uniform(cc.x, -1.0, 1.0, dt);
      Tensor dy = uniform({cc.x[0], cc.w[0], cc.x[2] + 2 * cc.p.pad_h - cc.w[2] + 1, cc.x[3] + 2 * cc.p.pad_w - cc.w[3] + 1},
                          -1.0, 1.0, dt);
      auto [dw, db] = kernels::conv2d_backward_weight(x, dy, cc.p, cc.w, true);
      for (const DirectWgradShape& shape : shapes) {
        INFO(dtype_name(dt) << " x " << shape_str(cc.x) << " w " << shape_str(cc.w) << ", " << shape.images_per_block
                            << " images per block, " << shape.threads << " threads");
        set_direct_wgrad_shape(shape);
        auto [dwg, dbg] = kernels::conv2d_backward_weight(gpu(x), gpu(dy), cc.p, cc.w, true);
        check(dwg, dw, 4);
        check(dbg, db, 4);
        auto [dwg2, none] = kernels::conv2d_backward_weight(gpu(x), gpu(dy), cc.p, cc.w, false);
        check(dwg2, dw, 4);
      }
    }
  }
}

TEST_CASE("cuda max and average pooling", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  const std::pair<Shape, Pool2dParams> cases[] = {
      {{2, 3, 8, 9}, {2, 2, 2, 2, 0, 0}},
      {{2, 3, 11, 10}, {3, 3, 2, 2, 1, 1}},
      {{1, 4, 7, 7}, {3, 3, 1, 1, 1, 1}},
      {{3, 2, 9, 6}, {3, 2, 2, 1, 1, 0}},
  };
  for (DType dt : kFloatTypes) {
    for (const auto& [shape, p] : cases) {
      for (PoolMode mode : {PoolMode::Max, PoolMode::Avg}) {
        INFO(dtype_name(dt) << " x " << shape_str(shape) << " kernel " << p.kernel_h << "x"
                            << p.kernel_w << " mode " << (mode == PoolMode::Max ? "max" : "avg"));
        Tensor x = uniform(shape, -1.0, 1.0, dt);
        // After a ReLU many windows are ties of zeros: the first one must win.
        for (Tensor in : {x, kernels::unary(UnaryOp::Relu, x)}) {
          Tensor y = kernels::pool2d(mode, in, p);
          Tensor yg = kernels::pool2d(mode, gpu(in), p);
          check(yg, y);
          Tensor dy = uniform(y.shape(), -1.0, 1.0, dt);
          check(kernels::pool2d_backward(mode, gpu(in), yg, gpu(dy), p),
                kernels::pool2d_backward(mode, in, y, dy, p));
        }
      }
    }
  }
}

TEST_CASE("cuda log_softmax, cross-entropy and count_correct", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    for (auto [n, c] : {std::pair<int64_t, int64_t>{37, 10}, {5, 1000}, {300, 3}}) {
      INFO(dtype_name(dt) << " [" << n << ", " << c << "]");
      Tensor x = uniform({n, c}, -4.0, 4.0, dt);
      Tensor y = kernels::log_softmax(x);
      Tensor yg = kernels::log_softmax(gpu(x));
      check(yg, y);
      Tensor dy = uniform({n, c}, -1.0, 1.0, dt);
      check(kernels::log_softmax_backward(gpu(dy), yg), kernels::log_softmax_backward(dy, y));

      Tensor t = random_targets(n, c);
      auto [loss, lp] = kernels::cross_entropy(x, t);
      auto [lossg, lpg] = kernels::cross_entropy(gpu(x), gpu(t));
      REQUIRE(lossg.shape() == Shape{});
      check(lossg, loss);
      check(lpg, lp);
      Tensor dloss = full({}, 0.7, dt);
      check(kernels::cross_entropy_backward(lpg, gpu(t), gpu(dloss)),
            kernels::cross_entropy_backward(lp, t, dloss));

      Tensor correct = full({1}, 5.0, kInt64), correctg = full({1}, 5.0, kInt64, kGpu);
      kernels::count_correct(x, t, correct);
      kernels::count_correct(gpu(x), gpu(t), correctg);
      kernels::count_correct(x, t, correct);
      kernels::count_correct(gpu(x), gpu(t), correctg);
      check_equal(correctg, correct);
    }
  }
  // Many rows, ties between classes, and targets equal to the argmax half of the time.
  Tensor x = uniform({5000, 10}, 0.0, 4.0, kFloat64).to(kInt64).to(kFloat32);
  Tensor t = kernels::argmax(x, 1);
  Tensor half = t.slice(0, 0, 2500);
  half.copy_(random_targets(2500, 10));
  Tensor correct = zeros({1}, kInt64), correctg = zeros({1}, kInt64, kGpu);
  kernels::count_correct(x, t, correct);
  kernels::count_correct(gpu(x), gpu(t), correctg);
  check_equal(correctg, correct);
}

TEST_CASE("cuda index_select and index_add", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : {kFloat32, kFloat64, kInt64}) {
    INFO(dtype_name(dt));
    Tensor x = uniform({13, 4, 3}, -10.0, 10.0, kFloat64).to(dt);
    Tensor index = random_targets(29, 13);  // with repeats
    check_equal(kernels::index_select(gpu(x), gpu(index)), kernels::index_select(x, index));
    Tensor src = uniform({29, 4, 3}, -10.0, 10.0, kFloat64).to(dt);
    Tensor out = kernels::index_add(src, index, {13, 4, 3});
    Tensor outg = kernels::index_add(gpu(src), gpu(index), {13, 4, 3});
    kernels::index_add_(out, index.slice(0, 0, 3), src.slice(0, 0, 3));  // in place, onto the sums
    kernels::index_add_(outg, gpu(index.slice(0, 0, 3)), gpu(src.slice(0, 0, 3)));
    if (dt == kInt64) {
      check_equal(outg, out);
    } else {
      check(outg, out);  // atomics: the order of the additions varies
    }
  }
  Tensor v = uniform({50}, 0.0, 1.0, kFloat32);
  Tensor idx = random_targets(71, 50);
  check_equal(kernels::index_select(gpu(v), gpu(idx)), kernels::index_select(v, idx));
  const Tensor into = empty({71}, kFloat32, gpu(v).device());
  REQUIRE(kernels::index_select(gpu(v), gpu(idx), into).same(into));
  check_equal(into, kernels::index_select(v, idx));
  REQUIRE_THROWS_AS(kernels::index_select(gpu(v), gpu(idx), empty({71}, kFloat32)), DeviceError);
}

TEST_CASE("cuda batch norm: training, evaluation and backward", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  for (DType dt : kFloatTypes) {
    // H*W a multiple of 4 takes the vectorized passes (16-byte loads), the others the scalar ones.
    for (const Shape& shape : {Shape{8, 6, 5, 7}, Shape{16, 9}, Shape{3, 4, 29, 31}, Shape{6, 5, 4, 8},
                               Shape{9, 3, 16, 16}}) {
      INFO(dtype_name(dt) << " " << shape_str(shape));
      const int64_t c = shape[1];
      Tensor x = uniform(shape, -2.0, 3.0, dt);
      Tensor gamma = uniform({c}, 0.5, 1.5, dt), beta = uniform({c}, -0.5, 0.5, dt);
      Tensor rm = uniform({c}, -0.5, 0.5, dt), rv = uniform({c}, 0.5, 2.0, dt);
      Tensor rmg = gpu(rm), rvg = gpu(rv);
      for (int step = 0; step < 2; ++step) {
        auto r = kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5);
        auto rg = kernels::batch_norm_train(gpu(x), gpu(gamma), gpu(beta), rmg, rvg, 0.1, 1e-5);
        check(rg.y, r.y, 4);
        check(rg.save_mean, r.save_mean);
        check(rg.save_invstd, r.save_invstd, 4);
        check(rmg, rm);
        check(rvg, rv);
        Tensor dy = uniform(shape, -1.0, 1.0, dt);
        auto g = kernels::batch_norm_backward(dy, x, gamma, r.save_mean, r.save_invstd);
        auto gg = kernels::batch_norm_backward(gpu(dy), gpu(x), gpu(gamma), rg.save_mean,
                                               rg.save_invstd);
        check(gg.dx, g.dx, 4);
        check(gg.dgamma, g.dgamma, 4);
        check(gg.dbeta, g.dbeta, 4);
      }
      check(kernels::batch_norm_eval(gpu(x), gpu(gamma), gpu(beta), rmg, rvg, 1e-5),
            kernels::batch_norm_eval(x, gamma, beta, rm, rv, 1e-5), 4);
    }
  }
}

TEST_CASE("cuda channels-last batch norm and channel sums in every tile shape", "[cuda][memory_format]") {
  TANDEM_REQUIRE_CUDA();
  // C sets how many channels a thread takes and the tile a block covers (Note [channels-last
  // channel reductions]): one channel, fewer channels than a vector, a last tile only partly
  // used, several tiles, one vector past a whole tile. 5 x 9 x 7 = 315 rows: several row groups,
  // and a tail past the rows a thread loads at once. Tensors of 2^22 elements and more take 16-
  // byte vectors: the last shapes, C = 64 (ResNet-18's first stage) and 264 (a last tile with
  // one vector), with 65536 and 15925 rows.
  std::vector<Shape> shapes;
  for (int64_t c : {1, 3, 8, 24, 40, 64, 96, 136, 264}) shapes.push_back({5, c, 9, 7});
  shapes.push_back({64, 64, 32, 32});
  shapes.push_back({325, 264, 7, 7});
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    const DType pt = dt == kBFloat16 ? kFloat32 : dt;  // bfloat16 activations keep float32 parameters
    const double act_tol = dt == kBFloat16 ? 1.0 / 64 : 8 * tol(dt), stat_tol = 8 * tol(pt);
    for (const Shape& shape : shapes) {
      const int64_t c = shape[1];
      INFO(dtype_name(dt) << " " << shape_str(shape));
      const Tensor z = uniform(shape, -2.0, 2.0).to(dt), dy = uniform(shape, -1.0, 1.0).to(dt);
      const Tensor bias = uniform({c}, -1.0, 1.0).to(dt);
      const Tensor gamma = uniform({c}, 0.5, 1.5).to(pt), beta = uniform({c}, -0.5, 0.5).to(pt);
      Tensor rm = uniform({c}, -0.5, 0.5).to(pt), rv = uniform({c}, 0.5, 2.0).to(pt);
      Tensor rmg = gpu(rm), rvg = gpu(rv);
      const auto cl = [](const Tensor& t) { return gpu(t).contiguous(MemoryFormat::ChannelsLast); };
      for (bool fused : {false, true}) {  // plain, and with the ReLU and a conv's bias
        INFO((fused ? "relu and bias" : "plain"));
        const Tensor b = fused ? bias : Tensor(), bg = fused ? gpu(bias) : Tensor();
        auto r = kernels::batch_norm_train(z, gamma, beta, rm, rv, 0.1, 1e-5, fused, b);
        auto rg = kernels::batch_norm_train(cl(z), gpu(gamma), gpu(beta), rmg, rvg, 0.1, 1e-5, fused, bg);
        CHECK(rg.y.is_contiguous(MemoryFormat::ChannelsLast));
        CHECK(rel_error(rg.y, r.y) <= act_tol);
        CHECK(rel_error(rg.save_mean, r.save_mean) <= stat_tol);
        CHECK(rel_error(rg.save_invstd, r.save_invstd) <= stat_tol);
        CHECK(rel_error(rmg, rm) <= stat_tol);
        CHECK(rel_error(rvg, rv) <= stat_tol);
        // Both backwards take the GPU's ReLU output as the mask: an output within a rounding of
        // zero may have the other sign on the CPU.
        const Tensor mask = fused ? rg.y.to(Device::cpu()).contiguous() : Tensor();
        auto g = kernels::batch_norm_backward(dy, z, gamma, r.save_mean, r.save_invstd, mask, b, fused);
        auto gg = kernels::batch_norm_backward(cl(dy), cl(z), gpu(gamma), rg.save_mean, rg.save_invstd,
                                               fused ? rg.y : Tensor(), bg, fused);
        CHECK(gg.dx.is_contiguous(MemoryFormat::ChannelsLast));
        CHECK(rel_error(gg.dx, g.dx) <= act_tol);
        CHECK(rel_error(gg.dgamma, g.dgamma) <= stat_tol);
        CHECK(rel_error(gg.dbeta, g.dbeta) <= stat_tol);
        if (fused) {
          // dbias is the sum of dx rounded to the activations' type. The CPU's dx differs from the
          // GPU's by a rounding of the per-channel coefficients, the same for every element of a
          // channel, so the two sums drift apart with the rows (5.7e-4 in float32 at 65536 rows):
          // the GPU's dbias is checked against the sum of its own dx, in float64 on the CPU.
          const Tensor dx64 = gg.dx.to(Device::cpu()).contiguous().to(kFloat64);
          CHECK(rel_error(gg.dbias.to(Device::cpu()).to(kFloat64), kernels::reduce(ReduceOp::Sum, dx64, {0, 2, 3})) <=
                act_tol);
          // The dx pass sums dx as the convolution's bias gradient does, bit for bit.
          CHECK(values(gg.dbias) == values(kernels::conv2d_backward_bias(gg.dx)));
          // With the masked dy written out (a joined residual's gradient, by the partial sums):
          // ReluBackward's bits, and every gradient the bits of the backward without it.
          auto gm = kernels::batch_norm_backward(cl(dy), cl(z), gpu(gamma), rg.save_mean, rg.save_invstd, rg.y, bg,
                                                 true, Tensor(), Tensor(), true);
          CHECK(gm.masked_dy.is_contiguous(MemoryFormat::ChannelsLast));
          CHECK(values(gm.masked_dy) == values(kernels::binary(BinaryOp::ReluBackward, cl(dy), rg.y)));
          CHECK(values(gm.dx) == values(gg.dx));
          CHECK(values(gm.dgamma) == values(gg.dgamma));
          CHECK(values(gm.dbeta) == values(gg.dbeta));
          CHECK(values(gm.dbias) == values(gg.dbias));
        }
      }
    }
  }
}

TEST_CASE("cuda SGD and Adam steps", "[cuda]") {
  TANDEM_REQUIRE_CUDA();
  SgdParams plain;
  plain.lr = 0.1;
  SgdParams momentum;
  momentum.lr = 0.05;
  momentum.momentum = 0.9;
  momentum.dampening = 0.1;
  momentum.weight_decay = 1e-2;
  SgdParams nesterov = momentum;
  nesterov.dampening = 0.0;
  nesterov.nesterov = true;
  for (DType dt : kFloatTypes) {
    for (const SgdParams& base : {plain, momentum, nesterov}) {
      INFO(dtype_name(dt) << " momentum " << base.momentum << " nesterov " << base.nesterov);
      Tensor p = uniform({7, 19}, -1.0, 1.0, dt), buf = zeros({7, 19}, dt);
      Tensor pg = gpu(p), bufg = gpu(buf);
      for (int step = 0; step < 3; ++step) {
        SgdParams sp = base;
        sp.first_step = step == 0;
        Tensor grad = uniform({7, 19}, -1.0, 1.0, dt);
        kernels::sgd_step(p, grad, buf, sp);
        kernels::sgd_step(pg, gpu(grad), bufg, sp);
        check(pg, p);
        check(bufg, buf);
      }
    }
    for (bool decoupled : {false, true}) {
      INFO(dtype_name(dt) << (decoupled ? " AdamW" : " Adam"));
      Tensor p = uniform({5, 23}, -1.0, 1.0, dt), m = zeros({5, 23}, dt), v = zeros({5, 23}, dt);
      Tensor pg = gpu(p), mg = gpu(m), vg = gpu(v);
      for (int64_t step = 1; step <= 3; ++step) {
        AdamParams ap;
        ap.lr = 1e-2;
        ap.weight_decay = 0.05;
        ap.decoupled_weight_decay = decoupled;
        ap.step = step;
        Tensor grad = uniform({5, 23}, -1.0, 1.0, dt);
        kernels::adam_step(p, grad, m, v, ap);
        kernels::adam_step(pg, gpu(grad), mg, vg, ap);
        check(pg, p);
        check(mg, m);
        check(vg, v);
      }
    }
  }
}
