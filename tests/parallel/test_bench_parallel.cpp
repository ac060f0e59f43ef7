// Hidden timing runs (not part of the test suite): allreduce bandwidth of each communicator
// and the step time of the trainer and DataParallel. Run with
//   tandem_tests "[.bench-parallel]"
// on a machine with two GPUs (virtual CPU devices otherwise, with small sizes).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel;
using namespace tandem::test;

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double median_ms(const std::vector<Device>& devices, int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  synchronize(devices);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    f();
    synchronize(devices);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<Device> bench_devices() {
  return cuda_device_count() >= 2 ? cuda_devices(2) : cpu_devices(2);
}

}  // namespace

TEST_CASE("allreduce bandwidth per communicator", "[.bench-parallel]") {
  const auto devices = bench_devices();
  const bool gpu = devices[0].is_cuda();
  enable_peer_access(devices);
  const size_t n = devices.size();
  std::printf("allreduce on %zu x %s\n%-6s %12s %10s %10s %10s\n", n, devices[0].str().c_str(),
              "comm", "bytes", "us", "algbw GB/s", "busbw GB/s");
  const std::vector<int64_t> sizes = gpu ? std::vector<int64_t>{1 << 10, 1 << 18, 1 << 24, 1 << 26}
                                         : std::vector<int64_t>{1 << 10, 1 << 18};
  for (const std::string& name : communicator_names(devices)) {
    auto comm = make_communicator(name, devices);
    for (int64_t numel : sizes) {
      std::vector<Tensor> ts;
      for (Device d : devices) ts.push_back(ones({numel}, kFloat32, d));
      const double ms = median_ms(devices, 3, 10, [&] { comm->allreduce_sum(ts); });
      const double bytes = double(numel) * 4;
      const double algbw = bytes / (ms * 1e-3) / 1e9;
      std::printf("%-6s %12.0f %10.1f %10.2f %10.2f\n", name.c_str(), bytes, ms * 1e3, algbw,
                  algbw * 2.0 * double(n - 1) / double(n));
    }
  }
}

TEST_CASE("training step time: one device, ScratchTrainer, DataParallel", "[.bench-parallel]") {
  const auto devices = bench_devices();
  const int64_t batch = devices[0].is_cuda() ? 256 : 32;
  Generator gen(1);
  auto [x, y] = random_batch(batch, {1, 28, 28}, 10, gen, devices[0]);
  const std::vector<Device> one = {devices[0]};
  std::printf("LeNet, batch %lld, median step time\n", static_cast<long long>(batch));
  for (const auto& devs : {one, devices}) {
    for (const std::string& name : communicator_names(devs)) {
      ScratchTrainer t(std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)), devs, name,
                       sgd_factory(0.1, 0.9));
      const double ms = median_ms(devs, 5, 30, [&] { t.train_batch(x, y); });
      std::printf("  ScratchTrainer %zu device(s), %-5s %8.3f ms\n", devs.size(), name.c_str(), ms);
    }
    if (const char* path = std::getenv("TANDEM_TRACE_OUT"); path && devs.size() > 1) {
      // A timeline of a few steps with the last communicator, for Perfetto.
      ScratchTrainer t(std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)), devs,
                       communicator_names(devs).back(), sgd_factory(0.1, 0.9));
      for (int i = 0; i < 5; ++i) t.train_batch(x, y);
      Trace trace(devs);
      t.set_trace(&trace);
      for (int i = 0; i < 3; ++i) t.train_batch(x, y);
      trace.write(path);
    }
    DataParallel dp(std::shared_ptr<nn::Module>(nn::models::lenet({}, gen)), devs);
    nn::optim::SGD opt(dp.parameters(), 0.1, 0.9);
    const double ms = median_ms(devs, 5, 30, [&] {
      opt.zero_grad();
      cross_entropy(dp(x), y).backward();
      opt.step();
    });
    std::printf("  DataParallel   %zu device(s)        %8.3f ms\n", devs.size(), ms);
  }
}

TEST_CASE("ResNet-18 step time on one and two GPUs", "[.bench-parallel]") {
  if (cuda_device_count() < 2) {
    WARN("needs two GPUs");
    return;
  }
  const auto devices = cuda_devices(2);
  const int64_t batch = 512;
  Generator gen(2);
  auto [x, y] = random_batch(batch, {1, 28, 28}, 10, gen, devices[0]);
  std::printf("ResNet-18, global batch %lld, median step time\n", static_cast<long long>(batch));
  for (const auto& devs : {std::vector<Device>{devices[0]}, devices}) {
    for (const std::string& name : communicator_names(devs)) {
      if (devs.size() == 1 && name != "naive") continue;
      ScratchTrainer t(std::shared_ptr<nn::Module>(nn::models::resnet18(10, 1, gen)), devs, name,
                       sgd_factory(0.05, 0.9));
      const double ms = median_ms(devs, 3, 10, [&] { t.train_batch(x, y); });
      std::printf("  ScratchTrainer %zu GPU(s), %-5s %8.2f ms\n", devs.size(), name.c_str(), ms);
    }
  }
}
