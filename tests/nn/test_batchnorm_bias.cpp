// A convolution's bias added inside the batch norm after it (Note [conv bias in batch norm] in
// kernels/cuda/batchnorm.cuh): batch_norm_bias against the two ops -- the conv's bias add, then
// batch_norm or batch_norm_relu, the bias gradient from the conv's own backward -- bit for bit
// (output, every gradient, running statistics) on each device, in both memory formats, in
// float32, float64 and bfloat16, train and eval, with the ReLU and without; a float64
// gradcheck; Residual and a ResNet stem with fuse_conv_bias() on equal to it off, and the nodes
// that ran; and a bias of the wrong shape, dtype or device named.
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/gradcheck_util.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
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
  Tensor y, dz, dbias, dgamma, dbeta, running_mean, running_var;
};

struct BnCase {
  bool training, relu;
};

Tensor grad_leaf(const Tensor& t) {
  Tensor l = t.detach().clone();
  l.set_requires_grad(true);
  return l;
}

// Batch norm of z + bias, fused (batch_norm_bias) or as the two ops, then a backward of dy (none
// when dy is undefined). The two ops: z + bias elementwise in z's dtype (the add of the conv's
// bias: AddBias on CUDA, conv.cpp's on the CPU), batch_norm or batch_norm_relu of that, and the
// bias gradient that a 1x1 convolution's own backward computes from the batch norm's dx (12
// input channels: cuDNN's path, not Note [direct convolution]'s).
Run bn_bias(const Tensor& z0, const Tensor& bias0, const Tensor& gamma0, const Tensor& beta0, const Tensor& rm0,
            const Tensor& rv0, const Tensor& dy, BnCase k, bool fused) {
  Tensor gamma = grad_leaf(gamma0), beta = grad_leaf(beta0);
  Run r;
  r.running_mean = rm0.clone();
  r.running_var = rv0.clone();
  if (fused) {
    Tensor z = grad_leaf(z0), bias = grad_leaf(bias0);
    r.y = batch_norm_bias(z, bias, gamma, beta, r.running_mean, r.running_var, k.training, 0.1, 1e-5, k.relu);
    if (!dy.defined()) return r;
    r.y.backward(dy);
    r.dz = z.grad(), r.dbias = bias.grad();
  } else {
    const int64_t c = z0.size(1);
    Tensor x = grad_leaf(kernels::binary(BinaryOp::Add, z0, bias0.reshape({1, c, 1, 1})));
    r.y = k.relu ? batch_norm_relu(x, gamma, beta, r.running_mean, r.running_var, k.training, 0.1, 1e-5)
                 : batch_norm(x, gamma, beta, r.running_mean, r.running_var, k.training, 0.1, 1e-5);
    if (!dy.defined()) return r;
    r.y.backward(dy);
    r.dz = x.grad();
    const Shape& s = z0.shape();
    const Tensor conv_in =
        zeros({s[0], 12, s[2], s[3]}, z0.dtype(), z0.device()).contiguous(suggest_memory_format(z0));
    r.dbias = kernels::conv2d_backward_weight(conv_in, r.dz, {}, {c, 12, 1, 1}, true).second;
  }
  r.dgamma = gamma.grad(), r.dbeta = beta.grad();
  return r;
}

// The names of every node of the graph that produced y.
std::set<std::string> node_names(const Tensor& y) {
  std::set<std::string> names;
  std::set<const autograd::Node*> seen;
  std::vector<std::shared_ptr<autograd::Node>> todo{autograd::meta(y).grad_fn};
  while (!todo.empty()) {
    const std::shared_ptr<autograd::Node> n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n.get()).second) continue;
    names.insert(n->name());
    for (const autograd::Edge& e : n->next_edges) todo.push_back(e.node);
  }
  return names;
}

// A ResNet stem as models/resnet.cpp builds it, then a conv without a bias (not fused) and a
// conv -> batch norm with nothing after it.
std::shared_ptr<nn::SequentialImpl> stem(int64_t in, Generator& gen) {
  return std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Conv2d>(in, 16, 3, 1, 1, true, gen), std::make_shared<nn::BatchNorm2d>(16),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Conv2d>(16, 16, 3, 1, 1, false, gen),
      std::make_shared<nn::BatchNorm2d>(16), std::make_shared<nn::Conv2d>(16, 12, 3, 1, 0, true, gen),
      std::make_shared<nn::BatchNorm2d>(12)});
}

}  // namespace

TEST_CASE("batch_norm_bias is the conv's bias add then batch_norm, bit for bit", "[nn][cuda]") {
  manual_seed(47);
  for (const Device d : test::test_devices()) {
    for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
      const DType pt = dt == kBFloat16 ? kFloat32 : dt;  // bfloat16 activations keep float32 parameters
      // Small; HW a multiple of every vector width and C past one channels-last tile; and enough
      // images per channel that the CUDA reductions split into several groups.
      for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{4, 40, 6, 8}, Shape{16, 3, 32, 32}}) {
        for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
          for (BnCase k : {BnCase{true, false}, BnCase{true, true}, BnCase{false, false},
                           BnCase{false, true}}) {
            INFO("on " << d.str() << ", " << dtype_name(dt) << " z " << shape_str(shape)
                       << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : "")
                       << (k.training ? ", training" : ", eval") << (k.relu ? ", relu" : ""));
            const int64_t c = shape[1];
            const Tensor z = uniform(shape, -2.0, 2.0).to(dt).contiguous(fmt).to(d);
            // A bias of the size of z's spread: it moves the statistics, and z + bias rounds.
            const Tensor bias = uniform({c}, -1.5, 1.5).to(dt).to(d);
            const Tensor gamma = uniform({c}, 0.5, 1.5).to(pt).to(d);
            const Tensor beta = uniform({c}, -0.5, 0.5).to(pt).to(d);
            const Tensor rm = uniform({c}, -0.5, 0.5).to(pt).to(d), rv = uniform({c}, 0.5, 2.0).to(pt).to(d);
            // Eval mode has no bfloat16 backward (its gradient is an elementwise product with
            // the float32 scale): the forward alone there.
            const bool backward = k.training || dt != kBFloat16;
            const Tensor dy = backward ? uniform(shape, -1.0, 1.0).to(dt).contiguous(fmt).to(d) : Tensor();
            const Run two = bn_bias(z, bias, gamma, beta, rm, rv, dy, k, false);
            const Run one = bn_bias(z, bias, gamma, beta, rm, rv, dy, k, true);
            const std::vector<double> y = values(one.y);
            REQUIRE(y == values(two.y));
            CHECK(one.y.is_contiguous(fmt));
            if (k.relu) {  // the ReLU did something: some outputs are zero, some are not
              const size_t zeros_seen = test::zeros_in(y);
              CHECK(zeros_seen > y.size() / 10);
              CHECK(zeros_seen < y.size() * 9 / 10);
            }
            CHECK(values(one.running_mean) == values(two.running_mean));
            CHECK(values(one.running_var) == values(two.running_var));
            if (k.training) {  // the bias reached the statistics
              const Run unbiased = bn_bias(z, zeros({c}, dt, d), gamma, beta, rm, rv, Tensor(), k, true);
              CHECK(values(one.running_mean) != values(unbiased.running_mean));
            }
            if (!backward) continue;
            CHECK(values(one.dz) == values(two.dz));
            CHECK(values(one.dbias) == values(two.dbias));
            CHECK(values(one.dgamma) == values(two.dgamma));
            CHECK(values(one.dbeta) == values(two.dbeta));
            CHECK(one.dbias.dtype() == dt);
          }
        }
      }
    }
  }
}

TEST_CASE("gradcheck batch_norm_bias train and eval, with and without the ReLU", "[autograd]") {
  manual_seed(53);
  Tensor z = leaf({4, 3, 2, 3}, -2.0, 2.0), bias = leaf({3});
  Tensor gamma = leaf({3}, 0.5, 1.5), beta = leaf({3});
  Tensor rmean = uniform({3}, -0.5, 0.5, kFloat64), rvar = uniform({3}, 0.5, 2.0, kFloat64);
  for (bool training : {true, false}) {
    for (bool relu : {false, true}) {
      INFO("training " << training << ", relu " << relu);
      check_gradients(
          [&](const V& in) {
            return batch_norm_bias(in[0], in[1], in[2], in[3], rmean, rvar, training, 0.1, 1e-5, relu);
          },
          {z, bias, gamma, beta});
    }
  }
}

TEST_CASE("Residual and a ResNet stem with the conv bias fused equal them unfused", "[nn][cuda]") {
  // Note [direct convolution]'s layers (a stem's few input channels, packed NCHW float32) sum
  // their bias gradient in their own kernel, not in the bits the fused op gives (Note [conv
  // bias in batch norm]): off here, on in the channels-last and bfloat16 runs it never takes.
  const test::SettingRestore direct(set_direct_conv, direct_conv);
  set_direct_conv(false);
  for (const Device d : test::test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("on " << d.str() << (fmt == MemoryFormat::ChannelsLast ? ", channels-last" : ""));
      for (bool fuse_relu : {true, false}) {
        INFO("fuse_bn_relu " << fuse_relu);
        const test::SettingRestore restore(set_fuse_bn_relu, fuse_bn_relu);
        set_fuse_bn_relu(fuse_relu);
        Generator gen(11);
        check_fusion_changes_nothing(std::make_shared<nn::Residual>(3, 16, true, 2, gen),
                                     uniform({2, 3, 8, 8}, -1.0, 1.0, kFloat32), d, set_fuse_conv_bias,
                                     fuse_conv_bias, fmt);
        check_fusion_changes_nothing(std::make_shared<nn::Residual>(16, 16, false, 1, gen),
                                     uniform({2, 16, 6, 6}, -1.0, 1.0, kFloat32), d, set_fuse_conv_bias,
                                     fuse_conv_bias, fmt);
        check_fusion_changes_nothing(stem(3, gen), uniform({3, 3, 9, 9}, -1.0, 1.0, kFloat32), d,
                                     set_fuse_conv_bias, fuse_conv_bias, fmt);
      }
      // Under autocast: the bias cast to bfloat16 as conv2d casts it, its gradient back to
      // float32. Bit for bit on a GPU, whose bfloat16 convolution rounds and then adds the bias
      // in bfloat16 as the fused op does; the CPU's adds it before rounding (Note [bfloat16 on
      // the CPU] in kernels/cpu/conv.cpp), so there the two differ by a rounding.
      INFO("autocast");
      const AutocastGuard autocast;
      Generator gen(13);
      if (!d.is_cuda()) {
        const test::SettingRestore restore(set_fuse_conv_bias, fuse_conv_bias);
        nn::Residual fused(3, 16, true, 2, gen);
        const std::shared_ptr<nn::Module> plain = fused.clone();
        fused.to(fmt);
        plain->to(fmt);
        const Tensor x = uniform({2, 3, 8, 8}, -1.0, 1.0, kFloat32).contiguous(fmt);
        set_fuse_conv_bias(true);
        const Tensor y1 = fused(x);
        sum(y1).backward();
        set_fuse_conv_bias(false);
        const Tensor y0 = (*plain)(x);
        CHECK(y1.dtype() == kBFloat16);
        CHECK(test::rel_error(y1, y0) <= 1.0 / 64);
        CHECK(fused.conv1().bias().grad().dtype() == kFloat32);
        continue;
      }
      check_fusion_changes_nothing(std::make_shared<nn::Residual>(3, 16, true, 2, gen),
                                   uniform({2, 3, 8, 8}, -1.0, 1.0, kFloat32), d, set_fuse_conv_bias,
                                   fuse_conv_bias, fmt);
      check_fusion_changes_nothing(stem(3, gen), uniform({3, 3, 9, 9}, -1.0, 1.0, kFloat32), d,
                                   set_fuse_conv_bias, fuse_conv_bias, fmt);
    }
  }
}

TEST_CASE("The conv bias fusion runs the batch norm nodes that take the bias", "[nn][cuda]") {
  const test::SettingRestore restore_bias(set_fuse_conv_bias, fuse_conv_bias);
  const test::SettingRestore restore_relu(set_fuse_bn_relu, fuse_bn_relu);
  const test::SettingRestore restore_join(set_fuse_bn_add_relu, fuse_bn_add_relu);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    set_fuse_bn_add_relu(false);  // the block's second batch norm on its own, then the join
    Generator gen(17);
    const Tensor x = uniform({2, 3, 6, 6}, -1.0, 1.0, kFloat32).to(d);
    auto names = [&](nn::Module& m) {
      m.to(d);
      return node_names(m(x));
    };
    nn::Residual block(3, 16, true, 2, gen);
    const std::shared_ptr<nn::SequentialImpl> s = stem(3, gen);
    set_fuse_bn_relu(true);
    set_fuse_conv_bias(true);
    auto got = names(block);
    CHECK(got.count("BatchNormBiasRelu") == 1);  // conv1 -> bn1 -> relu
    CHECK(got.count("BatchNormBias") == 1);      // conv2 -> bn2
    CHECK(got.count("BatchNorm") == 0);
    got = names(*s);
    CHECK(got.count("BatchNormBiasRelu") == 1);  // the stem
    CHECK(got.count("BatchNorm") == 1);          // the conv without a bias: nothing to fuse
    CHECK(got.count("BatchNormBias") == 1);      // the last conv -> batch norm
    set_fuse_bn_relu(false);
    got = names(block);
    CHECK(got.count("BatchNormBias") == 1);  // both batch norms, the ReLU its own op
    CHECK(got.count("Relu") == 1);
    CHECK(got.count("BatchNormBiasRelu") == 0);
    block.eval();
    CHECK(names(block).count("BatchNormBiasEval") == 1);
    block.train();
    set_fuse_conv_bias(false);
    got = names(block);
    CHECK(got.count("BatchNorm") == 1);
    CHECK(got.count("BatchNormBias") == 0);
    set_fuse_bn_relu(true);
    CHECK(names(*s).count("BatchNormRelu") == 1);
    CHECK(names(*s).count("BatchNormBiasRelu") == 0);
    // With the join fused too, the second batch norm takes the bias and the shortcut.
    set_fuse_conv_bias(true);
    set_fuse_bn_add_relu(true);
    got = names(block);
    CHECK(got.count("BatchNormBiasRelu") == 1);
    CHECK(got.count("BatchNormBiasAddRelu") == 1);
    CHECK(got.count("AddRelu") == 0);
  }
}

TEST_CASE("batch norm names a conv bias of the wrong shape, dtype or device", "[kernels]") {
  const Tensor x = uniform({4, 3, 2, 2}, -1.0, 1.0), dy = uniform({4, 3, 2, 2}, -1.0, 1.0);
  const Tensor rm = zeros({3}), rv = ones({3}), mean = zeros({3}), invstd = ones({3});
  std::string msg = test::error_message<ShapeError>(
      [&] { kernels::batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5, false, zeros({4})); });
  CHECK(test::contains(msg, "bias"));
  CHECK(test::contains(msg, shape_str({4})));
  msg = test::error_message<ShapeError>(
      [&] { kernels::batch_norm_eval(x, Tensor(), Tensor(), rm, rv, 1e-5, false, zeros({3, 1})); });
  CHECK(test::contains(msg, shape_str({3, 1})));
  msg = test::error_message<ShapeError>(
      [&] { kernels::batch_norm_backward(dy, x, Tensor(), mean, invstd, Tensor(), zeros({2}), true); });
  CHECK(test::contains(msg, "bias"));
  // The bias is the conv's, in the activations' dtype -- bfloat16 under autocast, where the
  // per-channel tensors are float32.
  const auto train_with = [&](const Tensor& bias) {
    kernels::batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5, false, bias);
  };
  msg = test::error_message<DTypeError>([&] { train_with(zeros({3}, kFloat64)); });
  CHECK(test::contains(msg, "bias"));
  CHECK(test::contains(msg, "float64"));
  const Tensor xb = x.to(kBFloat16);
  test::error_message<DTypeError>(
      [&] { kernels::batch_norm_eval(xb, Tensor(), Tensor(), rm, rv, 1e-5, false, zeros({3})); });
  test::error_message<DeviceError>([&] { train_with(zeros({3}).to(Device::cpu(1))); });
  // The differentiable op takes a conv's [N, C, H, W] output and a bias.
  const Tensor x2 = uniform({4, 3}, -1.0, 1.0);
  test::error_message<ShapeError>(
      [&] { batch_norm_bias(x2, zeros({3}), Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5); });
  test::error_message<ValueError>(
      [&] { batch_norm_bias(x, Tensor(), Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5); });
  nn::BatchNorm2d bn(3);
  test::error_message<ShapeError>([&] { bn.forward_biased(x, zeros({5})); });
}

// num_batches_tracked counted by the op that updates the running statistics (Note [the batch
// count in the statistics' finish] in kernels/cuda/batchnorm.cu): every training form adds 1,
// eval adds nothing, a BatchNorm2d counts the same through each fused forward.
TEST_CASE("The batch norm ops add 1 to a num_batches_tracked they are given, in training only", "[nn][cuda]") {
  manual_seed(47);
  for (const Device d : test::test_devices()) {
    for (MemoryFormat fmt : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
      INFO("on " << d.str() << (fmt == MemoryFormat::ChannelsLast ? " channels-last" : ""));
      const Tensor x = uniform({4, 3, 5, 6}, -2.0, 2.0).contiguous(fmt).to(d);
      const Tensor res = uniform({4, 3, 5, 6}, -1.0, 1.0).contiguous(fmt).to(d);
      const Tensor b = uniform({3}, -0.5, 0.5).to(d);
      const Tensor rm = zeros({3}, kFloat32, d), rv = ones({3}, kFloat32, d);
      const Tensor count = zeros({}, kInt64, d);
      batch_norm(x, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, count);
      CHECK(count.item() == 1.0);
      batch_norm_relu(x, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, count);
      batch_norm_bias(x, b, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, true, count);
      batch_norm_add_relu(x, res, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, b, count);
      batch_norm_add_relu(x, res, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5, Tensor(), count);
      CHECK(count.item() == 5.0);
      // Eval counts nothing; without the argument nothing is counted either.
      batch_norm(x, Tensor(), Tensor(), rm, rv, false, 0.1, 1e-5, count);
      batch_norm_add_relu(x, res, Tensor(), Tensor(), rm, rv, false, 0.1, 1e-5, b, count);
      batch_norm(x, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5);
      CHECK(count.item() == 5.0);
      // The module through its fused forwards (and the bfloat16 path of each device).
      nn::BatchNorm2d bn(3);
      bn.to(d);
      bn(x);
      bn.forward_relu(x.to(kBFloat16));
      bn.forward_biased(x, b, true);
      bn.forward_add_relu(x, res, b);
      CHECK(bn.num_batches_tracked().item() == 4.0);
      bn.eval();
      bn.forward_add_relu(x, res, b);
      CHECK(bn.num_batches_tracked().item() == 4.0);
    }
  }
}

TEST_CASE("batch norm names a num_batches_tracked of the wrong dtype, shape or device", "[kernels]") {
  const Tensor x = uniform({4, 3, 2, 2}, -1.0, 1.0), rm = zeros({3}), rv = ones({3});
  const auto train_with = [&](const Tensor& count) {
    kernels::batch_norm_train(x, Tensor(), Tensor(), rm, rv, 0.1, 1e-5, false, Tensor(), Tensor(), count);
  };
  std::string msg = test::error_message<DTypeError>([&] { train_with(zeros({}, kFloat32)); });
  CHECK(test::contains(msg, "num_batches_tracked"));
  CHECK(test::contains(msg, "float32"));
  msg = test::error_message<ShapeError>([&] { train_with(zeros({2}, kInt64)); });
  CHECK(test::contains(msg, "num_batches_tracked"));
  CHECK(test::contains(msg, shape_str({2})));
  test::error_message<DeviceError>([&] { train_with(zeros({}, kInt64, Device::cpu(1))); });
  // Nothing counted by a call that failed, before or after its checks.
  const Tensor count = zeros({}, kInt64);
  test::error_message<ShapeError>([&] {
    kernels::batch_norm_train(uniform({4, 2, 2, 2}, -1.0, 1.0), Tensor(), Tensor(), rm, rv, 0.1, 1e-5, false,
                              Tensor(), Tensor(), count);
  });
  CHECK(count.item() == 0.0);
}
