// SGD and Adam against hand-stepped reference values, three steps each.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "helpers.h"
#include "nn/nn.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::f64;
using tandem::test::values;
using tandem::test::contains;
using tandem::test::error_message;

namespace {

const std::vector<double> kP0{1.0, -2.0, 0.5, 3.0};
// A different gradient for each of the three steps.
const std::vector<std::vector<double>> kGrads{
    {0.5, -1.0, 0.25, 2.0}, {-0.3, 0.2, 0.7, 1.5}, {0.1, 0.4, -0.6, -0.2}};

// torch.optim.SGD's positional order.
struct SgdCfg {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

// torch.optim.SGD, written out per element.
std::vector<double> sgd_reference(const SgdCfg& c) {
  std::vector<double> p = kP0, buf(p.size());
  for (size_t t = 0; t < kGrads.size(); ++t) {
    for (size_t i = 0; i < p.size(); ++i) {
      double d = kGrads[t][i] + c.weight_decay * p[i];
      if (c.momentum != 0) {
        buf[i] = t == 0 ? d : c.momentum * buf[i] + (1 - c.dampening) * d;
        d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
      }
      p[i] -= c.lr * d;
    }
  }
  return p;
}

struct AdamCfg {
  double lr, b1, b2, eps, weight_decay;
  bool decoupled;
};

// torch.optim.Adam / AdamW, written out per element.
std::vector<double> adam_reference(const AdamCfg& c) {
  std::vector<double> p = kP0, m(p.size()), v(p.size());
  for (size_t t = 0; t < kGrads.size(); ++t) {
    const double step = static_cast<double>(t + 1);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = kGrads[t][i];
      if (c.decoupled) {
        p[i] *= 1 - c.lr * c.weight_decay;
      } else {
        g += c.weight_decay * p[i];
      }
      m[i] = c.b1 * m[i] + (1 - c.b1) * g;
      v[i] = c.b2 * v[i] + (1 - c.b2) * g * g;
      const double mhat = m[i] / (1 - std::pow(c.b1, step));
      const double vhat = v[i] / (1 - std::pow(c.b2, step));
      p[i] -= c.lr * mhat / (std::sqrt(vhat) + c.eps);
    }
  }
  return p;
}

// Runs three steps of `opt` on p with the fixed gradients; returns p.
template <typename Opt>
std::vector<double> run_three_steps(Opt& opt, const Tensor& p) {
  for (const auto& g : kGrads) {
    p.set_grad(f64(g, {static_cast<int64_t>(g.size())}));
    opt.step();
  }
  return values(p);
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    CHECK(got[i] == Approx(want[i]).margin(tol));
  }
}

}  // namespace

TEST_CASE("SGD matches hand-stepped values", "[nn]") {
  SECTION("momentum 0.9, by hand") {
    // p = 1, g = 0.5 each step, lr 0.1: buf 0.5, 0.95, 1.355; p 0.95, 0.855, 0.7195.
    Tensor p = f64({1.0}, {1}).set_requires_grad();
    optim::SGD sgd({p}, 0.1, 0.9);
    const std::vector<double> want{0.95, 0.855, 0.7195};
    for (double w : want) {
      p.set_grad(f64({0.5}, {1}));
      sgd.step();
      CHECK(values(p)[0] == Approx(w).margin(1e-14));
    }
    CHECK(values(sgd.momentum_buffer(0))[0] == Approx(1.355).margin(1e-14));
  }
  const std::vector<SgdCfg> cfgs{{0.1, 0.0, 0.0, 0.0, false},   {0.05, 0.9, 0.0, 0.0, false},
                                 {0.05, 0.9, 0.0, 0.01, false}, {0.05, 0.8, 0.3, 0.0, false},
                                 {0.05, 0.9, 0.0, 0.02, true},  {0.2, 0.0, 0.0, 0.1, false}};
  for (const auto& c : cfgs) {
    INFO("lr " << c.lr << " momentum " << c.momentum << " dampening " << c.dampening << " wd "
               << c.weight_decay << " nesterov " << c.nesterov);
    Tensor p = f64(kP0, {4}).set_requires_grad();
    optim::SGD sgd({p}, c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov);
    check_close(run_three_steps(sgd, p), sgd_reference(c), 1e-12);
  }
  SECTION("float32 parameters") {
    const SgdCfg c{0.05, 0.9, 0.0, 0.01, true};
    Tensor p = f64(kP0, {4}).to(kFloat32).set_requires_grad();
    optim::SGD sgd({p}, c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov);
    for (const auto& g : kGrads) {
      p.set_grad(f64(g, {4}).to(kFloat32));
      sgd.step();
    }
    check_close(values(p), sgd_reference(c), 1e-6);
  }
}

TEST_CASE("Adam and AdamW match hand-stepped values", "[nn]") {
  SECTION("first step moves each element by lr against its gradient's sign") {
    Tensor p = f64(kP0, {4}).set_requires_grad();
    optim::Adam adam({p}, 0.01);
    p.set_grad(f64(kGrads[0], {4}));
    adam.step();
    check_close(values(p), {1.0 - 0.01, -2.0 + 0.01, 0.5 - 0.01, 3.0 - 0.01}, 1e-8);
    CHECK(adam.step_count(0) == 1);
  }
  const std::vector<AdamCfg> cfgs{{1e-3, 0.9, 0.999, 1e-8, 0.0, false},
                                  {0.05, 0.8, 0.99, 1e-6, 0.0, false},
                                  {0.05, 0.9, 0.999, 1e-8, 0.1, false},
                                  {0.05, 0.9, 0.999, 1e-8, 0.1, true}};
  for (const auto& c : cfgs) {
    INFO("lr " << c.lr << " betas " << c.b1 << "," << c.b2 << " wd " << c.weight_decay
               << " decoupled " << c.decoupled);
    Tensor p = f64(kP0, {4}).set_requires_grad();
    std::unique_ptr<optim::Adam> adam;
    if (c.decoupled) {
      adam = std::make_unique<optim::AdamW>(std::vector<Tensor>{p}, c.lr,
                                            std::make_pair(c.b1, c.b2), c.eps, c.weight_decay);
    } else {
      adam = std::make_unique<optim::Adam>(std::vector<Tensor>{p}, c.lr, std::make_pair(c.b1, c.b2),
                                           c.eps, c.weight_decay);
    }
    CHECK(adam->decoupled_weight_decay() == c.decoupled);
    check_close(run_three_steps(*adam, p), adam_reference(c), 1e-12);
  }
  SECTION("AdamW defaults to decoupled decay 1e-2") {
    Tensor p = f64(kP0, {4}).set_requires_grad();
    optim::AdamW adamw({p}, 0.05);
    CHECK(adamw.decoupled_weight_decay());
    CHECK(adamw.weight_decay() == 0.01);
    check_close(run_three_steps(adamw, p), adam_reference({0.05, 0.9, 0.999, 1e-8, 0.01, true}),
                1e-12);
  }
}

TEST_CASE("options and positional constructors take torch.optim's order", "[nn]") {
  SECTION("SGD: options and positional forms step identically") {
    // Nesterov needs dampening 0, so dampening and nesterov each get their own configuration.
    const std::vector<SgdCfg> cfgs{{0.05, 0.9, 0.5, 0.01, false}, {0.05, 0.9, 0.0, 0.02, true}};
    for (const auto& c : cfgs) {
      INFO("dampening " << c.dampening << " nesterov " << c.nesterov);
      Tensor p1 = f64(kP0, {4}).set_requires_grad(), p2 = f64(kP0, {4}).set_requires_grad();
      optim::SGD by_options({p1}, optim::SGDOptions(c.lr)
                                      .momentum(c.momentum)
                                      .dampening(c.dampening)
                                      .weight_decay(c.weight_decay)
                                      .nesterov(c.nesterov));
      optim::SGD by_position({p2}, c.lr, c.momentum, c.dampening, c.weight_decay, c.nesterov);
      const std::vector<double> got = run_three_steps(by_options, p1);
      CHECK(got == run_three_steps(by_position, p2));  // bit for bit
      check_close(got, sgd_reference(c), 1e-12);
    }
  }
  SECTION("SGD: the fourth positional argument is dampening, the fifth weight decay") {
    Tensor p = f64(kP0, {4}).set_requires_grad();
    optim::SGD sgd({p}, 0.05, 0.9, 0.5, 0.01);
    CHECK(sgd.momentum() == 0.9);
    CHECK(sgd.dampening() == 0.5);
    CHECK(sgd.weight_decay() == 0.01);
    CHECK_FALSE(sgd.nesterov());
    const std::vector<double> got = run_three_steps(sgd, p);
    check_close(got, sgd_reference({0.05, 0.9, 0.5, 0.01, false}), 1e-12);
    const std::vector<double> swapped = sgd_reference({0.05, 0.9, 0.01, 0.5, false});
    CHECK(std::abs(got[0] - swapped[0]) > 1e-3);
  }
  SECTION("Adam and AdamW: options and positional forms step identically") {
    for (bool decoupled : {false, true}) {
      INFO("decoupled " << decoupled);
      const AdamCfg c{0.05, 0.8, 0.99, 1e-6, 0.1, decoupled};
      Tensor p1 = f64(kP0, {4}).set_requires_grad(), p2 = f64(kP0, {4}).set_requires_grad();
      std::unique_ptr<optim::Adam> by_options, by_position;
      if (decoupled) {
        by_options = std::make_unique<optim::AdamW>(
            std::vector<Tensor>{p1},
            optim::AdamWOptions(c.lr).betas({c.b1, c.b2}).eps(c.eps).weight_decay(c.weight_decay));
        by_position = std::make_unique<optim::AdamW>(
            std::vector<Tensor>{p2}, c.lr, std::make_pair(c.b1, c.b2), c.eps, c.weight_decay);
      } else {
        by_options = std::make_unique<optim::Adam>(
            std::vector<Tensor>{p1},
            optim::AdamOptions(c.lr).betas({c.b1, c.b2}).eps(c.eps).weight_decay(c.weight_decay));
        by_position = std::make_unique<optim::Adam>(
            std::vector<Tensor>{p2}, c.lr, std::make_pair(c.b1, c.b2), c.eps, c.weight_decay);
      }
      CHECK(by_options->decoupled_weight_decay() == decoupled);
      CHECK(by_options->weight_decay() == 0.1);
      CHECK(by_options->eps() == 1e-6);
      const std::vector<double> got = run_three_steps(*by_options, p1);
      CHECK(got == run_three_steps(*by_position, p2));  // bit for bit
      check_close(got, adam_reference(c), 1e-12);
    }
  }
  SECTION("option defaults follow torch.optim") {
    CHECK(optim::SGDOptions(0.1).momentum() == 0.0);
    CHECK(optim::SGDOptions(0.1).dampening() == 0.0);
    CHECK(optim::SGDOptions(0.1).weight_decay() == 0.0);
    CHECK_FALSE(optim::SGDOptions(0.1).nesterov());
    CHECK(optim::AdamOptions().lr() == 1e-3);
    CHECK(optim::AdamOptions().betas() == std::make_pair(0.9, 0.999));
    CHECK(optim::AdamOptions().eps() == 1e-8);
    CHECK(optim::AdamOptions().weight_decay() == 0.0);
    CHECK(optim::AdamWOptions().weight_decay() == 0.01);
    Tensor p = f64(kP0, {4}).set_requires_grad();
    CHECK_THROWS_AS(optim::SGD({p}, optim::SGDOptions(0.1).nesterov(true)), ValueError);
    CHECK_THROWS_AS(optim::Adam({p}, optim::AdamOptions().betas({0.9, 1.0})), ValueError);
  }
}

TEST_CASE("Optimizer skips parameters without a gradient and validates input", "[nn]") {
  Tensor a = f64(kP0, {4}).set_requires_grad();
  Tensor b = f64(kP0, {4}).set_requires_grad();
  optim::Adam adam({a, b}, 0.1);
  a.set_grad(f64(kGrads[0], {4}));
  adam.step();
  CHECK(values(b) == kP0);
  CHECK(adam.step_count(0) == 1);
  CHECK(adam.step_count(1) == 0);
  adam.zero_grad();
  CHECK_FALSE(a.grad().defined());
  std::vector<double> a1 = values(a);
  adam.step();  // nothing has a gradient
  CHECK(values(a) == a1);

  optim::SGD sgd({a}, 0.1);
  sgd.set_lr(0.5);
  CHECK(sgd.lr() == 0.5);
  CHECK_THROWS_AS(sgd.set_lr(-1.0), ValueError);
  CHECK_THROWS_AS(optim::SGD({a}, 0.1, 0.0, 0.0, 0.0, true), ValueError);
  CHECK_THROWS_AS(optim::SGD({a}, 0.1, 0.9, 0.5, 0.0, true), ValueError);
  CHECK_THROWS_AS(optim::SGD({a, a}, 0.1), ValueError);
  CHECK_THROWS_AS(optim::SGD({a * 2.0}, 0.1), ValueError);
  CHECK_THROWS_AS(optim::SGD({Tensor()}, 0.1), ValueError);
  CHECK_THROWS_AS(optim::Adam({a}, 0.1, {1.0, 0.999}), ValueError);

  // zero_grad(false) keeps the buffers and zeroes them.
  a.set_grad(f64(kGrads[1], {4}));
  Tensor g = a.grad();
  sgd.zero_grad(false);
  CHECK(a.grad().same(g));
  CHECK(values(a.grad()) == std::vector<double>(4, 0.0));
}

using tandem::test::set_grads;
using tandem::test::two_models;
using tandem::test::TwoModels;

TEST_CASE("a coalesced model takes one fused optimizer step with the same result", "[nn]") {
  using Make = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;
  const std::vector<std::pair<const char*, Make>> makers{
      {"sgd", [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.1); }},
      {"sgd momentum", [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.1, 0.9, 0.1, 0.01); }},
      {"sgd nesterov", [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.1, 0.9, 0.0, 0.0, true); }},
      {"adam", [](std::vector<Tensor> ps) { return std::make_unique<optim::Adam>(ps, 0.05); }},
      {"adamw", [](std::vector<Tensor> ps) { return std::make_unique<optim::AdamW>(ps, 0.05, std::make_pair(0.9, 0.999), 1e-8, 0.01); }},
  };
  for (const auto& [name, make] : makers) {
    INFO(name);
    TwoModels m = two_models();
    auto fused = make(m.flat_params), plain = make(m.plain_params);
    for (int step = 0; step < 3; ++step) {
      set_grads(m, /*skip_middle=*/step == 2);  // the last step falls back to per-parameter updates
      fused->step();
      plain->step();
      for (size_t k = 0; k < m.flat_params.size(); ++k) {
        CHECK(test::rel_error(m.flat_params[k], m.plain_params[k]) <= 1e-15);
      }
    }
  }
  // The flat path keeps SGD's momentum as views of one buffer.
  TwoModels m = two_models();
  optim::SGD sgd(m.flat_params, 0.1, 0.9);
  set_grads(m);
  sgd.step();
  CHECK(sgd.momentum_buffer(0).storage() == sgd.momentum_buffer(2).storage());
  CHECK(values(sgd.momentum_buffer(1)) == values(m.flat_grads[1]));  // the first step: buf = grad
}

TEST_CASE("optimizer state_dict: PyTorch's names, and a loaded optimizer continues bit for bit", "[nn]") {
  using Make = std::function<std::unique_ptr<optim::Optimizer>(std::vector<Tensor>)>;
  const std::vector<std::tuple<const char*, Make, std::vector<std::string>>> makers{
      {"sgd momentum", [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.1, 0.9, 0.1, 0.01); },
       {"momentum_buffer"}},
      {"adam", [](std::vector<Tensor> ps) { return std::make_unique<optim::Adam>(ps, 0.05); },
       {"step", "exp_avg", "exp_avg_sq"}},
      {"adamw", [](std::vector<Tensor> ps) { return std::make_unique<optim::AdamW>(ps, 0.05); },
       {"step", "exp_avg", "exp_avg_sq"}},
  };
  for (const auto& [name, make, kinds] : makers) {
    INFO(name);
    for (bool flat : {false, true}) {
      INFO("coalesced " << flat);
      // Two identical models: a runs four steps; b runs two, copies a's state after two steps
      // into a fresh optimizer, and runs two more.
      TwoModels ma = two_models(), mb = two_models();
      {
        NoGradGuard no_grad;
        for (size_t k = 0; k < ma.flat_params.size(); ++k) {
          mb.flat_params[k].copy_(ma.flat_params[k]);
          mb.plain_params[k].copy_(ma.flat_params[k]);
        }
      }
      auto pa = flat ? ma.flat_params : ma.plain_params, pb = flat ? mb.flat_params : mb.plain_params;
      auto a = make(pa), b = make(pb);
      CHECK(a->state_dict().size() == 0);  // no state before the first step, as in PyTorch
      auto step_both = [&](optim::Optimizer& x, optim::Optimizer& y) {
        ma.grad_buffer.copy_(uniform({13}, -1.0, 1.0, kFloat64));
        mb.grad_buffer.copy_(ma.grad_buffer);
        for (size_t k = 0; k < pa.size(); ++k) {
          pa[k].set_grad(flat ? ma.flat_grads[k] : ma.flat_grads[k].clone());
          pb[k].set_grad(flat ? mb.flat_grads[k] : mb.flat_grads[k].clone());
        }
        x.step();
        y.step();
      };
      step_both(*a, *b);
      step_both(*a, *b);
      const StateDict sd = a->state_dict();
      REQUIRE(sd.size() == pa.size() * kinds.size());
      size_t at = 0;
      for (size_t i = 0; i < pa.size(); ++i)
        for (const std::string& k : kinds) CHECK(sd.item(at++).first == "state." + std::to_string(i) + "." + k);
      if (kinds.front() == "step") CHECK(sd.find("state.1.step")->item() == 2.0);

      auto c = make(pb);  // a fresh optimizer over b's parameters takes a's state
      c->load_state_dict(sd);
      if (flat) CHECK(c->state_dict().item(kinds.size() - 1).second.storage() ==
                      c->state_dict().item(c->state_dict().size() - 1).second.storage());
      step_both(*a, *c);
      step_both(*a, *c);
      for (size_t k = 0; k < pa.size(); ++k) CHECK(values(pa[k]) == values(pb[k]));
    }
  }
}

TEST_CASE("optimizer load_state_dict names the first tensor that does not fit and changes nothing", "[nn]") {
  TwoModels m = two_models();
  optim::Adam adam(m.plain_params, 0.05);
  for (size_t k = 0; k < m.plain_params.size(); ++k) m.plain_params[k].set_grad(ones(m.plain_params[k].shape(), kFloat64));
  adam.step();
  const StateDict good = adam.state_dict();
  auto with = [&](const std::string& name, const Tensor& t) {
    StateDict s;
    for (const auto& [n, v] : good) s.insert(n, n == name ? t : v);
    if (!s.contains(name)) s.insert(name, t);
    return s;
  };
  const Shape shape1 = m.plain_params[1].shape();
  CHECK(contains(error_message<ShapeError>([&] { adam.load_state_dict(with("state.1.exp_avg", zeros({99}, kFloat64))); }),
                 "state.1.exp_avg"));
  CHECK(contains(error_message<DTypeError>([&] { adam.load_state_dict(with("state.1.exp_avg_sq", zeros(shape1, kFloat32))); }),
                 "state.1.exp_avg_sq"));
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(with("state.9.exp_avg", zeros({1}))); }),
                 "parameter 9 does not exist"));
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(with("state.0.momentum_buffer", zeros({1}))); }),
                 "'momentum_buffer' is not a state of this optimizer"));
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(with("weird", zeros({1}))); }),
                 "'weird' is not a state name"));
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(with("state.0.step", full({}, 1.5))); }),
                 "not a non-negative integer"));
  StateDict partial;
  for (const auto& [n, v] : good)
    if (n != "state.2.exp_avg") partial.insert(n, v);
  CHECK(contains(error_message<ValueError>([&] { adam.load_state_dict(partial); }), "state.2.exp_avg"));
  // Nothing changed: the state is the one before the failed loads.
  const StateDict after = adam.state_dict();
  REQUIRE(after.size() == good.size());
  for (size_t i = 0; i < good.size(); ++i) {
    const bool step = good.item(i).first.find(".step") != std::string::npos;  // a fresh [] tensor each time
    CHECK((step ? values(after.item(i).second) == values(good.item(i).second)
                : after.item(i).second.same(good.item(i).second)));
  }
  // SGD's file into SGD without momentum is accepted (the state is simply unused); an empty
  // state resets.
  optim::SGD sgd(m.plain_params, 0.1, 0.9);
  sgd.step();
  CHECK(sgd.momentum_buffer(0).defined());
  sgd.load_state_dict({});
  CHECK(!sgd.momentum_buffer(0).defined());
}
