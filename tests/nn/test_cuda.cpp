// nn on a GPU: the same module and optimizer give the same numbers as on the CPU.
#include <memory>

#include "helpers.h"
#include "nn/nn.h"
#include "nn_test_util.h"

using namespace tandem;
using namespace tandem::nn;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::rel_error;

namespace {

// One forward, backward and optimizer step of `cpu_net` on the CPU and of its clone on cuda:0;
// compares outputs, gradients, updated parameters and buffers.
template <typename MakeOpt>
void compare_step(const std::shared_ptr<Module>& cpu_net, const Tensor& x, const Tensor& y,
                  MakeOpt make_opt, double tol) {
  const Device gpu = Device::cuda(0);
  std::shared_ptr<Module> gpu_net = cpu_net->clone();
  gpu_net->to(gpu);
  for (const auto& p : gpu_net->parameters()) {
    REQUIRE(p.device() == gpu);
    REQUIRE(p.is_leaf());
    REQUIRE(p.requires_grad());
  }
  auto cpu_opt = make_opt(cpu_net->parameters());
  auto gpu_opt = make_opt(gpu_net->parameters());

  Tensor out_cpu = (*cpu_net)(x), out_gpu = (*gpu_net)(x.to(gpu));
  CHECK(out_gpu.device() == gpu);
  CHECK(rel_error(out_gpu, out_cpu) < tol);
  cross_entropy(out_cpu, y).backward();
  cross_entropy(out_gpu, y.to(gpu)).backward();
  auto pc = cpu_net->named_parameters(), pg = gpu_net->named_parameters();
  for (const auto& [name, p] : pc) {
    INFO(name);
    REQUIRE(pg.at(name).grad().defined());
    CHECK(rel_error(pg.at(name).grad(), p.grad()) < tol);
  }
  cpu_opt->step();
  gpu_opt->step();
  auto sc = cpu_net->state_dict(), sg = gpu_net->state_dict();
  for (const auto& [name, t] : sc) {
    INFO(name);
    CHECK(rel_error(sg.at(name), t) < tol);
  }
}

}  // namespace

TEST_CASE("LeNet on CUDA matches the CPU", "[nn][cuda]") {
  TANDEM_REQUIRE_CUDA();
  Tensor x = randn({8, 1, 28, 28});
  Tensor y = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7}, {8});
  for (auto act : {models::LeNetActivation::Sigmoid, models::LeNetActivation::ReLU}) {
    auto net = models::lenet({act});
    compare_step(
        net, x, y,
        [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.1, 0.9); }, 1e-4);
    auto net2 = models::lenet({act});
    compare_step(
        net2, x, y, [](std::vector<Tensor> ps) { return std::make_unique<optim::Adam>(ps, 1e-3); },
        1e-4);
  }
}

TEST_CASE("conv, BatchNorm and Residual on CUDA match the CPU", "[nn][cuda]") {
  TANDEM_REQUIRE_CUDA();
  Generator gen(31);
  auto net = std::make_shared<SequentialImpl>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, gen), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(), std::make_shared<Residual>(8, 16, true, 2, gen),
      std::make_shared<Residual>(16, 16, false, 1, gen), std::make_shared<GlobalAvgPool2d>(),
      std::make_shared<Flatten>(), std::make_shared<Linear>(16, 4, true, gen)});
  Tensor x = randn({6, 1, 12, 12});
  Tensor y = from_vector<int64_t>({0, 1, 2, 3, 0, 1}, {6});
  compare_step(
      net, x, y,
      [](std::vector<Tensor> ps) { return std::make_unique<optim::SGD>(ps, 0.05, 0.9, 0.0, 1e-4); },
      1e-4);
  net->eval();
  auto gpu_net = net->clone();
  gpu_net->to(Device::cuda(0));
  CHECK(rel_error((*gpu_net)(x.to(Device::cuda(0))), (*net)(x)) < 1e-4);
}

TEST_CASE("a module on CUDA rejects CPU input by name", "[nn][cuda]") {
  TANDEM_REQUIRE_CUDA();
  Linear lin(3, 2);
  Tensor w = lin.weight();
  lin.to(Device::cuda(0));
  CHECK(lin.weight().same(w));
  CHECK(w.device() == Device::cuda(0));
  std::string msg = error_message<DeviceError>([&] { lin(randn({2, 3})); });
  CHECK(contains(msg, "Linear"));
  CHECK(contains(msg, "cpu:0"));
  CHECK(contains(msg, "cuda:0"));
  lin.to(kCPU);
  CHECK(lin(randn({2, 3})).device() == kCPU);
}
