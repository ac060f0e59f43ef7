// LeNet's two convolutions, pass by pass, through every kernel tandem has for them: cuDNN with
// its heuristics' engine and with timed engines, the per-tap direct kernels (Note [direct
// convolution] in kernels/cuda/conv_direct.cu) and the row-window kernels (Note [row
// convolution] in kernels/cuda/conv_rows.cu); float32, NCHW, batch 256, on one GPU.
//
// Each figure is the median over --runs replays of a CUDA graph of 20 calls, divided by 20: the
// time a call takes inside a replayed training step, launch gaps included. Beside the row
// kernels' time, their largest difference from cuDNN's result relative to its largest value.
// "-" where a kernel does not take the pass.
//
//   bench_conv_small [--batch N] [--runs R] [--layer conv1|conv2] [--pass fwd|dgrad|wgrad]
//
// --layer and --pass keep one layer or pass (to profile one kernel).
//
// Exit 2 on bad arguments, 1 on a failure (a CUDA or cuDNN error, no GPU).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_args.h"
#include "bench_cuda.h"
#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/cuda/conv_direct.h"
#include "kernels/cuda/conv_rows.h"
#include "kernels/ops.h"

using namespace tandem;
namespace k = tandem::kernels;

namespace {

constexpr const char* kProgram = "bench_conv_small";
constexpr int kCallsPerGraph = 20;
const Device kGpu = Device::cuda(0);
int runs = 50;

// The median time of one call of f inside a replayed graph, in microseconds.
double graph_us(const std::function<void()>& f) {
  f();
  f();  // plans made, engines timed, outside the capture
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream(kGpu)));
  CUDAGraph graph;
  graph.capture_begin(kGpu);
  for (int i = 0; i < kCallsPerGraph; ++i) f();
  graph.capture_end();
  graph.replay();
  return bench::median_us(current_cuda_stream(kGpu), runs, [&] { graph.replay(); }, kCallsPerGraph);
}

using bench::relative_error;

std::string cell(double us) {
  if (us < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", us);
  return buf;
}

struct Layer {
  const char* name;
  Shape x, w;
  Conv2dParams p;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 256;
  std::string only_layer, only_pass;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--batch" && i + 1 < argc) {
      batch = bench::positive(kProgram, a, argv[++i]);
    } else if (a == "--runs" && i + 1 < argc) {
      runs = static_cast<int>(bench::positive(kProgram, a, argv[++i]));
    } else if (a == "--layer" && i + 1 < argc) {
      only_layer = argv[++i];
      if (only_layer != "conv1" && only_layer != "conv2") bench::usage(kProgram, "--layer " + only_layer + " is not conv1 or conv2");
    } else if (a == "--pass" && i + 1 < argc) {
      only_pass = argv[++i];
      if (only_pass != "fwd" && only_pass != "dgrad" && only_pass != "wgrad")
        bench::usage(kProgram, "--pass " + only_pass + " is not fwd, dgrad or wgrad");
    } else {
      bench::usage(kProgram, "unknown argument " + a);
    }
  }
  try {
    if (cuda_device_count() < 1) {
      std::fprintf(stderr, "%s: no CUDA device\n", kProgram);
      return 1;
    }
    const Layer layers[] = {{"conv1 1->6 28x28 pad 2", {batch, 1, 28, 28}, {6, 1, 5, 5}, {1, 1, 2, 2}},
                            {"conv2 6->16 14x14", {batch, 6, 14, 14}, {16, 6, 5, 5}, {1, 1, 0, 0}}};
    std::printf("%-24s %-6s %10s %10s %10s %10s %10s\n", "layer", "pass", "cudnn heur", "cudnn timed",
                "direct", "rows", "rows err");
    cudaStream_t s = current_cuda_stream(kGpu);
    for (const Layer& L : layers) {
      if (!only_layer.empty() && std::string(L.name).rfind(only_layer, 0) != 0) continue;
      const Tensor x = uniform(L.x, -1.0, 1.0, kFloat32).to(kGpu), w = uniform(L.w, -1.0, 1.0, kFloat32).to(kGpu);
      const Tensor b = uniform({L.w[0]}, -1.0, 1.0, kFloat32).to(kGpu);
      set_direct_conv(false);
      const Tensor y_ref = k::conv2d(x, w, b, L.p);
      const Tensor dy = uniform(y_ref.shape(), -1.0, 1.0, kFloat32).to(kGpu);
      const Tensor dx_ref = k::conv2d_backward_input(dy, w, L.p, L.x);
      auto [dw_ref, db_ref] = k::conv2d_backward_weight(x, dy, L.p, L.w, true);
      Tensor y = empty(y_ref.shape(), kFloat32, kGpu), dx = empty(L.x, kFloat32, kGpu);
      Tensor dw = empty(L.w, kFloat32, kGpu), db = empty({L.w[0]}, kFloat32, kGpu);
      for (int pass = 0; pass < 3; ++pass) {
        const char* pname = pass == 0 ? "fwd" : pass == 1 ? "dgrad" : "wgrad";
        if (!only_pass.empty() && only_pass != pname) continue;
        double cudnn[2] = {-1, -1};
        for (int timed = 0; timed < 2; ++timed) {
          set_direct_conv(false);
          set_cudnn_benchmark(timed == 1);
          cudnn[timed] = graph_us([&] {
            if (pass == 0) (void)k::conv2d(x, w, b, L.p);
            if (pass == 1) (void)k::conv2d_backward_input(dy, w, L.p, L.x);
            if (pass == 2) (void)k::conv2d_backward_weight(x, dy, L.p, L.w, true);
          });
        }
        set_cudnn_benchmark(false);
        set_direct_conv(true);
        double direct = -1, rows = -1, err = -1;
        if (pass == 0 && gpu::direct_conv_applies(gpu::DirectPass::Forward, x, w, y, L.p))
          direct = graph_us([&] { gpu::direct_conv_forward(x, w, b, L.p, y, s); });
        std::string sweep;
        if (pass == 0 && direct < 0 && gpu::direct_conv_applies(gpu::DirectPass::ForwardAnyTaps, x, w, y, L.p)) {
          // A layer the direct forward leaves to cuDNN for its many taps: what it would take.
          const double us = graph_us([&] { gpu::direct_conv_forward(x, w, b, L.p, y, s); });
          char buf[96];
          std::snprintf(buf, sizeof buf, " direct, past its taps limit: %.2f (err %.1e)", us, relative_error(y, y_ref));
          sweep = buf;
        }
        if (pass == 2 && gpu::direct_conv_applies(gpu::DirectPass::BackwardWeight, x, dw, dy, L.p)) {
          direct = graph_us([&] { gpu::direct_conv_backward_weight(x, dy, L.p, dw, db, s); });
          const double direct_err = std::max(relative_error(dw, dw_ref), relative_error(db, db_ref));
          // The direct kernel's launch shapes beside the default: images per block x threads.
          for (int images : {1, 2, 4}) {
            for (int threads : {256, 512}) {
              set_direct_wgrad_shape({images, threads});
              if (!gpu::direct_conv_applies(gpu::DirectPass::BackwardWeight, x, dw, dy, L.p)) continue;
              const double us = graph_us([&] { gpu::direct_conv_backward_weight(x, dy, L.p, dw, db, s); });
              const double e = std::max(relative_error(dw, dw_ref), relative_error(db, db_ref));
              char buf[96];
              std::snprintf(buf, sizeof buf, "  %dx%d %.2f (err %.1e)", images, threads, us, e);
              sweep += buf;
            }
          }
          set_direct_wgrad_shape({});
          char buf[64];
          std::snprintf(buf, sizeof buf, " direct err %.1e; images per block x threads:", direct_err);
          sweep = buf + sweep;
        }
        if (pass == 0 && gpu::row_conv_fits(gpu::RowPass::Forward, x, w, y, L.p)) {
          rows = graph_us([&] { gpu::row_conv_forward(x, w, b, L.p, y, s); });
          err = relative_error(y, y_ref);
        }
        if (pass == 1 && gpu::row_conv_fits(gpu::RowPass::BackwardInput, dx, w, dy, L.p)) {
          rows = graph_us([&] { gpu::row_conv_backward_input(dy, w, L.p, dx, s); });
          err = relative_error(dx, dx_ref);
        }
        if (pass == 2 && gpu::row_conv_fits(gpu::RowPass::BackwardWeight, x, dw, dy, L.p)) {
          rows = graph_us([&] { gpu::row_conv_backward_weight(x, dy, L.p, dw, db, s); });
          err = std::max(relative_error(dw, dw_ref), relative_error(db, db_ref));
        }
        char e[32] = "-";
        if (err >= 0) std::snprintf(e, sizeof e, "%.1e", err);
        std::printf("%-24s %-6s %10s %10s %10s %10s %10s\n", L.name, pname, cell(cudnn[0]).c_str(),
                    cell(cudnn[1]).c_str(), cell(direct).c_str(), cell(rows).c_str(), e);
        if (!sweep.empty()) std::printf("   %s\n", sweep.c_str());
      }
    }
    std::printf("(us per call inside a replayed graph of %d calls; median of %d replays; batch %lld)\n",
                kCallsPerGraph, runs, static_cast<long long>(batch));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 1;
  }
  return 0;
}
