// The in-process pipeline on virtual CPU devices, one worker thread per stage: the bubble
// where each stage has a core of its own (docs/11-pipelines.md, "The bubble with a core per
// stage"). Stages of equal cost, L x (Linear(W, W) + ReLU) each, as the multi-process
// measurement (bench/pipeline_cpu.py) has them, but the activations cross between stages as
// copies in one address space instead of messages through Gloo.
//
//   bench_pipeline --stages P --schedule gpipe|1f1b --micro-batches M [--steps S] [--width W]
//                  [--layers L] [--batch B | --micro-batch-rows R] [--trace FILE]
//
// --batch B (default 256) fixes the batch and cuts it into M micro-batches, so an action gets
// cheaper as M grows; --micro-batch-rows R fixes the micro-batch instead (batch R x M), so every
// action costs the same whatever M, as (P - 1)/(M + P - 1) assumes (GPipe's setting).
//
// Prints one line: "P 4 1f1b M 8 batch 256 steps 9: 12.34 ms per step". With --trace the
// timeline of the steps after the first (one process per stage, one span per action) goes to
// FILE, for scripts/pipeline_idle.py. Exit 2 on bad arguments, 1 on a failure.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench_args.h"

#include "autograd/ops.h"
#include "core/generator.h"
#include "nn/nn.h"
#include "parallel/device_api.h"
#include "parallel/pipeline/pipeline.h"

using namespace tandem;
namespace pp = tandem::parallel::pipeline;

namespace {

constexpr const char* kProgram = "bench_pipeline";
[[noreturn]] void usage(const std::string& why) { bench::usage(kProgram, why); }
long number(const std::string& flag, const char* value) { return bench::positive(kProgram, flag, value); }

}  // namespace

int main(int argc, char** argv) {
  int P = 2, M = 4, steps = 10;
  int64_t width = 512, layers = 4, batch = 0, rows = 0;
  std::string schedule = "1f1b", trace_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const char* v = argv[++i];
    if (a == "--stages") P = int(number(a, v));
    else if (a == "--micro-batches") M = int(number(a, v));
    else if (a == "--steps") steps = int(number(a, v));
    else if (a == "--width") width = number(a, v);
    else if (a == "--layers") layers = number(a, v);
    else if (a == "--batch") batch = number(a, v);
    else if (a == "--micro-batch-rows") rows = number(a, v);
    else if (a == "--schedule") schedule = v;
    else if (a == "--trace") trace_path = v;
    else usage("unknown argument " + a);
  }
  if (steps < 2) usage("--steps must be at least 2 (the first warms up)");
  if (batch > 0 && rows > 0) usage("give --batch or --micro-batch-rows, not both");
  if (rows > 0) batch = rows * M;
  else if (batch == 0) batch = 256;
  try {
    Generator gen(5);
    auto model = std::make_shared<nn::SequentialImpl>();
    for (int64_t k = 0; k < layers * P; ++k) {
      model->push_back(std::make_shared<nn::Linear>(width, width, true, gen));
      model->push_back(std::make_shared<nn::ReLU>());
    }
    const std::vector<Device> devices = parallel::cpu_devices(P);
    pp::Pipeline pipe(pp::split_by_balance(*model, std::vector<int64_t>(size_t(P), 2 * layers), devices),
                      pp::schedule_by_name(schedule, P, M),
                      [](const Tensor& out, const Tensor&) { return mean(out * out); });
    nn::optim::SGD opt(pipe.parameters(), 1e-3);
    parallel::Trace trace(devices);
    const Tensor x = randn({batch, width}, kFloat32, kCPU, &gen), y = zeros({batch}, kFloat32);
    double ms = 0;
    for (int k = 0; k < steps; ++k) {
      pipe.set_trace(k > 0 && !trace_path.empty() ? &trace : nullptr);  // the first step warms up
      opt.zero_grad();
      const auto t0 = std::chrono::steady_clock::now();
      pipe.step(x, y);
      opt.step();
      if (k > 0) ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("P %d %s M %d batch %lld steps %d: %.3f ms per step\n", P, schedule.c_str(), M,
                static_cast<long long>(batch), steps - 1, ms / (steps - 1));
    if (!trace_path.empty()) trace.write(trace_path);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
    return 1;
  }
}
