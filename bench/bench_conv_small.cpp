// LeNet's two convolutions, pass by pass, through every kernel tandem has for them: cuDNN with
// its heuristics' engine and with timed engines, the per-tap direct kernels (Note [direct
// convolution] in kernels/cuda/conv_direct.cu) and the row-window kernels (Note [row
// convolution] in kernels/cuda/conv_rows.cu); float32, NCHW, batch 256, on one GPU. Then
// ResNet-18's stem on Fashion-MNIST as a step under autocast runs it (Conv2d(1, 64, 3, padding
// 1), bfloat16, channels-last): its forward and weight gradient through cuDNN and through the
// one-input-channel kernels (Note [one-input-channel convolution] in
// kernels/cuda/conv_one_channel.cuh).
//
// Each figure is the median over --runs replays of a CUDA graph of 20 calls, divided by 20: the
// time a call takes inside a replayed training step, launch gaps included. Beside the row
// kernels' time, their largest difference from cuDNN's result relative to its largest value
// (the stem: the one-channel kernels'). "-" where a kernel does not take the pass.
//
//   bench_conv_small [--batch N] [--runs R] [--layer conv1|conv2|stem] [--pass fwd|dgrad|wgrad]
//
// --layer and --pass keep one layer or pass (to profile one kernel; the stem has no dgrad: its
// input is the data).
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
#include "kernels/cuda/conv_one_channel.h"
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
double graph_us(const std::function<void()>& f) { return bench::replayed_call_us(kGpu, runs, f, kCallsPerGraph); }

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

// ResNet-18's stem as a replayed autocast step runs it: x [N, 1, 28, 28] and w [64, 1, 3, 3] in
// bfloat16, channels-last, padding 1; the bias added by the batch norm after it (Note [conv bias
// in batch norm]) so the forward runs without one, and the weight gradient ending in the
// weight's float32 .grad -- today a bfloat16 dw and a cast into it, or, where the caller passes
// the float32 .grad as dw_into, written there by the one-channel kernel.
void run_stem(int64_t batch, const std::string& only_pass) {
  const MemoryFormat cl = MemoryFormat::ChannelsLast;
  const Shape xs{batch, 1, 28, 28}, ws{64, 1, 3, 3};
  const Conv2dParams p{1, 1, 1, 1};
  const auto bf16_gpu = [&](const Shape& shape) {
    return restrided(uniform(shape, -1.0, 1.0, kFloat32).to(kGpu, kBFloat16), cl);
  };
  const Tensor x = bf16_gpu(xs), w = bf16_gpu(ws), b = uniform({64}, -1.0, 1.0, kFloat32).to(kGpu, kBFloat16);
  const bool prev = one_channel_conv();
  set_one_channel_conv(false);
  const Tensor y_ref = k::conv2d(x, w, Tensor(), p), yb_ref = k::conv2d(x, w, b, p);
  const Tensor dy = bf16_gpu(y_ref.shape());
  auto [dw_ref, db_ref] = k::conv2d_backward_weight(x, dy, p, ws, true);
  const Tensor dw32 = zeros(ws, kFloat32, kGpu), db32 = zeros({64}, kFloat32, kGpu);
  std::printf("\nResNet-18 stem 1->64 28x28 pad 1, bfloat16 channels-last, batch %lld\n",
              static_cast<long long>(batch));
  std::printf("%-36s %10s %10s %12s %10s\n", "pass", "cudnn heur", "cudnn timed", "one-channel", "err");
  struct Row {
    const char* name;
    const char* pass;
    bool cudnn;  // cuDNN takes this form (a float32 dw given: no)
    std::function<void()> f;
    std::function<double()> err;
  };
  const Row rows[] = {
      {"fwd (no bias: the batch norm's)", "fwd", true, [&] { (void)k::conv2d(x, w, Tensor(), p); },
       [&] { return relative_error(k::conv2d(x, w, Tensor(), p), y_ref); }},
      {"fwd + bias", "fwd", true, [&] { (void)k::conv2d(x, w, b, p); },
       [&] { return relative_error(k::conv2d(x, w, b, p), yb_ref); }},
      {"wgrad: bf16 dw, cast into f32 .grad", "wgrad", true,
       [&] { dw32.copy_(k::conv2d_backward_weight(x, dy, p, ws, false).first); },
       [&] { return relative_error(k::conv2d_backward_weight(x, dy, p, ws, false).first, dw_ref); }},
      {"wgrad: f32 dw written directly", "wgrad", false,
       [&] { (void)k::conv2d_backward_weight(x, dy, p, ws, false, dw32); },
       [&] { return relative_error(k::conv2d_backward_weight(x, dy, p, ws, false, dw32).first, dw_ref); }},
      {"wgrad + bias: f32 dw, db directly", "wgrad", false,
       [&] { (void)k::conv2d_backward_weight(x, dy, p, ws, true, dw32, db32); },
       [&] {
         auto [dw, db] = k::conv2d_backward_weight(x, dy, p, ws, true, dw32, db32);
         return std::max(relative_error(dw, dw_ref), relative_error(db, db_ref));
       }},
  };
  for (const Row& r : rows) {
    if (!only_pass.empty() && only_pass != r.pass) continue;
    double cudnn[2] = {-1, -1};
    for (int timed = 0; timed < 2 && r.cudnn; ++timed) {
      set_one_channel_conv(false);
      set_cudnn_benchmark(timed == 1);
      cudnn[timed] = graph_us(r.f);
    }
    set_cudnn_benchmark(false);
    set_one_channel_conv(true);
    const Tensor like_y = empty(y_ref.shape(), kBFloat16, kGpu, cl);
    const bool takes = std::string(r.pass) == "fwd"
                           ? gpu::one_channel_conv_applies(gpu::OneChannelPass::Forward, x, w, like_y, p)
                           : gpu::one_channel_conv_applies(gpu::OneChannelPass::BackwardWeight, x, dw32, dy, p);
    double own = -1, err = -1;
    if (takes) {
      own = graph_us(r.f);
      err = r.err();
    }
    char e[32] = "-";
    if (err >= 0) std::snprintf(e, sizeof e, "%.1e", err);
    std::printf("%-36s %10s %10s %12s %10s\n", r.name, cell(cudnn[0]).c_str(), cell(cudnn[1]).c_str(),
                cell(own).c_str(), e);
  }
  set_one_channel_conv(prev);
}

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
      if (only_layer != "conv1" && only_layer != "conv2" && only_layer != "stem")
        bench::usage(kProgram, "--layer " + only_layer + " is not conv1, conv2 or stem");
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
    if (only_layer != "stem") {
      std::printf("%-24s %-6s %10s %10s %10s %10s %10s\n", "layer", "pass", "cudnn heur", "cudnn timed",
                  "direct", "rows", "rows err");
    }
    cudaStream_t s = current_cuda_stream(kGpu);
    const bool prev_one = one_channel_conv();
    set_one_channel_conv(false);  // the cuDNN columns are cuDNN's; the one-channel kernels are called below
    for (const Layer& L : layers) {
      if (only_layer == "stem") break;
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
        // A first layer's passes through the one-input-channel kernels (Note [one-input-channel
        // convolution]), which take it when the direct kernels are off.
        set_one_channel_conv(true);
        if (pass == 0 && gpu::one_channel_conv_applies(gpu::OneChannelPass::Forward, x, w, y, L.p)) {
          const double us = graph_us([&] { gpu::one_channel_conv_forward(x, w, b, L.p, y, s); });
          char buf[96];
          std::snprintf(buf, sizeof buf, " one-channel: %.2f (err %.1e)", us, relative_error(y, y_ref));
          sweep += buf;
        }
        if (pass == 2 && gpu::one_channel_conv_applies(gpu::OneChannelPass::BackwardWeight, x, dw, dy, L.p)) {
          const double us = graph_us([&] { gpu::one_channel_conv_backward_weight(x, dy, L.p, dw, db, s); });
          char buf[96];
          std::snprintf(buf, sizeof buf, " one-channel: %.2f (err %.1e);",
                        us, std::max(relative_error(dw, dw_ref), relative_error(db, db_ref)));
          sweep = buf + sweep;
        }
        set_one_channel_conv(false);
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
    set_one_channel_conv(prev_one);
    if ((only_layer.empty() || only_layer == "stem") && only_pass != "dgrad") run_stem(batch, only_pass);
    std::printf("(us per call inside a replayed graph of %d calls; median of %d replays; batch %lld)\n",
                kCallsPerGraph, runs, static_cast<long long>(batch));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 1;
  }
  return 0;
}
