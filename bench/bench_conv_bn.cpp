// Convolution and batch norm, fused by cuDNN or run apart: which of cuDNN's fused graphs have an
// engine for ResNet-18's layers on this GPU, what each costs, and what it would save
// (docs/09-performance.md, "Convolution and batch norm, fused: measured first").
//
// For each convolution of ResNet-18 (the 28x28 variant, batch 256) that a batch norm follows,
// in bfloat16 and channels-last, on one GPU, median of --runs runs timed with CUDA events:
//   conv         tandem's convolution forward (cuDNN, the plan tandem uses; no bias: the batch
//                norm cancels it)
//   bn+relu      tandem's batch norm + ReLU forward, training mode (statistics, then apply)
//   apply        the apply pass alone (tandem's batch norm + ReLU in eval mode)
//   conv+stats   one cuDNN graph: the convolution, and the per-channel sum and sum of squares
//                of its output (genstats) in the same kernel
//   conv+reduce  the same as the convolution and two reductions in its epilogue (sum of y, sum of
//                y * y): cuDNN's generic fusion, where genstats has no engine
//   sbr+conv+st  one graph: relu(x * scale + bias) of the input (the previous batch norm's
//                apply, per channel), the convolution, the statistics
//   wgrad        tandem's weight gradient of the convolution
//   sbr+wgrad    one graph: the weight gradient with the input's relu(x * scale + bias) recomputed
// "-" where cuDNN has no engine for the graph; beside each fused time its largest difference
// from the unfused result, relative to the largest value of that result.
//
//   bench_conv_bn [--batch N] [--runs R]
//
// Exit 2 on bad arguments, 1 on a failure (a CUDA or cuDNN error, no GPU).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench_args.h"
#include "bench_cuda.h"
#include "core/allocator.h"
#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/tensor.h"
#include "kernels/cuda/cudnn_graph.h"
#include "kernels/cuda/handles.h"
#include "kernels/ops.h"

using namespace tandem;
using namespace tandem::gpu;
namespace k = tandem::kernels;

namespace {

constexpr const char* kProgram = "bench_conv_bn";
[[noreturn]] void usage(const std::string& why) {
  bench::usage(kProgram, why);
}
long number(const std::string& flag, const char* value) {
  return bench::positive(kProgram, flag, value);
}

const Device kGpu = Device::cuda(0);
int runs = 30;

// The median time of one run of f, in microseconds, on the current stream (after 3 untimed runs).
double median_us(const std::function<void()>& f) {
  cudaStream_t s = current_cuda_stream(kGpu);
  for (int i = 0; i < 3; ++i) f();
  return bench::median_us(s, runs, f);
}

using bench::relative_error;

// Unique ids of the tensors of the fused graphs; virtual ones from 100.
enum : int64_t { kX = 1, kW, kY, kSum, kSqSum, kScale, kBias, kDy, kDw, kV1 = 100, kV2, kV3 };

// A [1, C, 1, 1] float32 per-channel tensor of a graph.
BackendDesc channel_tensor(int64_t uid, int64_t c) {
  return graph_tensor(uid, CUDNN_DATA_FLOAT, {1, c, 1, 1}, {c, 1, c, c}, 16);
}

// Up to 8 plans for ops, cuDNN's heuristics' order; none when cuDNN refuses the graph or has
// no engine for it. What cuDNN throws while the operations are put together also means "no
// engine": it is printed.
// The descriptors of one graph, alive until its plans are made (a deque: what it holds stays put).
using Keep = std::deque<BackendDesc>;
const BackendDesc& keep_(Keep& keep, BackendDesc d) {
  keep.push_back(std::move(d));
  return keep.back();
}
// make() returns the operations and leaves the tensors and descriptors they name in `keep`.
using MakeOps = std::function<std::vector<BackendDesc>(Keep& keep)>;
std::vector<GraphPlan> plans_for(const char* what, const MakeOps& make) {
  try {
    Keep keep;
    std::vector<BackendDesc> ops = make(keep);
    std::vector<const BackendDesc*> raw;
    for (const auto& op : ops) raw.push_back(&op);
    return graph_plans(cudnn_handle(kGpu), raw, size_t{1} << 30, 8);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", what, e.what());
    return {};
  }
}

// One fused graph measured: how many engines cuDNN offered, the fastest of them (as tandem's
// benchmark mode picks a convolution's engine) with its workspace and median time, and its
// largest difference from the unfused result.
struct Fused {
  const char* name;
  size_t engines = 0;
  std::optional<GraphPlan> plan;
  DataPtr ws;
  std::optional<double> us;
  double err = -1;
};
using RunPlan = std::function<void(const GraphPlan&, void*)>;

// Times each plan with run(); then, for the fastest, prepare(), one run and err = check().
Fused measure(const char* name, std::vector<GraphPlan> plans, const RunPlan& run,
              const std::function<void()>& prepare, const std::function<double()>& check) {
  Fused f{name, plans.size(), std::nullopt, DataPtr(), std::nullopt, -1};
  for (auto& plan : plans) {
    DataPtr mem = allocate(kGpu, plan.workspace);
    const double us = median_us([&] { run(plan, mem.get()); });
    if (!f.us || us < *f.us) {
      f.us = us;
      f.plan = std::move(plan);
      f.ws = std::move(mem);
    }
  }
  if (f.plan) {
    prepare();
    run(*f.plan, f.ws.get());
    f.err = check();
  }
  return f;
}

// relu(x * scale + bias) of a graph's input x (uid kX, shape xs), per channel, into a virtual
// tensor of type vdt: the three pointwise operations are appended to ops; returns the output.
const BackendDesc& scale_bias_relu(Keep& keep, std::vector<BackendDesc>& ops, const Shape& xs,
                                   cudnnDataType_t vdt) {
  const auto cl = MemoryFormat::ChannelsLast;
  const BackendDesc& v1 = keep_(keep, graph_tensor(kV1, CUDNN_DATA_FLOAT, xs, cl, 16, true));
  const BackendDesc& v2 = keep_(keep, graph_tensor(kV2, CUDNN_DATA_FLOAT, xs, cl, 16, true));
  const BackendDesc& v3 = keep_(keep, graph_tensor(kV3, vdt, xs, cl, 16, true));
  ops.push_back(pointwise_op(CUDNN_POINTWISE_MUL,
                             keep_(keep, graph_tensor(kX, CUDNN_DATA_BFLOAT16, xs, cl, 16)),
                             &keep_(keep, channel_tensor(kScale, xs[1])), v1));
  ops.push_back(
      pointwise_op(CUDNN_POINTWISE_ADD, v1, &keep_(keep, channel_tensor(kBias, xs[1])), v2));
  ops.push_back(pointwise_op(CUDNN_POINTWISE_RELU_FWD, v2, nullptr, v3));
  return v3;
}

// The plans of the graph make(vdt) makes, with the prologue's output in float32, else (when
// cuDNN has no engine for that) in bfloat16.
std::vector<GraphPlan> plans_either(const char* what,
                                    const std::function<MakeOps(cudnnDataType_t)>& make) {
  auto plans = plans_for(what, make(CUDNN_DATA_FLOAT));
  if (plans.empty()) plans = plans_for(what, make(CUDNN_DATA_BFLOAT16));
  return plans;
}

struct Layer {
  int64_t c, k, hw, stride,
      count;  // in and out channels, input size, stride, how many in ResNet-18
};

std::string cell(const std::optional<double>& us, double err = -1) {
  char buf[64];
  if (!us) return "-";
  if (err < 0)
    std::snprintf(buf, sizeof buf, "%.1f", *us);
  else
    std::snprintf(buf, sizeof buf, "%.1f (%.0e)", *us, err);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(a + " needs a value");
    const char* v = argv[++i];
    if (a == "--batch")
      batch = number(a, v);
    else if (a == "--runs")
      runs = int(number(a, v));
    else
      usage("unknown argument " + a);
  }
  try {
    TANDEM_CHECK(cuda_device_count() > 0, Device, "bench_conv_bn needs a GPU");
    DeviceGuard guard(kGpu);
    const std::vector<Layer> layers{{64, 64, 28, 1, 4},   {64, 128, 28, 2, 1}, {128, 128, 14, 1, 3},
                                    {128, 256, 14, 2, 1}, {256, 256, 7, 1, 3}, {256, 512, 7, 2, 1},
                                    {512, 512, 4, 1, 3}};
    std::printf(
        "cuDNN %zu. ResNet-18's convolutions with a batch norm after them, batch %lld, bfloat16, "
        "channels-last; median us of %d runs (relative difference from the unfused result)\n",
        cudnnGetVersion(), static_cast<long long>(batch), runs);
    std::printf("%-22s %6s %8s %8s %6s %16s %16s %16s %8s %16s\n", "layer (C->K @HW /s)", "count",
                "conv", "bn+relu", "apply", "conv+stats", "conv+reduce", "sbr+conv+st", "wgrad",
                "sbr+wgrad");
    const auto cl = MemoryFormat::ChannelsLast;
    for (const Layer& L : layers) {
      const Conv2dParams p{L.stride, L.stride, 1, 1};
      const int64_t out = (L.hw + 2 - 3) / L.stride + 1;
      const Shape xs{batch, L.c, L.hw, L.hw}, ws{L.k, L.c, 3, 3}, ys{batch, L.k, out, out};
      Tensor x = randn(xs, kFloat32, kGpu).to(kBFloat16).contiguous(cl);
      Tensor w = restrided(
          k::scalar(ScalarOp::Mul, randn(ws, kFloat32, kGpu), 1.0 / std::sqrt(9.0 * double(L.c)))
              .to(kBFloat16),
          cl);
      Tensor scale_c = uniform({L.c}, 0.5, 1.5, kFloat32, kGpu),
             bias_c = uniform({L.c}, -0.5, 0.5, kFloat32, kGpu);
      Tensor gamma = ones({L.k}, kFloat32, kGpu), beta = zeros({L.k}, kFloat32, kGpu);
      Tensor rm = zeros({L.k}, kFloat32, kGpu), rv = ones({L.k}, kFloat32, kGpu);

      // Unfused, as tandem runs it today.
      Tensor y = k::conv2d(x, w, Tensor(), p);
      const double t_conv = median_us([&] { k::conv2d(x, w, Tensor(), p); });
      const double t_bn =
          median_us([&] { k::batch_norm_train(y, gamma, beta, rm, rv, 0.1, 1e-5, true); });
      const double t_apply =
          median_us([&] { k::batch_norm_eval(y, gamma, beta, rm, rv, 1e-5, true); });
      Tensor dy = randn(ys, kFloat32, kGpu).to(kBFloat16).contiguous(cl);
      const double t_wgrad = median_us([&] { k::conv2d_backward_weight(x, dy, p, ws, false); });
      // The references: the statistics of y in float32, and the relu(x * scale + bias) input.
      const Tensor y32 = y.to(kFloat32);
      const Tensor ref_sum = k::sum(y32, {0, 2, 3}),
                   ref_sqsum = k::sum(k::binary(BinaryOp::Mul, y32, y32), {0, 2, 3});
      const Tensor z =
          k::unary(UnaryOp::Relu,
                   k::binary(BinaryOp::Add,
                             k::binary(BinaryOp::Mul, x.to(kFloat32), scale_c.view({1, L.c, 1, 1})),
                             bias_c.view({1, L.c, 1, 1})))
              .to(kBFloat16)
              .contiguous(cl);
      const Tensor ref_z_y = k::conv2d(z, w, Tensor(), p);
      const Tensor ref_z_dw = k::conv2d_backward_weight(z, dy, p, ws, false).first;

      cudnnHandle_t h = cudnn_handle(kGpu);
      const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
      Tensor sum = zeros({L.k}, kFloat32, kGpu), sqsum = zeros({L.k}, kFloat32, kGpu);
      Tensor y_fused = empty(ys, kBFloat16, kGpu, cl);

      // conv + genstats
      auto cg_plans = plans_for("conv+stats", [&](Keep& keep) {
        const BackendDesc& ty = keep_(keep, graph_tensor(kY, bf, ys, cl, 16));
        const BackendDesc& conv = keep_(keep, convolution_desc(p, f32));
        std::vector<BackendDesc> ops;
        ops.push_back(convolution_op(ConvPass::Forward, conv, f32,
                                     keep_(keep, graph_tensor(kX, bf, xs, cl, 16)),
                                     keep_(keep, graph_tensor(kW, bf, ws, cl, 16)), ty));
        ops.push_back(genstats_op(ty, keep_(keep, channel_tensor(kSum, L.k)),
                                  keep_(keep, channel_tensor(kSqSum, L.k))));
        return ops;
      });
      auto run_cg = [&](const GraphPlan& g, void* mem) {
        execute_plan(h, *g.plan, std::array<int64_t, 5>{kX, kW, kY, kSum, kSqSum},
                     std::array<void*, 5>{x.raw_data(), w.raw_data(), y_fused.raw_data(),
                                          sum.raw_data(), sqsum.raw_data()},
                     mem);
      };
      const auto zero_sums = [&] {  // genstats may accumulate: the run compared starts from zero
        sum.zero_();
        sqsum.zero_();
      };
      const auto stats_error = [&] {
        return std::max({relative_error(y_fused, y), relative_error(sum, ref_sum),
                         relative_error(sqsum, ref_sqsum)});
      };
      Fused cg = measure("conv+stats", std::move(cg_plans), run_cg, zero_sums, stats_error);

      // conv, then the two sums as reductions of its output (cuDNN's generic epilogue)
      auto cr_plans = plans_for("conv+reductions", [&](Keep& keep) {
        const BackendDesc& ty = keep_(keep, graph_tensor(kY, bf, ys, cl, 16));
        const BackendDesc& sq = keep_(keep, graph_tensor(kV1, f32, ys, cl, 16, true));
        std::vector<BackendDesc> ops;
        ops.push_back(convolution_op(ConvPass::Forward, keep_(keep, convolution_desc(p, f32)), f32,
                                     keep_(keep, graph_tensor(kX, bf, xs, cl, 16)),
                                     keep_(keep, graph_tensor(kW, bf, ws, cl, 16)), ty));
        ops.push_back(reduction_sum_op(ty, keep_(keep, channel_tensor(kSum, L.k))));
        ops.push_back(pointwise_op(CUDNN_POINTWISE_MUL, ty, &ty, sq));
        ops.push_back(reduction_sum_op(sq, keep_(keep, channel_tensor(kSqSum, L.k))));
        return ops;
      });
      Fused cr = measure("conv+reduce", std::move(cr_plans), run_cg, zero_sums, stats_error);

      // relu(x * scale + bias) -> conv -> genstats
      auto scg_plans = plans_either("sbr+conv+stats", [&](cudnnDataType_t vdt) -> MakeOps {
        return [&, vdt](Keep& keep) {
          std::vector<BackendDesc> ops;
          const BackendDesc& z = scale_bias_relu(keep, ops, xs, vdt);
          const BackendDesc& ty = keep_(keep, graph_tensor(kY, bf, ys, cl, 16));
          ops.push_back(convolution_op(ConvPass::Forward, keep_(keep, convolution_desc(p, f32)),
                                       f32, z, keep_(keep, graph_tensor(kW, bf, ws, cl, 16)), ty));
          ops.push_back(genstats_op(ty, keep_(keep, channel_tensor(kSum, L.k)),
                                    keep_(keep, channel_tensor(kSqSum, L.k))));
          return ops;
        };
      });
      auto run_scg = [&](const GraphPlan& g, void* mem) {
        execute_plan(
            h, *g.plan, std::array<int64_t, 7>{kX, kW, kY, kScale, kBias, kSum, kSqSum},
            std::array<void*, 7>{x.raw_data(), w.raw_data(), y_fused.raw_data(), scale_c.raw_data(),
                                 bias_c.raw_data(), sum.raw_data(), sqsum.raw_data()},
            mem);
      };
      Fused scg = measure(
          "sbr+conv+st", std::move(scg_plans), run_scg, [] {},
          [&] { return relative_error(y_fused, ref_z_y); });

      // relu(x * scale + bias) -> wgrad
      Tensor dw = empty(ws, kBFloat16, kGpu, cl);
      auto swg_plans = plans_either("sbr+wgrad", [&](cudnnDataType_t vdt) -> MakeOps {
        return [&, vdt](Keep& keep) {
          std::vector<BackendDesc> ops;
          const BackendDesc& z = scale_bias_relu(keep, ops, xs, vdt);
          ops.push_back(convolution_op(ConvPass::BackwardFilter,
                                       keep_(keep, convolution_desc(p, f32)), f32, z,
                                       keep_(keep, graph_tensor(kDw, bf, ws, cl, 16)),
                                       keep_(keep, graph_tensor(kDy, bf, ys, cl, 16))));
          return ops;
        };
      });
      auto run_swg = [&](const GraphPlan& g, void* mem) {
        execute_plan(h, *g.plan, std::array<int64_t, 5>{kX, kDw, kDy, kScale, kBias},
                     std::array<void*, 5>{x.raw_data(), dw.raw_data(), dy.raw_data(),
                                          scale_c.raw_data(), bias_c.raw_data()},
                     mem);
      };
      Fused swg = measure(
          "sbr+wgrad", std::move(swg_plans), run_swg, [] {},
          [&] { return relative_error(dw, ref_z_dw); });

      char name[64];
      std::snprintf(name, sizeof name, "%lld->%lld @%lld /%lld", static_cast<long long>(L.c),
                    static_cast<long long>(L.k), static_cast<long long>(L.hw),
                    static_cast<long long>(L.stride));
      std::printf("%-22s %6lld %8.1f %8.1f %6.1f %16s %16s %16s %8.1f %16s\n", name,
                  static_cast<long long>(L.count), t_conv, t_bn, t_apply,
                  cell(cg.us, cg.err).c_str(), cell(cr.us, cr.err).c_str(),
                  cell(scg.us, scg.err).c_str(), t_wgrad, cell(swg.us, swg.err).c_str());
      for (const Fused* f : {&cg, &cr, &scg, &swg}) {
        std::printf("    %s: %zu engines", f->name, f->engines);
        if (f->plan) {
          std::printf(
              ", the fastest %lld%s, workspace %zu bytes", static_cast<long long>(f->plan->engine),
              f->plan->runtime_compiled ? " (compiled at run time)" : "", f->plan->workspace);
        }
        std::printf("\n");
      }
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_conv_bn: %s\n", e.what());
    return 1;
  }
}
