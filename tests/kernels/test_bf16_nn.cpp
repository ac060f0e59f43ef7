// bfloat16 convolutions and batch norm (mixed: bfloat16 activations, float32 parameters and
// statistics), on the CPU (the reference: float32 kernels on the widened operands, each result
// rounded once, Note [bfloat16 on the CPU] in kernels/cpu/conv.cpp) and on the GPU (cuDNN's
// bfloat16 engines with float32 accumulation; tandem's batch-norm kernels), and a small
// ResNet trained under autocast against float32.
//
// Tolerances: a bfloat16 result carries 8 significant bits, so one rounding is a relative
// error of at most 2^-8 of its magnitude; the GPU may accumulate in another order (cuDNN's
// engines) and round the other way, so GPU-vs-CPU results are compared at 2^-6 of the
// result's scale. Training under autocast differs from float32 by the bfloat16 roundings of every
// activation and gradient: after three steps the parameters agree to about 1e-2 of their scale.
#include <memory>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/bf16_test_util.h"
#include "kernels/ops.h"
#include "nn/activation.h"
#include "nn/batchnorm.h"
#include "nn/container.h"
#include "nn/conv.h"
#include "nn/linear.h"
#include "nn/optim/sgd.h"
#include "nn/pooling.h"
#include "nn/residual.h"

using namespace tandem;
using tandem::test::rel_error;
using tandem::test::values;
using tandem::test::bf16;
using tandem::test::f32;

namespace {

const Device kGpu = Device::cuda(0);
constexpr double kOneRounding = 1.0 / 256;  // 2^-8
constexpr double kGpuVsCpu = 1.0 / 64;      // 2^-6

Tensor channels_last(const Tensor& t) { return restrided(t, MemoryFormat::ChannelsLast); }

}  // namespace

TEST_CASE("bfloat16 convolution equals the float32 one on the same values, rounded once", "[kernels][bf16]") {
  struct Case {
    Shape x, w;
    Conv2dParams p;
  };
  const Case cases[] = {{{3, 8, 9, 7}, {16, 8, 3, 3}, {1, 1, 1, 1}},
                        {{2, 1, 12, 12}, {8, 1, 3, 3}, {2, 2, 1, 1}},
                        {{2, 16, 7, 7}, {32, 16, 1, 1}, {2, 2, 0, 0}}};
  if (!test::have_cuda()) WARN("no GPU on this machine: CUDA part skipped");
  for (const Case& c : cases) {
    INFO("x " << shape_str(c.x) << " w " << shape_str(c.w));
    const Tensor x = bf16(uniform(c.x, -1.0, 1.0)), w = bf16(uniform(c.w, -1.0, 1.0)), b = bf16(uniform({c.w[0]}, -1.0, 1.0));
    // The float32 reference on exactly the bfloat16 values.
    const Tensor y32 = kernels::conv2d(f32(x), f32(w), f32(b), c.p);
    const Tensor y = kernels::conv2d(x, w, b, c.p);
    REQUIRE(y.dtype() == kBFloat16);
    CHECK(values(y) == values(bf16(y32)));  // the CPU: one rounding of the float32 result
    const Tensor dy = bf16(uniform(y.shape(), -1.0, 1.0));
    const Tensor dx = kernels::conv2d_backward_input(dy, w, c.p, c.x);
    CHECK(values(dx) == values(bf16(kernels::conv2d_backward_input(f32(dy), f32(w), c.p, c.x))));
    auto [dw, db] = kernels::conv2d_backward_weight(x, dy, c.p, c.w, true);
    auto [dw32, db32] = kernels::conv2d_backward_weight(f32(x), f32(dy), c.p, c.w, true);
    CHECK(values(dw) == values(bf16(dw32)));
    CHECK(values(db) == values(bf16(db32)));
    CHECK(rel_error(y, y32) <= kOneRounding);
    if (!test::have_cuda()) continue;
    for (bool cl : {false, true}) {
      INFO("cuda, channels-last " << cl);
      auto on_gpu = [&](const Tensor& t) { return cl ? channels_last(t.to(kGpu)) : t.to(kGpu); };
      const Tensor yg = kernels::conv2d(on_gpu(x), on_gpu(w), b.to(kGpu), c.p);
      REQUIRE(yg.dtype() == kBFloat16);
      CHECK(rel_error(yg, y32) <= kGpuVsCpu);
      CHECK(rel_error(kernels::conv2d_backward_input(on_gpu(dy), on_gpu(w), c.p, c.x), dx) <= kGpuVsCpu);
      auto [dwg, dbg] = kernels::conv2d_backward_weight(on_gpu(x), on_gpu(dy), c.p, c.w, true);
      CHECK(rel_error(dwg, dw32) <= kGpuVsCpu);
      CHECK(rel_error(dbg, db32) <= kGpuVsCpu);
    }
  }
}

TEST_CASE("batch norm of bfloat16 activations with float32 parameters", "[kernels][bf16]") {
  if (!test::have_cuda()) WARN("no GPU on this machine: CUDA part skipped");
  for (const Shape& shape : {Shape{8, 16, 5, 6}, Shape{4, 6, 7, 7}, Shape{16, 9}}) {
    INFO(shape_str(shape));
    const int64_t c = shape[1];
    const Tensor x = bf16(uniform(shape, -2.0, 3.0));
    const Tensor gamma = uniform({c}, 0.5, 1.5), beta = uniform({c}, -0.5, 0.5);
    Tensor rm = zeros({c}), rv = ones({c});
    Tensor rm32 = zeros({c}), rv32 = ones({c});
    auto r = kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5);
    auto r32 = kernels::batch_norm_train(f32(x), gamma, beta, rm32, rv32, 0.1, 1e-5);
    REQUIRE(r.y.dtype() == kBFloat16);
    REQUIRE(r.save_mean.dtype() == kFloat32);
    CHECK(values(r.y) == values(bf16(r32.y)));
    CHECK(values(r.save_mean) == values(r32.save_mean));
    CHECK(values(rv) == values(rv32));
    const Tensor dy = bf16(uniform(shape, -1.0, 1.0));
    auto g = kernels::batch_norm_backward(dy, x, gamma, r.save_mean, r.save_invstd);
    auto g32 = kernels::batch_norm_backward(f32(dy), f32(x), gamma, r32.save_mean, r32.save_invstd);
    REQUIRE(g.dx.dtype() == kBFloat16);
    REQUIRE(g.dgamma.dtype() == kFloat32);
    CHECK(values(g.dx) == values(bf16(g32.dx)));
    CHECK(values(g.dgamma) == values(g32.dgamma));
    // Mixed means float32 statistics: bfloat16 ones are refused by name.
    CHECK(test::contains(test::error_message<DTypeError>([&] { kernels::batch_norm_train(x, bf16(gamma), beta, rm, rv, 0.1, 1e-5); }),
                         "needs float32 per-channel tensors"));
    if (!test::have_cuda()) continue;
    for (bool cl : {false, true}) {
      if (cl && shape.size() != 4) continue;
      INFO("cuda, channels-last " << cl);
      const Tensor xg = cl ? channels_last(x.to(kGpu)) : x.to(kGpu);
      const Tensor dyg = cl ? channels_last(dy.to(kGpu)) : dy.to(kGpu);
      Tensor rmg = zeros({c}, kFloat32, kGpu), rvg = ones({c}, kFloat32, kGpu);
      auto rg = kernels::batch_norm_train(xg, gamma.to(kGpu), beta.to(kGpu), rmg, rvg, 0.1, 1e-5);
      CHECK(rel_error(rg.y, r32.y) <= kGpuVsCpu);
      CHECK(rel_error(rg.save_mean, r32.save_mean) <= 1e-5);
      CHECK(rel_error(rg.save_invstd, r32.save_invstd) <= 1e-5);
      CHECK(rel_error(rvg, rv32) <= 1e-5);
      auto gg = kernels::batch_norm_backward(dyg, xg, gamma.to(kGpu), rg.save_mean, rg.save_invstd);
      CHECK(rel_error(gg.dx, g32.dx) <= kGpuVsCpu);
      CHECK(rel_error(gg.dgamma, g32.dgamma) <= 1e-5);
      CHECK(rel_error(gg.dbeta, g32.dbeta) <= 1e-5);
      CHECK(rel_error(kernels::batch_norm_eval(xg, gamma.to(kGpu), beta.to(kGpu), rmg, rvg, 1e-5),
                      kernels::batch_norm_eval(f32(x), gamma, beta, rm32, rv32, 1e-5)) <= kGpuVsCpu);
    }
  }
}

TEST_CASE("bfloat16 pooling is float32 pooling rounded once", "[kernels][bf16]") {
  const Tensor x = bf16(uniform({2, 3, 8, 8}, -1.0, 1.0));
  for (const Device d : test::test_devices()) {
    for (PoolMode mode : {PoolMode::Max, PoolMode::Avg}) {
      INFO("on " << d.str() << " mode " << static_cast<int>(mode));
      const Pool2dParams p{3, 3, 2, 2, 1, 1};
      const Tensor y = kernels::pool2d(mode, x.to(d), p);
      REQUIRE(y.dtype() == kBFloat16);
      const Tensor y32 = kernels::pool2d(mode, f32(x), p);
      CHECK(values(y) == values(bf16(y32)));
      const Tensor dy = bf16(uniform(y.shape(), -1.0, 1.0));
      const Tensor dx = kernels::pool2d_backward(mode, x.to(d), y, dy.to(d), p);
      REQUIRE(dx.dtype() == kBFloat16);
      // Against float32 on the same device: overlapping windows sum in the device's own order,
      // so the float32 gradients of two devices may round to different bfloat16 values.
      const Tensor dx32 = kernels::pool2d_backward(mode, f32(x).to(d), f32(y.to(kCPU)).to(d), f32(dy).to(d), p);
      CHECK(values(dx) == values(bf16(dx32.to(kCPU))));
    }
  }
}

TEST_CASE("a small ResNet trained under autocast stays near float32 training", "[nn][bf16]") {
  auto make = [] {
    Generator gen(7);
    using namespace nn;
    return std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
        std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, gen), std::make_shared<BatchNorm2d>(8),
        std::make_shared<ReLU>(), std::make_shared<Residual>(8, 16, true, 2, gen),
        std::make_shared<GlobalAvgPool2d>(), std::make_shared<Flatten>(), std::make_shared<Linear>(16, 4, true, gen)});
  };
  const Tensor x = randn({8, 1, 10, 10});
  const Tensor y = from_vector<int64_t>({0, 1, 2, 3, 0, 1, 2, 3}, {8});
  for (const Device d : test::test_devices()) {
    for (bool cl : {false, true}) {
      INFO("on " << d.str() << ", channels-last " << cl);
      auto ref = make(), net = make();
      ref->to(d);
      net->to(d);
      if (cl) net->to(MemoryFormat::ChannelsLast);
      nn::optim::SGD opt_ref(ref->parameters(), 0.05, 0.9), opt(net->parameters(), 0.05, 0.9);
      for (int step = 0; step < 3; ++step) {
        opt_ref.zero_grad();
        cross_entropy((*ref)(x.to(d)), y.to(d)).backward();
        opt_ref.step();
        opt.zero_grad();
        Tensor loss;
        {
          AutocastGuard autocast;
          Tensor logits = (*net)(x.to(d));
          CHECK(logits.dtype() == kBFloat16);  // the classifier ran in bfloat16
          loss = cross_entropy(logits, y.to(d));
        }
        REQUIRE(loss.dtype() == kFloat32);  // the loss is float32 (Note [autocast])
        loss.backward();
        opt.step();
      }
      const auto want = ref->parameters(), got = net->parameters();
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        INFO("parameter " << i << " " << shape_str(got[i].shape()));
        REQUIRE(got[i].dtype() == kFloat32);  // float32 master weights
        REQUIRE(got[i].grad().dtype() == kFloat32);
        CHECK(rel_error(got[i], want[i]) <= 2e-2);
      }
      // And bfloat16 did run: the weights are not the float32 ones to float32 precision.
      CHECK(rel_error(got[0], want[0]) > 1e-6);
    }
  }
}
