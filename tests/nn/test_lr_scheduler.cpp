// Learning-rate schedulers: hand-computed sequences, the optimizer's lr following them, bad
// arguments, the example's cosine schedule, and PyTorch's sequences where python3 has torch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "data/data_test_util.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/optim/sgd.h"

using namespace tandem;
using namespace tandem::nn::optim;

namespace {

Tensor param() {
  Tensor p = zeros({2});
  p.set_requires_grad();
  return p;
}

// lr after construction, then after each of n - 1 steps; checks the optimizer follows along.
std::vector<double> run(LRScheduler& s, int n) {
  std::vector<double> lrs;
  for (int e = 0; e < n; ++e) {
    if (e > 0) s.step();
    REQUIRE(s.last_epoch() == e);
    if (s.optimizer() != nullptr) REQUIRE(s.optimizer()->lr() == s.get_last_lr());
    lrs.push_back(s.get_last_lr());
  }
  return lrs;
}

void require_close(const std::vector<double>& got, const std::vector<double>& want, double rel = 1e-15) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("epoch " << i << ": " << got[i] << " vs " << want[i]);
    REQUIRE(std::abs(got[i] - want[i]) <= rel * std::max(std::abs(want[i]), 1.0));
  }
}

}  // namespace

TEST_CASE("StepLR decays by gamma every step_size epochs", "[nn][optim][lr_scheduler]") {
  SGD opt({param()}, 0.1);
  StepLR s(opt, 3, 0.5);
  require_close(run(s, 8), {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025});
}

TEST_CASE("CosineAnnealingLR follows its closed form, past T_max too", "[nn][optim][lr_scheduler]") {
  SGD opt({param()}, 1.0);
  CosineAnnealingLR s(opt, 4, 0.1);
  const double c = std::cos(std::acos(-1.0) / 4);  // cos(pi / 4)
  require_close(run(s, 9), {1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c), 0.1, 0.1 + 0.45 * (1 - c),
                            0.55, 0.1 + 0.45 * (1 + c), 1.0});
}

TEST_CASE("LinearLR warms up to end_factor and stays", "[nn][optim][lr_scheduler]") {
  SGD opt({param()}, 0.05);
  LinearLR s(opt, 0.5, 1.0, 4);  // PyTorch's documented example
  REQUIRE(opt.lr() == 0.025);    // the initial step already applies start_factor
  require_close(run(s, 7), {0.025, 0.03125, 0.0375, 0.04375, 0.05, 0.05, 0.05});
}

TEST_CASE("SequentialLR runs warm-up then cosine from the first phase's base lr", "[nn][optim][lr_scheduler]") {
  SGD opt({param()}, 1.0);
  auto warm = std::make_shared<LinearLR>(opt, 0.1, 1.0, 2);
  auto cosine = std::make_shared<CosineAnnealingLR>(opt, 4);  // built while opt.lr() == 0.1
  SequentialLR s(opt, {warm, cosine}, {2});
  REQUIRE(s.base_lr() == 1.0);
  const double c = std::cos(std::acos(-1.0) / 4);
  require_close(run(s, 7), {0.1, 0.55, 1.0, 0.5 * (1 + c), 0.5, 0.5 * (1 - c), 0.0});
}

TEST_CASE("a scheduler without an optimizer only computes the lr", "[nn][optim][lr_scheduler]") {
  StepLR s(0.2, 1, 0.5);
  REQUIRE(s.optimizer() == nullptr);
  require_close(run(s, 3), {0.2, 0.1, 0.05});
  REQUIRE(s.lr_at(10) == 0.2 * std::pow(0.5, 10));
}

// Note: the lenet/resnet examples' --lr-schedule cosine used to compute, for epoch e of E,
// lr * 0.5 * (1 + cos(pi * (e - 1) / E)); it now asks CosineAnnealingLR(lr, E) for epoch e - 1.
// The two must agree bit for bit, or the examples' numbers would change.
TEST_CASE("CosineAnnealingLR reproduces the examples' former cosine schedule bit for bit", "[nn][optim][lr_scheduler]") {
  const double pi = std::acos(-1.0);
  for (double lr : {0.9, 0.1, 0.05, 3e-4}) {
    for (int64_t epochs : {1, 3, 10, 30}) {
      CosineAnnealingLR s(lr, epochs);
      for (int64_t e = 1; e <= epochs; ++e) {
        const double before = lr * 0.5 * (1.0 + std::cos(pi * static_cast<double>(e - 1) / static_cast<double>(epochs)));
        REQUIRE(s.get_last_lr() == before);
        s.step();
      }
    }
  }
}

TEST_CASE("lr schedulers reject bad arguments", "[nn][optim][lr_scheduler]") {
  SGD opt({param()}, 0.1), other({param()}, 0.1);
  REQUIRE_THROWS_AS(StepLR(opt, 0), ValueError);
  REQUIRE_THROWS_AS(CosineAnnealingLR(opt, 0), ValueError);
  REQUIRE_THROWS_AS(LinearLR(opt, 0.0), ValueError);
  REQUIRE_THROWS_AS(LinearLR(opt, 1.5), ValueError);
  REQUIRE_THROWS_AS(LinearLR(opt, 0.5, 1.2), ValueError);
  REQUIRE_THROWS_AS(LinearLR(opt, 0.5, 1.0, 0), ValueError);
  REQUIRE_THROWS_AS(StepLR(-1.0, 2), ValueError);
  REQUIRE_THROWS_AS(StepLR(0.1, 2).lr_at(-1), ValueError);
  auto a = std::make_shared<StepLR>(opt, 2);
  auto b = std::make_shared<StepLR>(opt, 2);
  REQUIRE_THROWS_AS(SequentialLR(opt, {}, {}), ValueError);
  REQUIRE_THROWS_AS(SequentialLR(opt, {a, b}, {}), ValueError);
  REQUIRE_THROWS_AS(SequentialLR(opt, {a, b}, {0}), ValueError);
  REQUIRE_THROWS_AS(SequentialLR(opt, {a, nullptr}, {2}), ValueError);
  REQUIRE_THROWS_AS(SequentialLR(other, {a, b}, {2}), ValueError);
  auto c = std::make_shared<StepLR>(opt, 2);
  REQUIRE_THROWS_AS(SequentialLR(opt, {a, b, c}, {3, 3}), ValueError);
}

TEST_CASE("lr schedulers match PyTorch's sequences", "[nn][optim][lr_scheduler][pytorch]") {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    WARN("no python3 with torch on this machine: the comparison with PyTorch is skipped");
    return;
  }
  tandem::test::TempDir dir;
  const std::string script = dir.file("sched.py"), out = dir.file("sched.txt");
  std::ofstream(script) << R"(import warnings
warnings.filterwarnings("ignore")
import torch
from torch.optim import lr_scheduler as L
def seq(lr, make, n=12):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=lr)
    s = make(opt)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(n - 1):
        opt.step()
        s.step()
        out.append(opt.param_groups[0]["lr"])
    print(" ".join(repr(v) for v in out))
seq(0.1, lambda o: L.StepLR(o, 3, 0.5))
seq(0.1, lambda o: L.CosineAnnealingLR(o, 5, 0.01))
seq(0.05, lambda o: L.LinearLR(o, 0.25, 1.0, 4))
seq(0.1, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 3), L.CosineAnnealingLR(o, 6)], [3]))
)";
  REQUIRE(std::system(("/usr/bin/python3 " + script + " > " + out).c_str()) == 0);
  std::ifstream in(out);
  std::vector<std::vector<double>> torch_lrs;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ss(line);
    std::vector<double> v;
    for (double x; ss >> x;) v.push_back(x);
    torch_lrs.push_back(v);
  }
  REQUIRE(torch_lrs.size() == 4);
  SGD o1({param()}, 0.1), o2({param()}, 0.1), o3({param()}, 0.05), o4({param()}, 0.1);
  StepLR step(o1, 3, 0.5);
  CosineAnnealingLR cosine(o2, 5, 0.01);
  LinearLR linear(o3, 0.25, 1.0, 4);
  SequentialLR sequential(o4, {std::make_shared<LinearLR>(o4, 0.1, 1.0, 3), std::make_shared<CosineAnnealingLR>(o4, 6)},
                          {3});
  // PyTorch steps through the chainable forms: equal to the closed forms to rounding.
  require_close(run(step, 12), torch_lrs[0], 1e-12);
  require_close(run(cosine, 12), torch_lrs[1], 1e-12);
  require_close(run(linear, 12), torch_lrs[2], 1e-12);
  require_close(run(sequential, 12), torch_lrs[3], 1e-12);
}
