// Capturable optimizers (Note [capturable optimizer steps] in nn/optim/optimizer.h): the
// learning rate and Adam's step count on the device give the same parameters as the host
// values -- bit for bit on the CPU and for CUDA SGD, within the bound of the device's pow for
// CUDA Adam -- through the per-parameter and the flat path, a state_dict round trip and a
// learning-rate change. And adam_advance_step, the new kernel, on the CPU and CUDA.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
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

using Make = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>, bool capturable)>;

struct Case {
  const char* name;
  Make make;
};

const std::vector<Case>& sgd_cases() {
  static const std::vector<Case> cases{
      {"sgd",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::SGD>(ps, optim::SGDOptions(0.1).capturable(c));
       }},
      {"sgd momentum dampening weight decay",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::SGD>(
             ps,
             optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(0.01).capturable(c));
       }},
      {"sgd nesterov weight decay",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::SGD>(
             ps,
             optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3).capturable(c));
       }},
  };
  return cases;
}

const std::vector<Case>& adam_cases() {
  static const std::vector<Case> cases{
      {"adam",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::Adam>(ps, optim::AdamOptions(0.05).capturable(c));
       }},
      {"adam betas eps weight decay",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::Adam>(
             ps,
             optim::AdamOptions(0.05).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1).capturable(c));
       }},
      {"adamw",
       [](std::vector<Tensor> ps, bool c) {
         return std::make_unique<optim::AdamW>(
             ps, optim::AdamWOptions(0.05).weight_decay(0.05).capturable(c));
       }},
  };
  return cases;
}

// Two parameters of different shapes (one channels-last 4-D), fresh values, on d.
std::vector<Tensor> make_params(Device d, DType dt, Generator& gen) {
  Tensor a = uniform({2, 3, 2, 2}, -1.0, 1.0, dt, kCPU, &gen).to(d);
  a = a.contiguous(MemoryFormat::ChannelsLast);
  Tensor b = uniform({37}, -1.0, 1.0, dt, kCPU, &gen).to(d);
  return {a.set_requires_grad(true), b.set_requires_grad(true)};
}

std::vector<Tensor> copies(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const Tensor& p : ps) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// The same fresh gradient for parameter k of both lists.
void set_same_grads(const std::vector<Tensor>& a, const std::vector<Tensor>& b, Generator& gen) {
  for (size_t k = 0; k < a.size(); ++k) {
    Tensor g = uniform(a[k].shape(), -1.0, 1.0, a[k].dtype(), kCPU, &gen).to(a[k].device());
    a[k].set_grad(g.contiguous(suggest_memory_format(a[k])));
    b[k].set_grad(g.clone());
  }
}

// How far a capturable run may be from a plain one. Exact, except for Adam on CUDA (Note
// [device Adam constants] in kernels/cuda/optim.cu): its step constants agree to
// 3 * 2^-53 / (1 - beta2) ~ 3e-13 relative (1 - beta2 >= 1e-3 here), so float64 parameters
// agree far below 1e-10; float32 ones get the same constants after rounding but for a chance
// of ~1e-5 per constant, which would move a parameter by about an ulp of its update (~1e-8):
// 1e-6 allows a few. A wrong learning rate or a count that does not advance moves them by
// more than 1e-3.
double tolerance(bool adam, Device d, DType dt) {
  if (!adam || !d.is_cuda()) return 0.0;
  return dt == kFloat64 ? 1e-10 : 1e-6;
}

void check_equal(const std::vector<Tensor>& got, const std::vector<Tensor>& want, double tol) {
  for (size_t k = 0; k < got.size(); ++k) {
    INFO("parameter " << k);
    if (tol == 0.0) {
      CHECK(values(got[k]) == values(want[k]));
    } else {
      CHECK(test::rel_error(got[k], want[k]) <= tol);
    }
  }
}

// Eight steps of a capturable and a plain optimizer on equal parameters and gradients, the
// learning rate changed twice in between; the parameters compared after every step.
void run_against_plain(const Case& c, bool adam, Device d, DType dt) {
  Generator gen(11);
  const std::vector<Tensor> pc = make_params(d, dt, gen), pp = copies(pc);
  auto cap = c.make(pc, true), plain = c.make(pp, false);
  REQUIRE(cap->capturable());
  REQUIRE_FALSE(plain->capturable());
  const double tol = tolerance(adam, d, dt);
  for (int step = 0; step < 8; ++step) {
    INFO("step " << step);
    if (step == 3 || step == 6) {
      const double lr = step == 3 ? 0.01 : 0.2;
      cap->set_lr(lr);
      plain->set_lr(lr);
      CHECK(cap->lr() == lr);
    }
    set_same_grads(pc, pp, gen);
    cap->step();
    plain->step();
    check_equal(pc, pp, tol);
  }
  if (adam) {
    auto& a = dynamic_cast<optim::Adam&>(*cap);
    CHECK(a.step_count(0) == 8);
    CHECK(a.step_count(1) == 8);
  }
}

std::vector<DType> dtypes() {
  return {kFloat32, kFloat64};
}

}  // namespace

TEST_CASE("capturable SGD equals plain SGD bit for bit across learning-rate changes",
          "[nn][cuda]") {
  for (Device d : test::test_devices()) {
    for (DType dt : dtypes()) {
      for (const Case& c : sgd_cases()) {
        INFO(d.str() << " " << dtype_name(dt) << " " << c.name);
        run_against_plain(c, false, d, dt);
      }
    }
  }
}

TEST_CASE("capturable Adam and AdamW equal plain ones across learning-rate changes", "[nn][cuda]") {
  for (Device d : test::test_devices()) {
    for (DType dt : dtypes()) {
      for (const Case& c : adam_cases()) {
        INFO(d.str() << " " << dtype_name(dt) << " " << c.name);
        run_against_plain(c, true, d, dt);
      }
    }
  }
}

TEST_CASE("the learning rate of a capturable optimizer is read from the device at every step",
          "[nn]") {
  // One step at lr 0.1 and one at lr 0.5, of SGD without momentum: p moves by lr * g each time,
  // so a stale device value shows.
  Tensor p = full({3}, 1.0, kFloat64).set_requires_grad(true);
  optim::SGD sgd({p}, optim::SGDOptions(0.1).capturable(true));
  p.set_grad(full({3}, 1.0, kFloat64));
  sgd.step();
  CHECK(values(p) == std::vector<double>(3, 0.9));
  sgd.set_lr(0.5);
  sgd.step();
  CHECK(values(p) == std::vector<double>(3, 0.9 - 0.5));
  CHECK_THROWS_AS(sgd.set_lr(-1.0), ValueError);
  CHECK(sgd.lr() == 0.5);  // a refused rate changes nothing
  sgd.step();
  CHECK(values(p) == std::vector<double>(3, 0.9 - 0.5 - 0.5));
}

namespace {

}  // namespace

TEST_CASE("a capturable optimizer takes the flat path with one step count", "[nn][cuda]") {
  std::vector<Case> cases = sgd_cases();
  for (const Case& c : adam_cases()) cases.push_back(c);
  for (Device d : test::test_devices()) {
    for (const Case& c : cases) {
      const bool adam = std::string(c.name).rfind("adam", 0) == 0;
      INFO(d.str() << " " << c.name);
      Generator gen(5);
      test::TwoModels m = test::two_models(d, kFloat64, &gen);
      auto fused = c.make(m.flat_params, true), plain = c.make(m.plain_params, false);
      // Steps 0-1 flat; 2 without the middle gradient, per parameter (Adam's shared count is
      // split); 3 flat again for SGD, per parameter for Adam (the counts differ).
      for (int step = 0; step < 4; ++step) {
        INFO("step " << step);
        if (step == 1) {
          fused->set_lr(0.02);
          plain->set_lr(0.02);
        }
        test::set_grads(m, /*skip_middle=*/step == 2, &gen);
        fused->step();
        plain->step();
        check_equal(m.flat_params, m.plain_params, tolerance(adam, d, kFloat64));
        if (adam && step == 1) {
          // The flat path: one buffer for the moments, one count for every parameter.
          const StateDict sd = fused->state_dict();
          CHECK(sd.at("state.0.exp_avg").storage() == sd.at("state.2.exp_avg").storage());
          CHECK(sd.at("state.0.step").same(sd.at("state.2.step")));
          CHECK(sd.at("state.0.step").device() == d);
          CHECK(values(sd.at("state.1.step")) == std::vector<double>{2.0});
        }
        if (!adam && step == 1 && fused->state_dict().contains("state.0.momentum_buffer")) {
          const StateDict sd = fused->state_dict();
          CHECK(sd.at("state.0.momentum_buffer").storage() ==
                sd.at("state.2.momentum_buffer").storage());
        }
      }
      if (adam) {
        auto& a = dynamic_cast<optim::Adam&>(*fused);
        CHECK(a.step_count(0) == 4);
        CHECK(a.step_count(1) == 3);
        CHECK(a.step_count(2) == 4);
        const StateDict sd = fused->state_dict();
        CHECK_FALSE(sd.at("state.0.step").same(sd.at("state.1.step")));
      }
    }
  }
}

namespace {

// The parameters of a three-tensor model on d: views of one buffer (coalesced) or separate.
std::vector<Tensor> three_params(Device d, bool coalesce, Generator& gen) {
  test::TwoModels m = test::two_models(d, kFloat64, &gen);
  return coalesce ? m.flat_params : m.plain_params;
}

// Gradients from g [13]: views of one fresh buffer, so coalesced parameters take the flat path.
void give_grads(const std::vector<Tensor>& params, const Tensor& g) {
  Tensor buffer = g.clone();
  int64_t offset = 0;
  for (const Tensor& p : params) {
    p.set_grad(buffer.slice(0, offset, offset + p.numel()).view(p.shape()));
    offset += p.numel();
  }
}

}  // namespace

TEST_CASE("capturable Adam state_dict holds the live device count and round-trips", "[nn][cuda]") {
  for (Device d : test::test_devices()) {
    for (bool coalesce : {false, true}) {
      for (const Case& c : adam_cases()) {
        INFO(d.str() << " " << c.name << " coalesced " << coalesce);
        // a takes six steps. After its second, three optimizers over copies of its parameters
        // load its state and step along: a capturable one, a plain one, and a capturable one
        // that loads the plain one's state (CPU counts).
        Generator gen(9);
        const std::vector<Tensor> pa = three_params(d, coalesce, gen);
        auto a = c.make(pa, true);
        for (int s = 0; s < 2; ++s) {
          give_grads(pa, uniform({13}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d));
          a->step();
        }
        const StateDict sd = a->state_dict();
        REQUIRE(sd.size() == 9);
        const Tensor step0 = sd.at("state.0.step");
        CHECK(step0.dtype() == kFloat32);
        CHECK(step0.dim() == 0);
        CHECK(step0.device() == d);
        CHECK(values(step0) == std::vector<double>{2.0});
        CHECK(sd.at("state.0.step").same(sd.at("state.2.step")) ==
              coalesce);  // the flat path's one count

        std::vector<std::vector<Tensor>> pb;
        for (int k = 0; k < 3; ++k) {
          pb.push_back(three_params(d, coalesce, gen));
          NoGradGuard no_grad;
          for (size_t i = 0; i < pa.size(); ++i) pb.back()[i].copy_(pa[i]);
        }
        auto cap = c.make(pb[0], true), plain = c.make(pb[1], false), cap2 = c.make(pb[2], true);
        cap->load_state_dict(sd);
        plain->load_state_dict(sd);
        const StateDict plain_sd = plain->state_dict();
        CHECK(plain_sd.at("state.0.step").device() == kCPU);
        cap2->load_state_dict(plain_sd);
        const StateDict cap2_sd = cap2->state_dict();
        CHECK(cap2_sd.at("state.1.step").device() == d);
        CHECK(cap2_sd.at("state.0.step").same(cap2_sd.at("state.2.step")) == coalesce);
        CHECK(dynamic_cast<optim::Adam&>(*cap2).step_count(1) == 2);

        const std::vector<optim::Optimizer*> others{cap.get(), plain.get(), cap2.get()};
        for (int s = 2; s < 6; ++s) {
          const Tensor g = uniform({13}, -1.0, 1.0, kFloat64, kCPU, &gen).to(d);
          give_grads(pa, g);
          a->step();
          for (size_t o = 0; o < others.size(); ++o) {
            give_grads(pb[o], g);
            others[o]->step();
          }
          for (size_t o = 0; o < others.size(); ++o) {
            INFO("step " << s << " optimizer " << o);
            // The plain one derives Adam's constants with the host's pow (Note [device Adam
            // constants]); the capturable ones do exactly what a does.
            check_equal(pb[o], pa, o == 1 ? tolerance(true, d, kFloat64) : 0.0);
          }
        }
        CHECK(values(step0) == std::vector<double>{6.0});  // live: the tensor a counts in
        CHECK(dynamic_cast<optim::Adam&>(*a).step_count(2) == 6);
        CHECK(dynamic_cast<optim::Adam&>(*cap).step_count(2) == 6);
        CHECK(dynamic_cast<optim::Adam&>(*plain).step_count(2) == 6);
      }
    }
  }
}

TEST_CASE("capturable optimizers take parameters on several devices", "[nn]") {
  // One learning-rate tensor per device (virtual CPU devices here; the same code serves GPUs).
  Generator gen(3);
  const Device d1 = Device::cpu(1);
  const std::vector<Tensor> pc{
      uniform({5}, -1.0, 1.0, kFloat32, kCPU, &gen).set_requires_grad(true),
      uniform({4}, -1.0, 1.0, kFloat32, d1, &gen).set_requires_grad(true)};
  const std::vector<Tensor> pp = copies(pc);
  for (const Case& c : {sgd_cases()[1], adam_cases()[2]}) {
    INFO(c.name);
    auto cap = c.make(pc, true), plain = c.make(pp, false);
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {
        cap->set_lr(0.3);
        plain->set_lr(0.3);
      }
      set_same_grads(pc, pp, gen);
      cap->step();
      plain->step();
      check_equal(pc, pp, 0.0);
    }
  }
  CHECK(pc[1].device() == d1);
}

TEST_CASE("adam_advance_step counts and derives the step constants", "[kernels]") {
  // From count 0 the first step's constants, computed here as the host path does.
  AdamParams p;
  p.beta1 = 0.8;
  p.beta2 = 0.99;
  p.weight_decay = 0.05;
  const double lr = 0.003;
  Tensor step = zeros({}, kFloat32), lr_t = full({}, lr, kFloat64), consts = zeros({3}, kFloat64);
  for (int t = 1; t <= 50; ++t) {
    kernels::adam_advance_step(step, lr_t, consts, p);
    INFO("t " << t);
    REQUIRE(step.item() == t);
    const double bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(t));
    CHECK(values(consts) ==
          std::vector<double>{lr / bc1, 1.0 / std::sqrt(bc2), 1.0 - lr * p.weight_decay});
  }
  // A capturable adam_step with those constants is the host-path adam_step of count 50.
  Generator gen(2);
  Tensor param = uniform({17}, -1.0, 1.0, kFloat32, kCPU, &gen),
         grad = uniform({17}, -1.0, 1.0, kFloat32, kCPU, &gen);
  Tensor m = uniform({17}, -0.1, 0.1, kFloat32, kCPU, &gen),
         v = uniform({17}, 0.0, 0.1, kFloat32, kCPU, &gen);
  Tensor param2 = param.clone(), m2 = m.clone(), v2 = v.clone();
  for (bool decoupled : {false, true}) {
    AdamParams host = p;
    host.lr = lr;
    host.step = 50;
    host.decoupled_weight_decay = decoupled;
    AdamParams dev = host;
    dev.step = 1;   // unused with consts
    dev.lr = 99.0;  // unused with consts
    dev.consts = consts;
    kernels::adam_step(param, grad, m, v, host);
    kernels::adam_step(param2, grad, m2, v2, dev);
    CHECK(values(param2) == values(param));
    CHECK(values(m2) == values(m));
    CHECK(values(v2) == values(v));
  }
}

TEST_CASE("adam_advance_step on CUDA agrees with the CPU within the bound of the device's pow",
          "[kernels][cuda]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  // Note [device Adam constants]: beta^t differs by at most 3 * 2^-53 (CUDA's pow within 2 ulp,
  // glibc's within 1, of a number below 1), so 1 - beta^t by that absolutely; lr / bc and
  // 1 / sqrt(bc) then by that over bc relatively, plus an ulp or two of their own rounding.
  // The count and 1 - lr * wd are IEEE operations on both sides: equal bits.
  const double u = std::ldexp(1.0, -53);
  struct Cfg {
    double beta1, beta2, wd, lr;
    double start;  // the count before the first step
  };
  for (const Cfg& c : std::vector<Cfg>{{0.9, 0.999, 0.0, 1e-3, 0},
                                       {0.8, 0.99, 0.01, 0.05, 0},
                                       {0.5, 0.9999, 0.1, 0.3, 0},
                                       {0.9, 0.999, 0.01, 1e-3, 1e5}}) {
    INFO("betas " << c.beta1 << "," << c.beta2 << " wd " << c.wd << " from " << c.start);
    AdamParams p;
    p.beta1 = c.beta1;
    p.beta2 = c.beta2;
    p.weight_decay = c.wd;
    Tensor step = full({}, c.start, kFloat32), lr = full({}, c.lr, kFloat64),
           consts = zeros({3}, kFloat64);
    Tensor step_g = step.to(gpu), lr_g = lr.to(gpu), consts_g = consts.to(gpu);
    int inexact = 0;
    for (int k = 1; k <= 1000; ++k) {
      kernels::adam_advance_step(step, lr, consts, p);
      kernels::adam_advance_step(step_g, lr_g, consts_g, p);
      const double t = c.start + k;
      REQUIRE(values(step_g) == std::vector<double>{t});
      const std::vector<double> want = values(consts), got = values(consts_g);
      const double bc1 = 1.0 - std::pow(c.beta1, t), bc2 = 1.0 - std::pow(c.beta2, t);
      INFO("t " << t);
      CHECK(std::abs(got[0] - want[0]) <= want[0] * (3 * u / bc1 + 4 * u));
      CHECK(std::abs(got[1] - want[1]) <= want[1] * (3 * u / bc2 + 4 * u));
      CHECK(got[2] == want[2]);
      inexact += got[0] != want[0] || got[1] != want[1];
    }
    // How often the device's pow moved a constant: worth knowing, not a requirement.
    UNSCOPED_INFO("constants not bitwise equal in " << inexact << " of 1000 steps");
  }
}

TEST_CASE("capturable optimizer steps refuse device inputs that do not fit", "[kernels][nn]") {
  Tensor param = zeros({4}), grad = ones({4}), m = zeros({4}), v = zeros({4});
  SgdParams sp;
  sp.lr_tensor = full({}, 0.1, kFloat32);
  CHECK(contains(error_message<DTypeError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "lr_tensor must be float64, got float32"));
  sp.lr_tensor = full({2}, 0.1, kFloat64);
  CHECK(contains(error_message<ShapeError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "lr_tensor must be 1 contiguous value, got [2]"));
  sp.lr_tensor = full({}, 0.1, kFloat64, Device::cpu(1));
  CHECK(contains(error_message<DeviceError>([&] { kernels::sgd_step(param, grad, Tensor(), sp); }),
                 "lr_tensor is on cpu:1"));
  CHECK(values(param) == std::vector<double>(4, 0.0));  // nothing ran

  AdamParams ap;
  ap.consts = zeros({2}, kFloat64);
  CHECK(contains(error_message<ShapeError>([&] { kernels::adam_step(param, grad, m, v, ap); }),
                 "consts must be 3 contiguous values, got [2]"));
  ap.consts = zeros({3}, kFloat32);
  CHECK(contains(error_message<DTypeError>([&] { kernels::adam_step(param, grad, m, v, ap); }),
                 "consts"));

  Tensor step = zeros({}, kFloat32), lr = full({}, 0.1, kFloat64), consts = zeros({3}, kFloat64);
  CHECK(contains(error_message<DTypeError>(
                     [&] { kernels::adam_advance_step(zeros({}, kFloat64), lr, consts, {}); }),
                 "adam_advance_step: step must be float32"));
  CHECK(contains(error_message<DeviceError>([&] {
                   kernels::adam_advance_step(step, full({}, 0.1, kFloat64, Device::cpu(1)), consts,
                                              {});
                 }),
                 "lr is on cpu:1"));
  CHECK(contains(error_message<ShapeError>(
                     [&] { kernels::adam_advance_step(step, lr, zeros({4}, kFloat64), {}); }),
                 "consts must be 3"));
  AdamParams bad_betas;
  bad_betas.beta2 = 1.0;
  CHECK_THROWS_AS(kernels::adam_advance_step(step, lr, consts, bad_betas), ValueError);
  CHECK(step.item() == 0.0);  // refused before anything ran
  CHECK_THROWS_AS(kernels::adam_advance_step(Tensor(), lr, consts, {}), ValueError);

  // The optimizers: a negative learning rate is refused for the device value as for the host's.
  Tensor p = zeros({4}).set_requires_grad(true);
  CHECK_THROWS_AS(optim::Adam({p}, optim::AdamOptions(-1.0).capturable(true)), ValueError);
  optim::Adam adam({p}, optim::AdamOptions(0.1).capturable(true));
  CHECK(adam.step_count(0) == 0);  // no count before the first step
  CHECK(adam.state_dict().size() == 0);
  CHECK(optim::AdamWOptions().capturable(true).capturable());
  CHECK_FALSE(optim::AdamOptions().capturable());
  CHECK_FALSE(optim::SGDOptions(0.1).capturable());
  // A count the file gives as 1.5 is refused as for a plain optimizer.
  p.set_grad(ones({4}));
  adam.step();
  StateDict bad;
  for (const auto& [name, t] : adam.state_dict())
    bad.insert(name, name == "state.0.step" ? full({}, 1.5) : t);
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(bad); }),
                 "not a non-negative integer"));
  CHECK(adam.step_count(0) == 1);
}
