// Where does one training step's time go? Runs ResNet-18 or LeNet training steps on random data
// on one device and prints, per step (medians of --reps repetitions of --steps steps):
//
//   host_ms   host time to *enqueue* one step on an idle GPU (until the step function returns;
//             nothing waits for the GPU, and the launch queue is far from full)
//   wall_ms   time per step with the GPU kept busy (enqueue --steps steps, then synchronize)
//   fwd_ms, fwd_bwd_ms   the step cut after forward / after backward (each synchronized alone)
//
// host_ms close to wall_ms means the step is bound by the host (launch and bookkeeping cost);
// host_ms far below wall_ms means the GPU is the bottleneck and kernel time is what to cut.
// With --host-ops it also prints the host cost of single operations on a stage-1 ResNet
// activation ([B, 64, 28, 28]): what each call costs the launching thread, against its GPU time.
// With --profile, the CUDA profiler (ncu --profile-from-start off) sees exactly one step after
// the warm-up. Prints one JSON line.
//
//   bench_step --model resnet18|lenet --device cuda:0 [--batch-size 256] [--steps 20] [--reps 5]
#include <algorithm>
#include <functional>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "common/args.h"
#include "core/device.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "nn/models/lenet.h"
#include "nn/models/resnet.h"
#include "nn/optim/sgd.h"

#ifdef TANDEM_WITH_CUDA
#include <cuda_profiler_api.h>
#endif

using namespace tandem;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Host microseconds per call of f (n calls enqueued back to back on an idle GPU) and the
// microseconds per call until the GPU has finished them all.
void time_op(const char* name, Device dev, int n, const std::function<void()>& f) {
  f();
  synchronize(dev);
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) f();
  const double host = ms_since(t0) * 1000 / n;
  synchronize(dev);
  const double gpu = ms_since(t0) * 1000 / n;
  std::printf("{\"kind\": \"host_op\", \"op\": \"%s\", \"host_us\": %.2f, \"total_us\": %.2f}\n", name, host,
              gpu);
}

void host_ops(Device dev, int64_t bs) {
  Tensor x = randn({bs, 64, 28, 28}, kFloat32, dev), w = randn({64, 64, 3, 3}, kFloat32, dev);
  Tensor b = randn({64}, kFloat32, dev), g = ones({64}, kFloat32, dev), rm = zeros({64}, kFloat32, dev);
  Tensor rv = ones({64}, kFloat32, dev), small = randn({64}, kFloat32, dev), buf = zeros({64}, kFloat32, dev);
  Conv2dParams p{1, 1, 1, 1};
  auto bn = kernels::batch_norm_train(x, g, b, rm, rv, 0.1, 1e-5);
  const int n = 50;
  time_op("alloc+free 51MB", dev, n, [&] { Tensor t = empty(x.shape(), kFloat32, dev); });
  time_op("relu (unary)", dev, n, [&] { kernels::unary(UnaryOp::Relu, x); });
  time_op("add (binary)", dev, n, [&] { kernels::binary(BinaryOp::Add, x, x); });
  time_op("relu, tiny tensor", dev, n, [&] { kernels::unary(UnaryOp::Relu, small); });
  time_op("conv2d fwd + bias", dev, n, [&] { kernels::conv2d(x, w, b, p); });
  time_op("conv2d bwd data", dev, n, [&] { kernels::conv2d_backward_input(x, w, p, x.shape()); });
  time_op("conv2d bwd weight+bias", dev, n, [&] { kernels::conv2d_backward_weight(x, x, p, w.shape(), true); });
  time_op("batch_norm_train", dev, n, [&] { kernels::batch_norm_train(x, g, b, rm, rv, 0.1, 1e-5); });
  time_op("batch_norm_backward", dev, n,
          [&] { kernels::batch_norm_backward(x, x, g, bn.save_mean, bn.save_invstd); });
  SgdParams sp;
  sp.lr = 0.01;
  time_op("sgd_step tiny", dev, n, [&] { kernels::sgd_step(small, small, buf, sp); });
  Tensor xr = x.detach();
  xr.set_requires_grad(true);
  time_op("relu with autograd node", dev, n, [&] { relu(xr); });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  examples::Args args("bench_step", "Splits one training step's time into host and GPU parts.");
  args.option("model", "resnet18", "lenet|resnet18");
  args.option("device", "cuda:0", "device to run on");
  args.option("batch-size", "256", "images per step");
  args.option("steps", "20", "steps per repetition");
  args.option("reps", "5", "repetitions (the median is printed)");
  args.flag("host-ops", "also time single operations: host cost against GPU time");
  args.flag("profile", "bracket one step with cudaProfilerStart/Stop (for ncu)");
  try {
    if (!args.parse(argc, argv)) {
      std::fputs(args.help().c_str(), stdout);
      return 0;
    }
    std::string model_name = args.choice("model", {"lenet", "resnet18"});
    Device dev = Device::parse(args.str("device"));
    check_device_exists(dev);
    int64_t bs = args.integer("batch-size", 1, 1 << 20);
    int steps = static_cast<int>(args.integer("steps", 1, 100000));
    int reps = static_cast<int>(args.integer("reps", 1, 1000));
    DeviceGuard guard(dev);

    Generator gen(0);
    std::shared_ptr<nn::Module> model = model_name == "lenet"
                                            ? std::shared_ptr<nn::Module>(nn::models::lenet({}, gen))
                                            : std::shared_ptr<nn::Module>(nn::models::resnet18(10, 1, gen));
    model->to(dev);
    model->train();
    nn::optim::SGD opt(model->parameters(), model_name == "lenet" ? 0.9 : 0.05);
    Tensor x = randn({bs, 1, 28, 28}, kFloat32, dev);
    std::vector<int64_t> labels(static_cast<size_t>(bs));
    for (int64_t i = 0; i < bs; ++i) labels[static_cast<size_t>(i)] = (i * 7) % 10;
    Tensor y = from_vector(labels, {bs}, dev);

    // phase 0: forward only, 1: + backward, 2: + optimizer step (a whole step)
    auto run = [&](int phase) {
      opt.zero_grad();
      Tensor loss = cross_entropy((*model)(x), y);
      if (phase >= 1) loss.backward();
      if (phase >= 2) opt.step();
    };
    for (int i = 0; i < 5; ++i) run(2);  // warm-up: cuDNN plans, pool growth
    synchronize(dev);

    std::vector<double> host, wall, fwd, fwd_bwd;
    for (int r = 0; r < reps; ++r) {
      for (int i = 0; i < steps; ++i) {
        synchronize(dev);
        auto t = Clock::now();
        run(2);
        host.push_back(ms_since(t));
      }
      synchronize(dev);
      auto t0 = Clock::now();
      for (int i = 0; i < steps; ++i) run(2);
      synchronize(dev);
      wall.push_back(ms_since(t0) / steps);
      for (int phase = 0; phase < 2; ++phase) {
        auto t1 = Clock::now();
        for (int i = 0; i < steps; ++i) run(phase);
        synchronize(dev);
        (phase == 0 ? fwd : fwd_bwd).push_back(ms_since(t1) / steps);
      }
    }
    if (args.on("host-ops")) host_ops(dev, bs);
#ifdef TANDEM_WITH_CUDA
    if (args.on("profile") && dev.is_cuda()) {
      synchronize(dev);
      cudaProfilerStart();
      run(2);
      synchronize(dev);
      cudaProfilerStop();
    }
#endif
    std::printf("{\"framework\": \"tandem\", \"kind\": \"step\", \"model\": \"%s\", \"batch_size\": %lld, "
                "\"tf32\": %d, \"cudnn_benchmark\": %d, \"host_ms\": %.3f, \"wall_ms\": %.3f, "
                "\"fwd_ms\": %.3f, \"fwd_bwd_ms\": %.3f, \"images_per_s\": %.1f}\n",
                model_name.c_str(), static_cast<long long>(bs), allow_tf32() ? 1 : 0,
                cudnn_benchmark() ? 1 : 0, median(host), median(wall), median(fwd), median(fwd_bwd),
                1000.0 * static_cast<double>(bs) / median(wall));
    return 0;
  } catch (const examples::ArgsError& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: error: %s\n", e.what());
    return 1;
  }
}
