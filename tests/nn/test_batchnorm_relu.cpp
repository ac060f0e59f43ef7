// Batch norm + ReLU as one op (Note [batch norm + ReLU] in kernels/backend.h): the same bits as
// relu(batch_norm(x)) -- output, running statistics and every gradient -- on each device, in
// both memory formats and in float32, float64 and bfloat16; a float64 gradcheck; Residual with
// the fusion on equal to it off; and a mask of the wrong shape named.
#include <memory>
#include <string>
#include <vector>

#include "autograd/gradcheck_util.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "autograd/node.h"
#include "nn/activation.h"
#include "nn/batchnorm.h"
#include "nn/container.h"
#include "nn/conv.h"
#include "nn/residual.h"
#include "nn_test_util.h"

using namespace tandem;
using tandem::test::check_fusion_changes_nothing;
using tandem::test::check_gradients;
using tandem::test::leaf;
using tandem::test::values;
using V = std::vector<Tensor>;

namespace {

struct Run {
  Tensor y, dx, dgamma, dbeta, running_mean, running_var;
};

// Training-mode batch norm and ReLU on x, fused or as two ops, then a backward of dy.
Run bn_relu(const Tensor& x0, const Tensor& gamma0, const Tensor& beta0, const Tensor& dy, bool fused) {
  Tensor x = x0.detach().clone();
  x.set_requires_grad(true);
  Tensor gamma = gamma0.detach().clone(), beta = beta0.detach().clone();
  gamma.set_requires_grad(true);
  beta.set_requires_grad(true);
  Run r;
  r.running_mean = zeros({gamma.numel()}, gamma.dtype(), gamma.device());
  r.running_var = ones({gamma.numel()}, gamma.dtype(), gamma.device());
  r.y = fused ? batch_norm_relu(x, gamma, beta, r.running_mean, r.running_var, true, 0.1, 1e-5)
              : relu(batch_norm(x, gamma, beta, r.running_mean, r.running_var, true, 0.1, 1e-5));
  r.y.backward(dy);
  r.dx = x.grad(), r.dgamma = gamma.grad(), r.dbeta = beta.grad();
  return r;
}

}  // namespace

TEST_CASE("batch_norm_relu is relu(batch_norm) bit for bit, forward and backward", "[nn][cuda]") {
  manual_seed(41);
  for (const Device d : test::test_devices()) {
    for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
      const DType pt = dt == kBFloat16 ? kFloat32 : dt;  // bfloat16 activations keep float32 parameters
      for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{9, 3}}) {
        for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
          if (fmt == MemoryFormat::ChannelsLast && shape.size() != 4) continue;
          INFO("on " << d.str() << ", " << dtype_name(dt) << " x " << shape_str(shape)
                     << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : ""));
          const Tensor x = uniform(shape, -2.0, 2.0).to(dt).contiguous(fmt).to(d);
          const Tensor dy = uniform(shape, -1.0, 1.0).to(dt).contiguous(fmt).to(d);
          const Tensor gamma = uniform({3}, 0.5, 1.5).to(pt).to(d), beta = uniform({3}, -0.5, 0.5).to(pt).to(d);
          const Run two = bn_relu(x, gamma, beta, dy, false), one = bn_relu(x, gamma, beta, dy, true);
          const std::vector<double> y = values(one.y);
          REQUIRE(y == values(two.y));
          // The ReLU did something: some outputs are zero, some are not.
          const size_t zeros_seen = test::zeros_in(y);
          CHECK(zeros_seen > y.size() / 5);
          CHECK(zeros_seen < y.size() * 4 / 5);
          CHECK(values(one.dx) == values(two.dx));
          CHECK(values(one.dgamma) == values(two.dgamma));
          CHECK(values(one.dbeta) == values(two.dbeta));
          CHECK(values(one.running_mean) == values(two.running_mean));
          CHECK(values(one.running_var) == values(two.running_var));
          CHECK(one.y.is_contiguous(fmt));
        }
      }
    }
  }
}

TEST_CASE("gradcheck batch_norm_relu train and eval", "[autograd]") {
  manual_seed(43);
  Tensor x = leaf({4, 3, 2, 3}, -2.0, 2.0);
  Tensor gamma = leaf({3}, 0.5, 1.5), beta = leaf({3});
  Tensor rmean = uniform({3}, -0.5, 0.5, kFloat64), rvar = uniform({3}, 0.5, 2.0, kFloat64);
  for (bool training : {true, false}) {
    INFO("training " << training);
    check_gradients(
        [&](const V& in) { return batch_norm_relu(in[0], in[1], in[2], rmean, rvar, training, 0.1, 1e-5); },
        {x, gamma, beta});
  }
}

TEST_CASE("Residual with batch norm + ReLU fused equals it unfused", "[nn][cuda]") {
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    Generator gen(5);
    check_fusion_changes_nothing(std::make_shared<nn::Residual>(3, 4, true, 2, gen),
                                 uniform({2, 3, 6, 6}, -1.0, 1.0, kFloat32), d, set_fuse_bn_relu, fuse_bn_relu);
  }
}

TEST_CASE("A Sequential runs its BatchNorm2d and the ReLU after it as one op", "[nn][cuda]") {
  const test::SettingRestore restore(set_fuse_bn_relu, fuse_bn_relu);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    Generator gen(9);
    // BN -> ReLU (fused), BN -> Conv (not), and a BN at the end (nothing after it).
    check_fusion_changes_nothing(
        std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{
            std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, true, gen), std::make_shared<nn::BatchNorm2d>(4),
            std::make_shared<nn::ReLU>(), std::make_shared<nn::BatchNorm2d>(4),
            std::make_shared<nn::Conv2d>(4, 2, 3, 1, 0, true, gen), std::make_shared<nn::BatchNorm2d>(2)}),
        uniform({3, 1, 7, 7}, -1.0, 1.0, kFloat32), d, set_fuse_bn_relu, fuse_bn_relu);
    // What ran: one fused node for BN -> ReLU, the plain one otherwise.
    nn::SequentialImpl pair({std::make_shared<nn::BatchNorm2d>(4), std::make_shared<nn::ReLU>()});
    pair.to(d);
    Tensor h = uniform({2, 4, 3, 3}, -1.0, 1.0, kFloat32).to(d);
    h.set_requires_grad(true);
    set_fuse_bn_relu(true);
    CHECK(autograd::meta(pair(h)).grad_fn->name() == "BatchNormRelu");
    set_fuse_bn_relu(false);
    CHECK(autograd::meta(pair(h)).grad_fn->name() == "Relu");
  }
}

TEST_CASE("batch_norm_backward names a ReLU mask of the wrong shape or dtype", "[kernels]") {
  const Tensor x = uniform({4, 3}, -1.0, 1.0), dy = uniform({4, 3}, -1.0, 1.0);
  const Tensor mean = zeros({3}), invstd = ones({3});
  const std::string msg = test::error_message<ShapeError>(
      [&] { kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, zeros({4, 2})); });
  CHECK(test::contains(msg, "relu_out"));
  CHECK(test::contains(msg, shape_str({4, 2})));
  test::error_message<DTypeError>(
      [&] { kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, zeros({4, 3}, kFloat64)); });
  // The masked gradient without a mask to take it from.
  CHECK(test::contains(test::error_message<ValueError>([&] {
                         kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), Tensor(), false,
                                                      Tensor(), Tensor(), true);
                       }),
                       "relu_out is undefined"));
}
