// Benchmark mode (cudnn_benchmark(): Note [measured engine choice] and Note [engines timed in a
// graph] in kernels/cuda/cudnn_graph.h): cuDNN's candidate engines for a convolution are run
// and timed -- replayed from a graph of their own, or launched -- and the fastest is kept.
// Whichever engine wins, the result is the same convolution: float32 (TF32 off, as in the whole
// suite) within kTimedTol of the CPU -- looser than the suite's 4e-5 for cuDNN's float32
// convolutions, as the timing may pick a Winograd or FFT engine, which round differently --
// and bfloat16 channels-last within the bf16 tolerance of the heuristics' engine. Inside a capture no timing may run (it synchronizes): the first choice is
// taken, and the captured step replays right.
#include <string>
#include <vector>

#include "catch.h"
#include "core/cuda_graph.h"
#include "core/generator.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/bf16_test_util.h"
#include "kernels/ops.h"

using namespace tandem;
using tandem::test::bf16;
using tandem::test::rel_error;

namespace {

// Every convolution through cuDNN (not tandem's own few-channel kernels); what a test changed
// restored at its end.
struct BenchmarkSettings {
  bool benchmark = cudnn_benchmark(), in_graph = cudnn_benchmark_in_graph(), direct = direct_conv();
  BenchmarkSettings() {
    set_direct_conv(false);
    set_cudnn_benchmark(true);
  }
  ~BenchmarkSettings() {
    set_cudnn_benchmark(benchmark);
    set_cudnn_benchmark_in_graph(in_graph);
    set_direct_conv(direct);
  }
};

Tensor channels_last(const Tensor& t) { return restrided(t, MemoryFormat::ChannelsLast); }

constexpr double kTimedTol = 1e-4;

}  // namespace

TEST_CASE("benchmark mode keeps a convolution's values, its engines timed in a graph or launched",
          "[kernels][cuda][cudnn_benchmark]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  BenchmarkSettings settings;
  // Shapes no other test uses, so that these plans are made here, in this mode.
  const Conv2dParams p{1, 1, 1, 1};
  const Tensor x = uniform({3, 24, 11, 13}, -1.0, 1.0), w = uniform({40, 24, 3, 3}, -0.3, 0.3);
  const Tensor b = uniform({40}, -0.1, 0.1);
  const Tensor y = kernels::conv2d(x, w, b, p);
  const Tensor dy = uniform(y.shape(), -1.0, 1.0);
  const Tensor dx = kernels::conv2d_backward_input(dy, w, p, x.shape());
  const auto [dw, db] = kernels::conv2d_backward_weight(x, dy, p, w.shape(), true);
  for (const bool in_graph : {true, false}) {
    INFO("timed " << (in_graph ? "in a graph" : "as launched"));
    set_cudnn_benchmark_in_graph(in_graph);
    const Tensor xg = x.to(gpu), wg = w.to(gpu), dyg = dy.to(gpu);
    CHECK(rel_error(kernels::conv2d(xg, wg, b.to(gpu), p), y) <= kTimedTol);
    CHECK(rel_error(kernels::conv2d_backward_input(dyg, wg, p, x.shape()), dx) <= kTimedTol);
    const auto [dwg, dbg] = kernels::conv2d_backward_weight(xg, dyg, p, w.shape(), true);
    CHECK(rel_error(dwg, dw) <= kTimedTol);
    CHECK(rel_error(dbg, db) <= kTimedTol);

    // bfloat16 channels-last: the engines of a ResNet's step, against the heuristics' choice.
    const Tensor xb = channels_last(bf16(x).to(gpu)), wb = channels_last(bf16(w).to(gpu));
    const Tensor yb = kernels::conv2d(xb, wb, Tensor(), p);
    set_cudnn_benchmark(false);
    const Tensor yh = kernels::conv2d(xb, wb, Tensor(), p);
    set_cudnn_benchmark(true);
    CHECK(rel_error(yb, yh) <= 1.0 / 64);
  }
}

TEST_CASE("benchmark mode inside a capture takes the first engine and the graph replays right",
          "[kernels][cuda][cudnn_benchmark][cuda_graph]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  BenchmarkSettings settings;
  const Conv2dParams p{1, 1, 0, 0};
  const Tensor w = uniform({12, 20, 3, 3}, -0.3, 0.3);
  Tensor x = zeros({2, 20, 9, 10}, kFloat32, gpu);
  const Tensor wg = w.to(gpu);
  Tensor y = zeros({2, 12, 7, 8}, kFloat32, gpu);
  CUDAGraph g;
  g.capture_begin(gpu);
  kernels::axpby_(1.0, kernels::conv2d(x, wg, Tensor(), p), 0.0, y);  // a plan made while capturing
  g.capture_end();
  REQUIRE(g.captured());
  for (int i = 0; i < 2; ++i) {
    const Tensor xi = uniform(x.shape(), -1.0, 1.0);
    x.copy_(xi.to(gpu));
    g.replay();
    CHECK(rel_error(y, kernels::conv2d(xi, w, Tensor(), p)) <= kTimedTol);
  }
}

TEST_CASE("benchmark mode's rounds and log: every candidate timed, the least time chosen, the values kept",
          "[kernels][cuda][cudnn_benchmark]") {
  TANDEM_REQUIRE_CUDA();
  const Device gpu = Device::cuda(0);
  BenchmarkSettings settings;
  const int rounds = cudnn_benchmark_rounds();
  const bool log = cudnn_benchmark_log();
  set_cudnn_benchmark_rounds(5);
  set_cudnn_benchmark_log(true);
  // A shape no other test uses, so that its plans are made (and timed) here.
  const Conv2dParams p{1, 1, 1, 1};
  const Tensor x = uniform({2, 16, 9, 7}, -1.0, 1.0), w = uniform({24, 16, 3, 3}, -0.3, 0.3);
  std::string text;
  Tensor y;
  {
    test::StderrCapture err;
    y = kernels::conv2d(x.to(gpu), w.to(gpu), Tensor(), p);
    text = err.text();
  }
  set_cudnn_benchmark_rounds(rounds);
  set_cudnn_benchmark_log(log);
  CHECK(rel_error(y, kernels::conv2d(x, w, Tensor(), p)) <= kTimedTol);
  INFO(text);
  // One line for the forward pass's configuration, naming its shapes, when cuDNN offered more
  // than one engine; the choice bracketed once, and it has the least time of the line.
  REQUIRE(test::contains(text, "tandem: cuDNN benchmark, forward x [2,16,9,7] w [24,16,3,3] float32"));
  const std::string line = text.substr(text.find("tandem: cuDNN benchmark, forward"));
  const std::string first = line.substr(0, line.find('\n'));
  std::vector<double> times;
  double chosen = -1;
  for (size_t at = first.find("engine "); at != std::string::npos; at = first.find("engine ", at + 1)) {
    const size_t num = first.find(' ', at + 7) + 1;
    const double ms = std::stod(first.substr(num));
    times.push_back(ms);
    if (at > 0 && first[at - 1] == '[') {
      CHECK(chosen < 0);
      chosen = ms;
    }
  }
  REQUIRE(times.size() >= 2);
  REQUIRE(chosen >= 0);
  for (const double t : times) CHECK(chosen <= t);
}

TEST_CASE("benchmark mode's rounds must be from 1 to 100 and its engines from 1 to 64", "[kernels][cudnn_benchmark]") {
  const int rounds = cudnn_benchmark_rounds(), engines = cudnn_benchmark_engines();
  for (const int bad : {0, -1, 101}) {
    const std::string msg = test::error_message<ValueError>([&] { set_cudnn_benchmark_rounds(bad); });
    CHECK(test::contains(msg, "set_cudnn_benchmark_rounds"));
    CHECK(test::contains(msg, std::to_string(bad)));
  }
  for (const int bad : {0, 65}) {
    const std::string msg = test::error_message<ValueError>([&] { set_cudnn_benchmark_engines(bad); });
    CHECK(test::contains(msg, "set_cudnn_benchmark_engines"));
    CHECK(test::contains(msg, std::to_string(bad)));
  }
  CHECK(cudnn_benchmark_rounds() == rounds);
  CHECK(cudnn_benchmark_engines() == engines);
  set_cudnn_benchmark_rounds(1);
  set_cudnn_benchmark_engines(64);
  CHECK(cudnn_benchmark_rounds() == 1);
  CHECK(cudnn_benchmark_engines() == 64);
  set_cudnn_benchmark_rounds(rounds);
  set_cudnn_benchmark_engines(engines);
}
