// ResNet-18's batch-norm passes as its training step runs them (batch 256, bfloat16,
// channels-last, the conv bias fused in: Note [conv bias in batch norm] in
// kernels/cuda/batchnorm.cuh), one layer shape at a time, against a copy of the same activation:
// how close each pass comes to the memory bandwidth the GPU gives a plain copy.
//
// Per shape (the stem and stage 1: 64 channels at 28x28; then 128 at 14x14, 256 at 7x7, 512 at
// 4x4) the forward of a block's first batch norm (statistics, then the apply with the ReLU), of
// its second (the apply joins the shortcut before the ReLU), and their backwards (the gradient
// sums, then the dx pass that also sums the conv bias's gradient; the second with the shortcut's
// gradient part read and the masked gradient written, Note [batch norm + residual join]). The
// bytes are those the passes move as implemented, in units of the activation A: forward 3A
// (first) and 4A (second, the shortcut read), backward 7A (dy, x and the ReLU's output read
// twice, dx written) and 8A (dy, the part, the output and x read, the masked gradient written;
// then it and x read, dx written). Each time is the median over --runs replays of a CUDA graph
// of 20 calls, divided by 20, as in a replayed step (launch gaps included). "copy" is
// Tensor::copy_ of one activation into another (2A).
//
//   bench_bn [--batch N] [--runs R] [--profile]
//
// --profile runs each pass once more, eagerly, between cudaProfilerStart and cudaProfilerStop,
// for `ncu --profile-from-start off` (bench/bn_gpu.sh --ncu).
//
// Exit 2 on bad arguments, 1 on a failure (a CUDA error, no GPU).
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "bench_args.h"
#include "bench_cuda.h"
#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/tensor.h"
#include "kernels/ops.h"

using namespace tandem;
namespace k = tandem::kernels;

namespace {

constexpr const char* kProgram = "bench_bn";
constexpr int kCallsPerGraph = 20;
const Device kGpu = Device::cuda(0);
int runs = 50;

// The median time of one call of f inside a replayed graph, in microseconds.
double graph_us(const std::function<void()>& f) { return bench::replayed_call_us(kGpu, runs, f, kCallsPerGraph); }

struct Pass {
  const char* name;
  int activations;  // bytes moved, in activations
  std::function<void()> f;
};

void run_shape(int64_t batch, int64_t c, int64_t hw, bool profile) {
  const MemoryFormat cl = MemoryFormat::ChannelsLast;
  const Shape s{batch, c, hw, hw};
  const auto act = [&] { return restrided(uniform(s, -1.0, 1.0, kFloat32).to(kGpu, kBFloat16), cl); };
  const Tensor z = act(), shortcut = act(), dy = act(), part = act(), dst = empty(s, kBFloat16, kGpu, cl);
  const Tensor gamma = uniform({c}, 0.5, 1.5, kFloat32).to(kGpu), beta = uniform({c}, -0.5, 0.5, kFloat32).to(kGpu);
  const Tensor bias = uniform({c}, -0.1, 0.1, kFloat32).to(kGpu, kBFloat16);
  const Tensor rm = zeros({c}, kFloat32, kGpu), rv = ones({c}, kFloat32, kGpu);
  const Tensor dgamma = zeros({c}, kFloat32, kGpu), dbeta = zeros({c}, kFloat32, kGpu);
  const auto first = k::batch_norm_train(z, gamma, beta, rm, rv, 0.1, 1e-5, true, bias);
  const auto second = k::batch_norm_train(z, gamma, beta, rm, rv, 0.1, 1e-5, true, bias, shortcut);
  const double a_mb = static_cast<double>(z.numel() * 2) / 1e6;
  const std::vector<Pass> passes = {
      {"copy", 2, [&] { dst.copy_(z); }},
      {"forward, bn + relu", 3, [&] { (void)k::batch_norm_train(z, gamma, beta, rm, rv, 0.1, 1e-5, true, bias); }},
      {"forward, bn + add + relu", 4,
       [&] { (void)k::batch_norm_train(z, gamma, beta, rm, rv, 0.1, 1e-5, true, bias, shortcut); }},
      {"backward, bn + relu", 7,
       [&] {
         (void)k::batch_norm_backward(dy, z, gamma, first.save_mean, first.save_invstd, first.y, bias, true, dgamma,
                                      dbeta);
       }},
      {"backward, bn + add + relu, part", 8,
       [&] {
         (void)k::batch_norm_backward(dy, z, gamma, second.save_mean, second.save_invstd, second.y, bias, true,
                                      dgamma, dbeta, true, part);
       }},
  };
  std::printf("\n%lld x %lld x %lldx%lld, bfloat16 channels-last: an activation is %.1f MB\n",
              static_cast<long long>(batch), static_cast<long long>(c), static_cast<long long>(hw),
              static_cast<long long>(hw), a_mb);
  std::printf("%-34s %9s %9s %9s %9s\n", "pass", "us", "MB", "GB/s", "of copy");
  double copy_gbs = 0;
  for (const Pass& p : passes) {
    const double us = graph_us(p.f);
    const double mb = a_mb * p.activations, gbs = mb / us * 1e3;  // MB per us is TB/s
    if (copy_gbs == 0) copy_gbs = gbs;
    std::printf("%-34s %9.2f %9.1f %9.0f %8.0f%%\n", p.name, us, mb, gbs, 100 * gbs / copy_gbs);
  }
  if (profile) {
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream(kGpu)));
    TANDEM_CUDA_CHECK(cudaProfilerStart());
    for (const Pass& p : passes) p.f();
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream(kGpu)));
    TANDEM_CUDA_CHECK(cudaProfilerStop());
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 256;
  bool profile = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--batch" && i + 1 < argc) {
      batch = bench::positive(kProgram, a, argv[++i]);
    } else if (a == "--runs" && i + 1 < argc) {
      runs = static_cast<int>(bench::positive(kProgram, a, argv[++i]));
    } else if (a == "--profile") {
      profile = true;
    } else {
      bench::usage(kProgram, "unknown argument " + a);
    }
  }
  try {
    if (cuda_device_count() < 1) {
      std::fprintf(stderr, "%s: no CUDA device\n", kProgram);
      return 1;
    }
    for (const auto& [c, hw] : std::vector<std::pair<int64_t, int64_t>>{{64, 28}, {128, 14}, {256, 7}, {512, 4}}) {
      run_shape(batch, c, hw, profile);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 1;
  }
  return 0;
}
