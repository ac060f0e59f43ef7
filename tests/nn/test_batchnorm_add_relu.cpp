// Batch norm + residual join as one op (Note [batch norm + residual join] in
// kernels/cuda/batchnorm.cu): the same bits as add_relu(batch_norm(x), residual) -- output,
// running statistics and every gradient, the residual's included -- on each device, in both
// memory formats, in float32, float64 and bfloat16, with a conv bias and without; a float64
// gradcheck; Residual blocks with the fusion on equal to it off; and bad residuals named.
#include <memory>
#include <string>
#include <vector>

#include "autograd/gradcheck_util.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
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
  Tensor y, dx, dres, dgamma, dbeta, dbias, running_mean, running_var;
};

Tensor grad_leaf(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor c = t.detach().clone();
  c.set_requires_grad(true);
  return c;
}

// Training-mode batch norm (of x + bias when bias is defined) joined with a residual, fused or
// as the ops it replaces, then a backward of dy.
Run bn_add_relu(const Tensor& x0, const Tensor& res0, const Tensor& gamma0, const Tensor& beta0,
                const Tensor& bias0, const Tensor& dy, bool fused) {
  const Tensor x = grad_leaf(x0), res = grad_leaf(res0), gamma = grad_leaf(gamma0), beta = grad_leaf(beta0),
               bias = grad_leaf(bias0);
  Run r;
  r.running_mean = zeros({gamma.numel()}, gamma.dtype(), gamma.device());
  r.running_var = ones({gamma.numel()}, gamma.dtype(), gamma.device());
  if (fused) {
    r.y = batch_norm_add_relu(x, res, gamma, beta, r.running_mean, r.running_var, true, 0.1, 1e-5, bias);
  } else {
    const Tensor bn = bias.defined()
                          ? batch_norm_bias(x, bias, gamma, beta, r.running_mean, r.running_var, true, 0.1, 1e-5)
                          : batch_norm(x, gamma, beta, r.running_mean, r.running_var, true, 0.1, 1e-5);
    r.y = add_relu(bn, res);
  }
  r.y.backward(dy);
  r.dx = x.grad(), r.dres = res.grad(), r.dgamma = gamma.grad(), r.dbeta = beta.grad();
  if (bias.defined()) r.dbias = bias.grad();
  return r;
}

}  // namespace

TEST_CASE("batch_norm_add_relu is add_relu(batch_norm, residual) bit for bit, forward and backward", "[nn][cuda]") {
  manual_seed(47);
  for (const Device d : test::test_devices()) {
    for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
      const DType pt = dt == kBFloat16 ? kFloat32 : dt;  // bfloat16 activations keep float32 parameters
      for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{9, 3}, Shape{16, 64, 4, 4}}) {
        for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
          if (fmt == MemoryFormat::ChannelsLast && shape.size() != 4) continue;
          for (const bool biased : {false, true}) {
            if (biased && shape.size() != 4) continue;
            INFO("on " << d.str() << ", " << dtype_name(dt) << " x " << shape_str(shape)
                       << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : "") << (biased ? ", biased" : ""));
            const int64_t c = shape[1];
            const Tensor x = uniform(shape, -2.0, 2.0).to(dt).contiguous(fmt).to(d);
            const Tensor res = uniform(shape, -1.5, 1.5).to(dt).contiguous(fmt).to(d);
            const Tensor dy = uniform(shape, -1.0, 1.0).to(dt).contiguous(fmt).to(d);
            const Tensor gamma = uniform({c}, 0.5, 1.5).to(pt).to(d), beta = uniform({c}, -0.5, 0.5).to(pt).to(d);
            const Tensor bias = biased ? uniform({c}, -0.5, 0.5).to(dt).to(d) : Tensor();
            const Run two = bn_add_relu(x, res, gamma, beta, bias, dy, false);
            const Run one = bn_add_relu(x, res, gamma, beta, bias, dy, true);
            const std::vector<double> y = values(one.y);
            REQUIRE(y == values(two.y));
            // The join did something: some outputs are zero, some are not.
            const size_t zeros_seen = test::zeros_in(y);
            CHECK(zeros_seen > y.size() / 10);
            CHECK(zeros_seen < y.size() * 9 / 10);
            CHECK(values(one.dx) == values(two.dx));
            CHECK(values(one.dres) == values(two.dres));
            CHECK(values(one.dgamma) == values(two.dgamma));
            CHECK(values(one.dbeta) == values(two.dbeta));
            if (biased) CHECK(values(one.dbias) == values(two.dbias));
            CHECK(values(one.running_mean) == values(two.running_mean));
            CHECK(values(one.running_var) == values(two.running_var));
            CHECK(one.y.is_contiguous(fmt));
            CHECK(autograd::meta(one.y).grad_fn->name() == (biased ? "BatchNormBiasAddRelu" : "BatchNormAddRelu"));
          }
        }
      }
    }
  }
}

TEST_CASE("gradcheck batch_norm_add_relu train and eval", "[autograd]") {
  manual_seed(53);
  Tensor x = leaf({4, 3, 2, 3}, -2.0, 2.0), res = leaf({4, 3, 2, 3}, -1.0, 1.0);
  Tensor gamma = leaf({3}, 0.5, 1.5), beta = leaf({3}), bias = leaf({3});
  Tensor rmean = uniform({3}, -0.5, 0.5, kFloat64), rvar = uniform({3}, 0.5, 2.0, kFloat64);
  for (bool training : {true, false}) {
    INFO("training " << training);
    check_gradients(
        [&](const V& in) {
          return batch_norm_add_relu(in[0], in[1], in[2], in[3], rmean, rvar, training, 0.1, 1e-5, in[4]);
        },
        {x, res, gamma, beta, bias});
  }
}

TEST_CASE("Residual with batch norm + residual join fused equals it unfused", "[nn][cuda]") {
  for (const Device d : test::test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("on " << d.str() << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : ""));
      Generator gen(5);
      // A block with a 1x1 convolution on the shortcut, and one with the identity.
      check_fusion_changes_nothing(std::make_shared<nn::Residual>(3, 4, true, 2, gen),
                                   uniform({2, 3, 6, 6}, -1.0, 1.0, kFloat32), d, set_fuse_bn_add_relu,
                                   fuse_bn_add_relu, fmt);
      check_fusion_changes_nothing(std::make_shared<nn::Residual>(4, 4, false, 1, gen),
                                   uniform({2, 4, 5, 5}, -1.0, 1.0, kFloat32), d, set_fuse_bn_add_relu,
                                   fuse_bn_add_relu, fmt);
    }
    // What ran: the fused node at the end of the block, or the join's own.
    const test::SettingRestore restore(set_fuse_bn_add_relu, fuse_bn_add_relu);
    Generator gen(6);
    nn::Residual block(4, 4, false, 1, gen);
    block.to(d);
    Tensor h = uniform({2, 4, 3, 3}, -1.0, 1.0, kFloat32).to(d);
    h.set_requires_grad(true);
    set_fuse_bn_add_relu(true);
    CHECK(autograd::meta(block(h)).grad_fn->name().find("AddRelu") != std::string::npos);
    CHECK(autograd::meta(block(h)).grad_fn->name() != "AddRelu");
    set_fuse_bn_add_relu(false);
    CHECK(autograd::meta(block(h)).grad_fn->name() == "AddRelu");
  }
}

TEST_CASE("batch_norm_add_relu names a residual of the wrong shape, dtype or device, and relu off", "[kernels]") {
  const Tensor x = uniform({4, 3}, -1.0, 1.0), gamma = ones({3}), beta = zeros({3});
  const Tensor rm = zeros({3}), rv = ones({3});
  const std::string shape_msg = test::error_message<ShapeError>(
      [&] { kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5, true, Tensor(), zeros({4, 2})); });
  CHECK(test::contains(shape_msg, "residual"));
  CHECK(test::contains(shape_msg, shape_str({4, 2})));
  test::error_message<DTypeError>(
      [&] { kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5, true, Tensor(), zeros({4, 3}, kFloat64)); });
  CHECK(test::contains(
      test::error_message<ValueError>(
          [&] { kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5, false, Tensor(), zeros({4, 3})); }),
      "relu"));
  CHECK(test::contains(test::error_message<ValueError>([&] {
                         batch_norm_add_relu(x, Tensor(), gamma, beta, rm, rv, true, 0.1, 1e-5);
                       }),
                       "residual"));
#ifdef TANDEM_WITH_CUDA
  if (test::have_cuda()) {
    test::error_message<DeviceError>([&] {
      kernels::batch_norm_train(x, gamma, beta, rm, rv, 0.1, 1e-5, true, Tensor(), zeros({4, 3}).to(Device::cuda(0)));
    });
  }
#endif
}

// Note [programmatic dependent launch] in kernels/cuda/common.cuh: the kernels that may launch
// before the one before them finishes wait for it before they touch memory, so a block's forward,
// running statistics and every gradient are the same bits either way (on a GPU; on the CPU the
// setting changes nothing).
TEST_CASE("A Residual block gives the same bits with programmatic launches on and off", "[nn][cuda]") {
  {
    const test::SettingRestore restore(set_programmatic_launch, programmatic_launch);
    set_programmatic_launch(false);
    CHECK_FALSE(programmatic_launch());
    set_programmatic_launch(true);
    CHECK(programmatic_launch());
  }
  for (const Device d : test::test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("on " << d.str() << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : ""));
      Generator gen(7);
      check_fusion_changes_nothing(std::make_shared<nn::Residual>(3, 4, true, 2, gen),
                                   uniform({4, 3, 8, 8}, -1.0, 1.0, kFloat32), d, set_programmatic_launch,
                                   programmatic_launch, fmt);
    }
  }
}
