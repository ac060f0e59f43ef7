// Memory formats (Note [memory formats] in core/tensor.h): channels-last strides and
// contiguity, the ops that keep the format, and channels-last results equal to the contiguous
// ones on the CPU (which computes through contiguous copies) and on the GPU (own channels-last
// kernels and cuDNN's NHWC convolutions).
#include <memory>
#include <numeric>
#include <vector>

#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "catch.h"
#include "core/error.h"
#include "core/generator.h"
#include "core/tensor.h"
#include "helpers.h"
#include "kernels/backend.h"
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
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::rel_error;
using tandem::test::values;

namespace {

constexpr MemoryFormat kCL = MemoryFormat::ChannelsLast;

Tensor iota(const Shape& shape) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.0);
  return from_vector(v, shape);
}

// t with exactly the channels-last strides (contiguous(kCL) keeps a tensor that is laid out
// both ways, such as a [K, 1, 3, 3] or [K, C, 1, 1] weight, as it is).
Tensor cl(const Tensor& t) { return restrided(t, kCL); }
bool is_cl(const Tensor& t) { return suggest_memory_format(t) == kCL; }


// A small ResNet-like model: stem convolution (one input channel), batch norm, ReLU, a
// downsampling residual block with a 1x1 shortcut, an identity block, pooling, a classifier.
std::shared_ptr<nn::SequentialImpl> small_resnet(uint64_t seed) {
  Generator gen(seed);
  using namespace nn;
  return std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, gen), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(), std::make_shared<Residual>(8, 16, true, 2, gen),
      std::make_shared<Residual>(16, 16, false, 1, gen), std::make_shared<GlobalAvgPool2d>(),
      std::make_shared<Flatten>(), std::make_shared<Linear>(16, 4, true, gen)});
}

// Three SGD steps (momentum, weight decay) of `net` on one batch; returns the parameters.
std::vector<Tensor> train3(nn::Module& net, const Tensor& x, const Tensor& y) {
  nn::optim::SGD opt(net.parameters(), 0.05, 0.9, 0.0, 1e-4);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    cross_entropy(net(x), y).backward();
    opt.step();
  }
  return net.parameters();
}

}  // namespace

TEST_CASE("channels-last strides, contiguity and the suggested format", "[core][memory_format]") {
  const Shape s{2, 3, 4, 5};
  CHECK(strides_for(s, kCL) == Strides{60, 1, 15, 3});
  CHECK(strides_for(s, MemoryFormat::Contiguous) == contiguous_strides(s));
  Tensor x = iota(s);
  Tensor y = cl(x);
  CHECK(y.strides() == Strides{60, 1, 15, 3});
  CHECK(y.is_contiguous(kCL));
  CHECK_FALSE(y.is_contiguous());
  CHECK_FALSE(x.is_contiguous(kCL));
  CHECK(y.is_non_overlapping_and_dense());
  CHECK(values(y) == values(x));  // the same values, in NCHW index order
  // Element [0, 1, 0, 0] sits right after [0, 0, 0, 0] in memory.
  CHECK(static_cast<const double*>(y.raw_data())[1] == 20.0);
  CHECK(is_cl(y));
  CHECK_FALSE(is_cl(x));
  CHECK(y.contiguous(kCL).same(y));  // already channels-last: no copy
  Tensor back = y.contiguous();
  CHECK(back.is_contiguous());
  CHECK(values(back) == values(x));
  // Copies and new tensors keep the format.
  CHECK(is_cl(y.clone()));
  CHECK(values(y.clone()) == values(x));
  CHECK(is_cl(empty_like(y)));
  CHECK(is_cl(zeros_like(y)));
  CHECK(values(zeros_like(y)) == std::vector<double>(120, 0.0));
  CHECK(is_cl(empty(s, kFloat32, kCPU, kCL)));
  CHECK(is_cl(y.to(kFloat32)));
  // Size-1 dims: a [N, 1, H, W] tensor is laid out both ways and suggests contiguous, unless it
  // was made with exactly the channels-last strides.
  Tensor z = iota({2, 1, 4, 5});
  CHECK(z.is_contiguous(kCL));
  CHECK_FALSE(is_cl(z));
  CHECK(z.contiguous(kCL).same(z));
  CHECK(is_cl(Tensor({2, 1, 4, 5}, kFloat64, kCPU, kCL)));
  // Dense in another order is not channels-last; gaps or broadcasts are not dense.
  Tensor t = x.transpose(0, 3);
  CHECK(t.is_non_overlapping_and_dense());
  CHECK_FALSE(is_cl(t));
  CHECK_FALSE(x.slice(3, 0, 2).is_non_overlapping_and_dense());
  CHECK_FALSE(iota({3, 1}).expand({3, 4}).is_non_overlapping_and_dense());
  // Channels-last needs four dims.
  CHECK_FALSE(iota({2, 3, 4}).is_contiguous(kCL));
  CHECK(contains(error_message<ShapeError>([] { Tensor({2, 3, 4}, kFloat32, kCPU, kCL); }), "4-D"));
  CHECK(contains(error_message<ShapeError>([] { iota({2, 3}).contiguous(kCL); }), "[2,3]"));
}

TEST_CASE("split_views and contiguous_span keep a channels-last layout", "[core][memory_format]") {
  Tensor a = cl(iota({2, 3, 2, 2})), b = iota({5});
  Tensor flat = zeros({29}, kFloat64);
  std::vector<Tensor> views = split_views(flat, {a, b});
  CHECK(views[0].strides() == a.strides());
  CHECK(views[1].strides() == Strides{1});
  CHECK(views[1].offset() == 24);
  views[0].copy_(a);
  CHECK(values(views[0]) == values(a));
  CHECK(values(flat)[1] == values(a)[4]);  // channels-last order in the flat buffer: [0,1,0,0]
  Tensor span = contiguous_span(views);
  REQUIRE(span.defined());
  CHECK(span.numel() == 29);
  // A view of a slice that is not a whole flat buffer is refused by name.
  CHECK(contains(error_message<ShapeError>([&] { split_views(iota({29, 2}).select(1, 0), {a, b}); }),
                 "(strided)"));
  CHECK(contains(error_message<ShapeError>([&] { split_views(zeros({30}, kFloat64), {a, b}); }), "29 elements"));
}

TEST_CASE("elementwise ops keep the channels-last format", "[kernels][memory_format]") {
  Tensor xc = uniform({2, 6, 3, 5}, -1.0, 1.0, kFloat64);
  Tensor yc = uniform({2, 6, 3, 5}, -1.0, 1.0, kFloat64);
  Tensor bias = uniform({6, 1, 1}, -1.0, 1.0, kFloat64);
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    Tensor x = cl(xc.to(d)), y = yc.to(d), b = bias.to(d);
    Tensor r = kernels::unary(UnaryOp::Relu, x);
    CHECK(is_cl(r));
    CHECK(values(r) == values(kernels::unary(UnaryOp::Relu, xc)));
    Tensor s1 = kernels::binary(BinaryOp::Add, x, y), s2 = kernels::binary(BinaryOp::Add, y, x);
    CHECK(is_cl(s1));
    CHECK(is_cl(s2));
    CHECK(values(s1) == values(kernels::binary(BinaryOp::Add, xc, yc)));
    CHECK(values(s2) == values(s1));
    Tensor sb = kernels::binary(BinaryOp::Mul, x, b);  // broadcast [6, 1, 1]
    CHECK(is_cl(sb));
    CHECK(values(sb) == values(kernels::binary(BinaryOp::Mul, xc, bias)));
    Tensor m = kernels::scalar(ScalarOp::Mul, x, 3.0);
    CHECK(is_cl(m));
    CHECK(values(m) == values(kernels::scalar(ScalarOp::Mul, xc, 3.0)));
    CHECK_FALSE(is_cl(kernels::binary(BinaryOp::Add, y, y)));
    // Float32 channels-last with channels that are a multiple of four: the vectorized path.
    Tensor xf = cl(xc.to(d, kFloat32));
    CHECK(values(kernels::binary(BinaryOp::ReluBackward, xf, xf)) ==
          values(kernels::binary(BinaryOp::ReluBackward, xc.to(kFloat32), xc.to(kFloat32))));
  }
}

TEST_CASE("channels-last convolution and batch norm equal the contiguous results",
          "[kernels][memory_format]") {
  struct Case {
    Shape x, w;
    Conv2dParams p;
  };
  const Case cases[] = {
      {{3, 8, 9, 7}, {16, 8, 3, 3}, {1, 1, 1, 1}},   // channels a multiple of the vector width
      {{2, 5, 11, 9}, {7, 5, 3, 3}, {2, 2, 1, 0}},   // and not
      {{4, 1, 12, 12}, {8, 1, 3, 3}, {1, 1, 1, 1}},  // the stem: one input channel
      {{2, 16, 7, 7}, {32, 16, 1, 1}, {2, 2, 0, 0}}, // a 1x1 shortcut
  };
  for (const Device d : test::test_devices()) {
    const bool on_gpu = d.is_cuda();
    for (DType dt : {kFloat64, kFloat32}) {
      for (bool graph : {true, false}) {
        if (!on_gpu && !graph) continue;  // the cuDNN entry point matters on the GPU only
        struct Restore {
          bool prev = cudnn_graph_api();
          ~Restore() { set_cudnn_graph_api(prev); }
        } restore;
        set_cudnn_graph_api(graph);
        for (const Case& c : cases) {
          INFO("on " << d.str() << " " << dtype_name(dt) << " graph api " << graph << " x " << shape_str(c.x)
                     << " w " << shape_str(c.w));
          const double tol = dt == kFloat64 ? 1e-12 : 1e-5;
          Tensor x = uniform(c.x, -1.0, 1.0, dt), w = uniform(c.w, -1.0, 1.0, dt);
          Tensor b = uniform({c.w[0]}, -1.0, 1.0, dt);
          Tensor y = kernels::conv2d(x, w, b, c.p);  // the contiguous CPU reference
          Tensor yl = kernels::conv2d(x.to(d), cl(w.to(d)), b.to(d), c.p);
          CHECK(is_cl(yl));
          CHECK(yl.device() == d);
          CHECK(rel_error(yl, y) <= 4 * tol);
          Tensor dy = uniform(y.shape(), -1.0, 1.0, dt);
          Tensor dx = kernels::conv2d_backward_input(dy, w, c.p, c.x);
          Tensor dxl = kernels::conv2d_backward_input(cl(dy.to(d)), cl(w.to(d)), c.p, c.x);
          CHECK((is_cl(dxl) || c.x[1] == 1));  // one channel: both layouts are the same memory
          CHECK(rel_error(dxl, dx) <= 4 * tol);
          auto [dw, db] = kernels::conv2d_backward_weight(x, dy, c.p, c.w, true);
          auto [dwl, dbl] = kernels::conv2d_backward_weight(cl(x.to(d)), cl(dy.to(d)), c.p, c.w, true);
          CHECK(is_cl(dwl));
          CHECK(rel_error(dwl, dw) <= 4 * tol);
          CHECK(rel_error(dbl, db) <= 4 * tol);

          // Batch norm on the convolution's output: statistics, running statistics, backward.
          const int64_t k = c.w[0];
          Tensor gamma = uniform({k}, 0.5, 1.5, dt), beta = uniform({k}, -0.5, 0.5, dt);
          Tensor rm = zeros({k}, dt), rv = ones({k}, dt);
          Tensor rml = rm.to(d).clone(), rvl = rv.to(d).clone();
          auto r = kernels::batch_norm_train(y, gamma, beta, rm, rv, 0.1, 1e-5);
          auto rl = kernels::batch_norm_train(yl, gamma.to(d), beta.to(d), rml, rvl, 0.1, 1e-5);
          CHECK(is_cl(rl.y));
          CHECK(rel_error(rl.y, r.y) <= 8 * tol);
          CHECK(rel_error(rl.save_mean, r.save_mean) <= 8 * tol);
          CHECK(rel_error(rl.save_invstd, r.save_invstd) <= 8 * tol);
          CHECK(rel_error(rml, rm) <= 8 * tol);
          CHECK(rel_error(rvl, rv) <= 8 * tol);
          auto g = kernels::batch_norm_backward(dy, y, gamma, r.save_mean, r.save_invstd);
          auto gl = kernels::batch_norm_backward(cl(dy.to(d)), yl, gamma.to(d), rl.save_mean, rl.save_invstd);
          CHECK(is_cl(gl.dx));
          CHECK(rel_error(gl.dx, g.dx) <= 8 * tol);
          CHECK(rel_error(gl.dgamma, g.dgamma) <= 8 * tol);
          CHECK(rel_error(gl.dbeta, g.dbeta) <= 8 * tol);
          Tensor ye = kernels::batch_norm_eval(yl, gamma.to(d), beta.to(d), rml, rvl, 1e-5);
          CHECK(is_cl(ye));
          CHECK(rel_error(ye, kernels::batch_norm_eval(y, gamma, beta, rm, rv, 1e-5)) <= 8 * tol);
        }
      }
    }
  }
}

TEST_CASE("gradcheck through channels-last convolution, batch norm, ReLU and add",
          "[autograd][memory_format]") {
  for (const Device d : test::test_devices()) {
    INFO("on " << d.str());
    Tensor x = cl(uniform({2, 3, 5, 4}, -1.0, 1.0, kFloat64).to(d)).set_requires_grad();
    Tensor w = cl(uniform({3, 3, 3, 3}, -0.5, 0.5, kFloat64).to(d)).set_requires_grad();
    Tensor b = uniform({3}, -0.5, 0.5, kFloat64).to(d).set_requires_grad();
    Tensor gamma = uniform({3}, 0.5, 1.5, kFloat64).to(d).set_requires_grad();
    Tensor beta = uniform({3}, -0.5, 0.5, kFloat64).to(d).set_requires_grad();
    auto fn = [](const std::vector<Tensor>& in) {
      Tensor rm = zeros({3}, kFloat64, in[0].device()), rv = ones({3}, kFloat64, in[0].device());
      Tensor y = conv2d(in[0], in[1], in[2], Conv2dParams{1, 1, 1, 1});
      Tensor out = relu(add(batch_norm(y, in[3], in[4], rm, rv, true, 0.1, 1e-5), in[0]));
      REQUIRE(is_cl(out));
      return out;
    };
    auto result = autograd::gradcheck(fn, {x, w, b, gamma, beta});
    INFO(result.message);
    CHECK(result.ok);
  }
}

TEST_CASE("a channels-last model trains to the parameters of the contiguous one", "[nn][memory_format]") {
  Tensor x = randn({6, 1, 12, 12});
  Tensor y = from_vector<int64_t>({0, 1, 2, 3, 0, 1}, {6});
  for (const Device d : test::test_devices()) {
    const bool on_gpu = d.is_cuda();
    INFO("on " << d.str());
    auto ref = small_resnet(3);
    auto net = small_resnet(3);
    ref->to(d);
    net->to(d);
    net->to(kCL);
    const std::vector<Tensor> before = net->parameters();
    CHECK(is_cl(before[0]));  // the stem's [8, 1, 3, 3] weight, with exactly channels-last strides
    CHECK(rel_error(before[0], ref->parameters()[0]) == 0);
    const auto want = train3(*ref, x.to(d), y.to(d));
    const auto got = train3(*net, x.to(d), y.to(d));
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("parameter " << i << " " << shape_str(got[i].shape()));
      CHECK(suggest_memory_format(got[i]) == (got[i].dim() == 4 ? kCL : MemoryFormat::Contiguous));
      // The CPU computes both through the same contiguous kernels; cuDNN's NHWC engines differ.
      CHECK(rel_error(got[i], want[i]) <= (on_gpu ? 1e-4 : 1e-12));
    }
    // The state dict of a channels-last model holds the same values and loads back.
    auto copy = small_resnet(9);
    copy->to(d);
    copy->to(kCL);
    copy->load_state_dict(net->state_dict());
    CHECK(rel_error(copy->parameters()[3], net->parameters()[3]) == 0);
    CHECK(is_cl(copy->parameters()[0]));
  }
}
