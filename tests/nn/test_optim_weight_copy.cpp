// The weight copy written by the update (Note [the weight copy written by the update] in
// nn/optim/optimizer.h): after every step the copy holds the parameters cast, bit for bit,
// whether the flat kernel wrote it or step() cast it after the per-parameter path, and the
// parameters are those of the same optimizer without a copy. SGD, Adam and AdamW, plain and
// capturable, on the CPU and CUDA; the copy's and copy_into's checks.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "helpers.h"
#include "kernels/ops.h"
#include "nn/nn.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

namespace {

struct Case {
  const char* name;
  std::unique_ptr<optim::Optimizer> (*make)(std::vector<Tensor> params, bool capturable);
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all{
      {"sgd",
       [](std::vector<Tensor> ps, bool c) -> std::unique_ptr<optim::Optimizer> {
         return std::make_unique<optim::SGD>(ps, optim::SGDOptions(0.1).capturable(c));
       }},
      {"sgd momentum nesterov weight decay",
       [](std::vector<Tensor> ps, bool c) -> std::unique_ptr<optim::Optimizer> {
         return std::make_unique<optim::SGD>(
             ps,
             optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3).capturable(c));
       }},
      {"sgd momentum dampening",
       [](std::vector<Tensor> ps, bool c) -> std::unique_ptr<optim::Optimizer> {
         return std::make_unique<optim::SGD>(
             ps, optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).capturable(c));
       }},
      {"adam weight decay",
       [](std::vector<Tensor> ps, bool c) -> std::unique_ptr<optim::Optimizer> {
         return std::make_unique<optim::Adam>(
             ps, optim::AdamOptions(0.05).betas({0.8, 0.99}).weight_decay(0.1).capturable(c));
       }},
      {"adamw",
       [](std::vector<Tensor> ps, bool c) -> std::unique_ptr<optim::Optimizer> {
         return std::make_unique<optim::AdamW>(
             ps, optim::AdamWOptions(0.05).weight_decay(0.05).capturable(c));
       }},
  };
  return all;
}

// The same fresh gradient [13] for both coalesced models, as views of their gradient buffers
// (so the flat path is taken); skip_middle leaves the second parameter without one, which
// sends the step down the per-parameter path.
void same_grads(test::TwoModels& a, test::TwoModels& b, Generator& gen, bool skip_middle) {
  const Tensor g = uniform({13}, -1.0, 1.0, a.grad_buffer.dtype(), kCPU, &gen);
  for (test::TwoModels* m : {&a, &b}) {
    m->grad_buffer.copy_(g);
    for (size_t k = 0; k < m->flat_params.size(); ++k)
      m->flat_params[k].set_grad(skip_middle && k == 1 ? Tensor() : m->flat_grads[k]);
  }
}

// The parameters' buffer cast to the copy's dtype, as AutocastWeights::refresh casts it.
std::vector<double> cast_of(const std::vector<Tensor>& params, DType dtype) {
  return values(contiguous_span(params).detach().to(dtype));
}

}  // namespace

TEST_CASE("the update writes the weight copy with a cast's bits and leaves the parameters as they were",
          "[nn][cuda]") {
  // (parameters, copy): bfloat16 for autocast, and the other floating pairs the kernels take.
  const std::vector<std::pair<DType, DType>> dtypes{
      {kFloat32, kBFloat16}, {kFloat32, kFloat64}, {kFloat64, kFloat32}, {kFloat64, kBFloat16}};
  for (Device d : test::test_devices()) {
    for (const auto& [param_dtype, copy_dtype] : dtypes) {
      for (const Case& c : cases()) {
        for (bool capturable : {false, true}) {
          INFO(d.str() << " " << c.name << (capturable ? " capturable" : "") << ", parameters "
                       << dtype_name(param_dtype) << ", copy " << dtype_name(copy_dtype));
          Generator init(3), init_again(3), gen(8);
          test::TwoModels with = test::two_models(d, param_dtype, &init);
          test::TwoModels without = test::two_models(d, param_dtype, &init_again);
          auto opt = c.make(with.flat_params, capturable);
          auto plain = c.make(without.flat_params, capturable);
          const Tensor copy = empty({13}, copy_dtype, d);  // never written but by the steps
          opt->set_weight_copy(copy);
          REQUIRE(opt->weight_copy().same(copy));
          // Steps 0, 1 and 4 flat: the kernel writes the copy. Step 2 without the middle
          // gradient and, for Adam, step 3 (its counts differ now) per parameter: step() casts.
          for (int step = 0; step < 5; ++step) {
            INFO("step " << step);
            same_grads(with, without, gen, /*skip_middle=*/step == 2);
            opt->step();
            plain->step();
            CHECK(values(copy) == cast_of(with.flat_params, copy_dtype));
            for (size_t k = 0; k < with.flat_params.size(); ++k) {
              INFO("parameter " << k);
              CHECK(values(with.flat_params[k]) == values(without.flat_params[k]));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("set_weight_copy refuses a copy that does not fit the parameters and clears with none",
          "[nn]") {
  test::TwoModels m = test::two_models(kCPU, kFloat32);
  optim::SGD sgd(m.flat_params, 0.1);
  const Tensor good = zeros({13}, kBFloat16);
  sgd.set_weight_copy(good);

  CHECK(contains(error_message<ValueError>([&] { sgd.set_weight_copy(zeros({12}, kBFloat16)); }),
                 "the weight copy has 12 elements, the parameters 13"));
  CHECK(contains(error_message<DTypeError>([&] { sgd.set_weight_copy(zeros({13}, kFloat32)); }),
                 "other than the parameters' float32, got float32"));
  CHECK_THROWS_AS(sgd.set_weight_copy(zeros({13}, kInt64)), DTypeError);
  CHECK(contains(error_message<DeviceError>(
                     [&] { sgd.set_weight_copy(zeros({13}, kBFloat16, Device::cpu(1))); }),
                 "the weight copy is on cpu:1, the parameters on cpu"));
  CHECK(contains(error_message<ValueError>(
                     [&] { sgd.set_weight_copy(zeros({13, 2}, kBFloat16).select(1, 0)); }),
                 "must be contiguous"));
  CHECK(sgd.weight_copy().same(good));  // a refused copy changes nothing

  // Parameters that are not back to back in one buffer.
  optim::SGD separate(m.plain_params, 0.1);
  CHECK(contains(error_message<ValueError>([&] { separate.set_weight_copy(zeros({13}, kBFloat16)); }),
                 "do not lie back to back in one buffer"));

  // A copy of another shape but the right number of elements is taken; none clears it.
  sgd.set_weight_copy(zeros({1, 13}, kBFloat16));
  for (const Tensor& p : m.flat_params) p.set_grad(ones(p.shape()));
  sgd.step();
  CHECK(values(sgd.weight_copy()) == cast_of(m.flat_params, kBFloat16));
  sgd.set_weight_copy(Tensor());
  CHECK_FALSE(sgd.weight_copy().defined());
  sgd.step();
  CHECK(values(good) == std::vector<double>(13, 0.0));  // never written
}

TEST_CASE("sgd_step and adam_step write copy_into and refuse one that does not fit", "[kernels]") {
  Tensor param = zeros({4}), grad = ones({4}), m = zeros({4}), v = zeros({4});
  SgdParams sp;
  sp.copy_into = zeros({4});
  CHECK(contains(error_message<DTypeError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "sgd_step: copy_into must be of a floating dtype other than the parameter's float32, got float32"));
  sp.copy_into = zeros({4}, kInt64);
  CHECK_THROWS_AS(kernels::sgd_step(param, grad, Tensor(), sp), DTypeError);
  sp.copy_into = zeros({5}, kBFloat16);
  CHECK(contains(error_message<ShapeError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "sgd_step: copy_into [5] must hold the parameter's 4 values"));
  sp.copy_into = zeros({4}, kBFloat16, Device::cpu(1));
  CHECK(contains(error_message<DeviceError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "sgd_step: copy_into is on cpu:1"));
  AdamParams ap;
  ap.copy_into = zeros({3}, kBFloat16);
  CHECK(contains(error_message<ShapeError>([&] { kernels::adam_step(param, grad, m, v, ap); }),
                 "adam_step: copy_into [3]"));
  ap.copy_into = zeros({4}, kFloat32);
  CHECK_THROWS_AS(kernels::adam_step(param, grad, m, v, ap), DTypeError);
  CHECK(values(param) == std::vector<double>(4, 0.0));  // nothing ran

  // A channels-last parameter: a copy laid out as it is taken, a contiguous one is not (the
  // kernels pair elements by memory).
  Generator gen(2);
  const Tensor w = uniform({2, 3, 2, 2}, -1.0, 1.0, kFloat32, kCPU, &gen).contiguous(MemoryFormat::ChannelsLast);
  const Tensor gw = uniform({2, 3, 2, 2}, -1.0, 1.0, kFloat32, kCPU, &gen).contiguous(MemoryFormat::ChannelsLast);
  sp.copy_into = zeros({2, 3, 2, 2}, kBFloat16);
  CHECK_THROWS_AS(kernels::sgd_step(w, gw, Tensor(), sp), ShapeError);
  sp.copy_into = zeros({2, 3, 2, 2}, kBFloat16).contiguous(MemoryFormat::ChannelsLast);
  kernels::sgd_step(w, gw, Tensor(), sp);
  CHECK(values(sp.copy_into) == values(w.to(kBFloat16)));
  // A 1-D copy of a contiguous parameter.
  const Tensor x = uniform({3, 5}, -1.0, 1.0, kFloat64, kCPU, &gen);
  ap.copy_into = zeros({15}, kBFloat16);
  kernels::adam_step(x, ones({3, 5}, kFloat64), zeros({3, 5}, kFloat64), zeros({3, 5}, kFloat64), ap);
  CHECK(values(ap.copy_into) == values(x.to(kBFloat16)));
}
