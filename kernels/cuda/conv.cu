// 2-D convolution through cuDNN (forward, backward data, backward filter); the bias add and
// the bias gradient are own kernels.
//
// Note [conv plans]: choosing a cuDNN algorithm costs far more than running a small
// convolution, so it happens once per configuration: the descriptors, the chosen algorithm
// and its workspace size are kept in a plan, in a thread_local map keyed by (pass, dtype,
// device, shapes, stride, padding). Each host thread drives its own device in parallel code,
// so plans are never shared between threads and need no lock. The algorithm comes from
// cuDNN's heuristics (cudnnGet*_v7: no GPU work, no host sync); with cudnn_benchmark() on
// (kernels/backend.h) it is instead measured once with cudnnFind*Ex, which does
// synchronize, so warm up before capturing a CUDA graph. Among the candidates, in cuDNN's
// order of preference, the first deterministic one that is supported and whose workspace fits
// wins; a nondeterministic one only when none is (Note [deterministic reductions]).
// Workspaces come from allocate() on the current stream for each call. Unless benchmark mode is
// on, a plan first tries cuDNN's graph API (cudnn_graph.h), whose cached execution plans cost
// far less host time per call than the legacy entry points; the legacy algorithm choice above
// is the fallback when no graph engine takes the configuration.
//
// Note [TF32]: on Ampere and newer GPUs cuDNN's CUDNN_DEFAULT_MATH *permits* TF32 tensor
// cores for float32 convolutions (10-bit mantissa inputs), which puts the results about
// 1e-3 away from the CPU's and runs several times faster. tandem follows PyTorch: allowed by
// default (allow_tf32() in kernels/backend.h). With it off, float32 convolutions run with
// CUDNN_FMA_MATH (float32 FMA kernels only) and candidates reporting a tensor-op math type
// are skipped, so results stay within ~1e-5 of the CPU. float64 keeps CUDNN_DEFAULT_MATH: its
// tensor cores compute in full float64. The setting is part of the plan key.
#include <climits>
#include <cstdlib>
#include <map>
#include <memory>

#include "core/allocator.h"
#include "core/cuda_graph.h"
#include "core/device.h"
#include "kernels/cuda/channel_any.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cudnn_graph.h"
#include "kernels/cuda/conv_direct.h"
#include "kernels/cuda/conv_one_channel.h"
#include "kernels/cuda/conv_rows.h"
#include "kernels/cuda/cudnn_util.h"
#include "kernels/cuda/handles.h"

namespace tandem {

namespace gpu {
namespace {

constexpr size_t kMaxWorkspace = size_t{1} << 30;   // largest workspace a plan may use
constexpr size_t kFindWorkspace = size_t{256} << 20;  // offered to cudnnFind*Ex

struct ConvPlan {
  TensorDesc x, y;  // x [N, C, H, W], y [N, K, P, Q]
  FilterDesc w;     // [K, C, R, S]
  ConvDesc conv;
  int algo = 0;
  size_t workspace = 0;
  std::unique_ptr<ConvGraph> graph;  // when set, run through it (Note [cuDNN graph vs legacy calls])
  bool contiguous_only = false;      // channels-last has no engine here: run on contiguous copies
};

// Pointers for cudnnFind*Ex: it runs the candidates on the real buffers.
struct ConvBuffers {
  const void* x;
  const void* w;
  const void* y;
  void* out;  // y, dx or dw, depending on the pass
};

// One pass each: how cuDNN's legacy API chooses, sizes and runs it. Pointers x, w, y are in the
// roles of the forward convolution; the pass writes one of them (out()).
struct FwdPass {
  using Perf = cudnnConvolutionFwdAlgoPerf_t;
  static constexpr ConvPass kPass = ConvPass::Forward;
  static constexpr int kCount = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  static void* out(void* x, void* w, void* y) { return y; }
  static cudnnStatus_t run(cudnnHandle_t h, const ConvPlan& p, const void* one, const void* zero, void* x,
                           void* w, void* y, void* ws) {
    return cudnnConvolutionForward(h, one, p.x.d, x, p.w.d, w, p.conv.d,
                                   static_cast<cudnnConvolutionFwdAlgo_t>(p.algo), ws, p.workspace, zero,
                                   p.y.d, y);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p, int* got, Perf* r) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h, p.x.d, p.w.d, p.conv.d, p.y.d, kCount, got, r);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, const ConvBuffers& b, int* got,
                            Perf* r, void* ws, size_t bytes) {
    return cudnnFindConvolutionForwardAlgorithmEx(h, p.x.d, b.x, p.w.d, b.w, p.conv.d, p.y.d,
                                                  b.out, kCount, got, r, ws, bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p, int algo, size_t* bytes) {
    return cudnnGetConvolutionForwardWorkspaceSize(h, p.x.d, p.w.d, p.conv.d, p.y.d,
                                                   static_cast<cudnnConvolutionFwdAlgo_t>(algo), bytes);
  }
};

struct BwdDataPass {
  using Perf = cudnnConvolutionBwdDataAlgoPerf_t;
  static constexpr ConvPass kPass = ConvPass::BackwardData;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  static void* out(void* x, void* w, void* y) { return x; }
  static cudnnStatus_t run(cudnnHandle_t h, const ConvPlan& p, const void* one, const void* zero, void* x,
                           void* w, void* y, void* ws) {
    return cudnnConvolutionBackwardData(h, one, p.w.d, w, p.y.d, y, p.conv.d,
                                        static_cast<cudnnConvolutionBwdDataAlgo_t>(p.algo), ws, p.workspace,
                                        zero, p.x.d, x);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p, int* got, Perf* r) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p.w.d, p.y.d, p.conv.d, p.x.d, kCount, got, r);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, const ConvBuffers& b, int* got,
                            Perf* r, void* ws, size_t bytes) {
    return cudnnFindConvolutionBackwardDataAlgorithmEx(h, p.w.d, b.w, p.y.d, b.y, p.conv.d, p.x.d,
                                                       b.out, kCount, got, r, ws, bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p, int algo, size_t* bytes) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(
        h, p.w.d, p.y.d, p.conv.d, p.x.d, static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), bytes);
  }
};

struct BwdFilterPass {
  using Perf = cudnnConvolutionBwdFilterAlgoPerf_t;
  static constexpr ConvPass kPass = ConvPass::BackwardFilter;
  static constexpr int kCount = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  static void* out(void* x, void* w, void* y) { return w; }
  static cudnnStatus_t run(cudnnHandle_t h, const ConvPlan& p, const void* one, const void* zero, void* x,
                           void* w, void* y, void* ws) {
    return cudnnConvolutionBackwardFilter(h, one, p.x.d, x, p.y.d, y, p.conv.d,
                                          static_cast<cudnnConvolutionBwdFilterAlgo_t>(p.algo), ws,
                                          p.workspace, zero, p.w.d, w);
  }
  static cudnnStatus_t heuristics(cudnnHandle_t h, const ConvPlan& p, int* got, Perf* r) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p.x.d, p.y.d, p.conv.d, p.w.d, kCount, got, r);
  }
  static cudnnStatus_t find(cudnnHandle_t h, const ConvPlan& p, const ConvBuffers& b, int* got,
                            Perf* r, void* ws, size_t bytes) {
    return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, p.x.d, b.x, p.y.d, b.y, p.conv.d,
                                                         p.w.d, b.out, kCount, got, r, ws, bytes);
  }
  static cudnnStatus_t workspace(cudnnHandle_t h, const ConvPlan& p, int algo, size_t* bytes) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(
        h, p.x.d, p.y.d, p.conv.d, p.w.d, static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), bytes);
  }
};

bool benchmark_mode() { return cudnn_benchmark(); }

// The dispatcher passes the three tensors of a pass all contiguous or all channels-last
// (kernels/backend.h); where they are both (C = 1, 1x1 pixels) the two addressings agree.
bool channels_last(const Tensor& x, const Tensor& w, const Tensor& y) {
  return !(x.is_contiguous() && w.is_contiguous() && y.is_contiguous());
}

// Whether a float32 plan may use TF32 tensor cores (Note [TF32]).
bool tf32_for(DType dtype) { return dtype == kFloat32 && allow_tf32(); }

// False when cuDNN offers no usable algorithm.
template <typename Pass>
bool choose_algorithm(cudnnHandle_t h, ConvPlan& plan, DType dtype, Device device,
                      const ConvBuffers& bufs) {
  typename Pass::Perf perf[Pass::kCount];
  int got = 0;
  if (benchmark_mode()) {
    DataPtr ws = allocate(device, kFindWorkspace);
    // Find*Ex blocks the host anyway; make sure the inputs and the workspace are ready first.
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream(device)));
    TANDEM_CUDNN_CHECK(Pass::find(h, plan, bufs, &got, perf, ws.get(), kFindWorkspace));
  } else {
    TANDEM_CUDNN_CHECK(Pass::heuristics(h, plan, &got, perf));
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < got; ++i) {
      const auto& r = perf[i];
      if (r.status != CUDNN_STATUS_SUCCESS) continue;
      if (pass == 0 && cudnn_deterministic() && r.determinism != CUDNN_DETERMINISTIC) continue;
      if (dtype == kFloat32 && !tf32_for(dtype) && (r.mathType == CUDNN_TENSOR_OP_MATH ||
                                r.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION)) {
        continue;  // Note [TF32]
      }
      size_t bytes = 0;
      if (Pass::workspace(h, plan, static_cast<int>(r.algo), &bytes) != CUDNN_STATUS_SUCCESS) continue;
      if (bytes > kMaxWorkspace) continue;
      plan.algo = static_cast<int>(r.algo);
      plan.workspace = bytes;
      return true;
    }
  }
  return false;
}

// The plan of a convolution with input x [N, C, H, W], weight w [K, C, R, S] and output
// y [N, K, P, Q] (see Note [conv plans]). The handle is already bound to the current stream.
template <typename Pass>
const ConvPlan& get_plan(cudnnHandle_t h, const Shape& xs, const Shape& ws,
                         const Shape& ys, const Conv2dParams& p, DType dtype, bool channels_last,
                         Device device, const ConvBuffers& bufs) {
  using Key = std::array<int64_t, 19>;
  thread_local std::map<Key, std::unique_ptr<ConvPlan>> plans;
  const int64_t alignment = common_alignment({bufs.x, bufs.w, bufs.y, bufs.out});
  const ConvPass pass = Pass::kPass;
  const Key key{static_cast<int64_t>(pass), static_cast<int64_t>(dtype), device.index, xs[0], xs[1],
                xs[2], xs[3], ws[0], ws[2], ws[3], p.stride_h, p.stride_w, p.pad_h, p.pad_w,
                tf32_for(dtype) ? 1 : 0, benchmark_mode() ? (cudnn_benchmark_in_graph() ? 2 : 1) : 0, alignment,
                (cudnn_graph_api() ? 1 : 0) + (cudnn_deterministic() ? 2 : 0), channels_last ? 1 : 0};
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;

  auto plan = std::make_unique<ConvPlan>();
  const cudnnDataType_t dt = cudnn_dtype(dtype);
  const cudnnTensorFormat_t format = channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  set_tensor4d(plan->x, dt, xs, format);
  set_tensor4d(plan->y, dt, ys, format);
  TANDEM_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w.d, dt, format, to_int(ws[0]),
                                                to_int(ws[1]), to_int(ws[2]), to_int(ws[3])));
  TANDEM_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
      plan->conv.d, to_int(p.pad_h), to_int(p.pad_w), to_int(p.stride_h), to_int(p.stride_w), 1, 1,
      CUDNN_CROSS_CORRELATION, cudnn_compute_dtype(dtype)));
  TANDEM_CUDNN_CHECK(cudnnSetConvolutionMathType(
      plan->conv.d, dtype == kFloat32 && !tf32_for(dtype) ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH));
  int n = 0, k = 0, oh = 0, ow = 0;
  TANDEM_CUDNN_CHECK(
      cudnnGetConvolution2dForwardOutputDim(plan->conv.d, plan->x.d, plan->w.d, &n, &k, &oh, &ow));
  TANDEM_CHECK(n == ys[0] && k == ys[1] && oh == ys[2] && ow == ys[3], Shape, "conv2d: x ",
               shape_str(xs), ", w ", shape_str(ws), " give an output [", n, ",", k, ",", oh, ",",
               ow, "], not ", shape_str(ys));
  if (cudnn_graph_api()) {
    // Note [measured engine choice]: in benchmark mode the engines are timed on these buffers.
    const ConvGraph::TimedBuffers timed{device, const_cast<void*>(bufs.x), const_cast<void*>(bufs.w),
                                        const_cast<void*>(bufs.y)};
    plan->graph = ConvGraph::build(h, pass, dtype, channels_last, xs, ws, ys, p, alignment, tf32_for(dtype),
                                   cudnn_deterministic(), kMaxWorkspace, benchmark_mode() ? &timed : nullptr);
  }
  if (plan->graph) {
    plan->workspace = plan->graph->workspace();
  } else if (!choose_algorithm<Pass>(h, *plan, dtype, device, bufs)) {
    // Some configurations have channels-last engines only in the graph API (float64 through the
    // legacy calls, measured): convolve() then runs them contiguous.
    TANDEM_CHECK(channels_last, Cudnn, "conv2d: cuDNN offers no usable algorithm for x ", shape_str(xs), ", w ",
                 shape_str(ws), " ", dtype_name(dtype));
    plan->contiguous_only = true;
  }
  return *(plans[key] = std::move(plan));
}

// Runs one pass on x [N, C, H, W], w [K, C, R, S], y [N, K, P, Q] (all contiguous or all
// channels-last; pointers in the forward roles; the pass overwrites Pass::out) on the
// device's current stream: through the plan's cached graph, or the legacy call.
template <typename Pass, typename T>
void convolve(Device device, const Tensor& xt, const Tensor& wt, const Tensor& yt, const Conv2dParams& p) {
  const Shape &xs = xt.shape(), &ws = wt.shape(), &ys = yt.shape();
  void *x = xt.raw_data(), *w = wt.raw_data(), *y = yt.raw_data();
  cudnnHandle_t h = cudnn_handle(device);
  const ConvPlan& plan = get_plan<Pass>(h, xs, ws, ys, p, dtype_of<T>::value, channels_last(xt, wt, yt), device,
                                        {x, w, y, Pass::out(x, w, y)});
  if (plan.contiguous_only) {
    const Tensor xc = xt.contiguous(), wc = wt.contiguous(), yc = yt.contiguous();
    convolve<Pass, T>(device, xc, wc, yc, p);
    const Tensor& out = Pass::kPass == ConvPass::Forward ? yt : Pass::kPass == ConvPass::BackwardData ? xt : wt;
    out.copy_(Pass::kPass == ConvPass::Forward ? yc : Pass::kPass == ConvPass::BackwardData ? xc : wc);
    return;
  }
  if (plan.graph) {
    // Note [a workspace prepared ahead] (graph_memset.cu): inside a capture, the stream's own
    // workspace where it fits; outside, the stream keeps one big enough for the captures.
    cudaStream_t stream = current_cuda_stream(device);
    StreamWorkspace ahead;
    if (is_current_stream_capturing(device)) {
      ahead = capture_stream_workspace(device, stream, plan.workspace);
    } else {
      reserve_stream_workspace(device, stream, plan.workspace);
    }
    if (ahead) {
      plan.graph->run(h, x, w, y, ahead.data, &ahead);
      return;
    }
    DataPtr workspace = allocate(device, plan.workspace);
    plan.graph->run(h, x, w, y, workspace.get());
    return;
  }
  DataPtr workspace = allocate(device, plan.workspace);
  const opmath_t<T> one = 1, zero = 0;  // in the compute type (cudnn_compute_dtype)
  TANDEM_CUDNN_CHECK(Pass::run(h, plan, &one, &zero, x, w, y, workspace.get()));
}

// y [N, K, PQ] += bias [K] (channel_map, channel_reduce.cuh). A batch norm that takes the bias
// adds it with the same add (add_conv_bias, Note [conv bias in batch norm] in batchnorm.cuh).
template <typename T>
struct AddBias {
  const T* bias;
  __device__ T coef_of(int64_t c) const { return bias[c]; }
  __device__ T operator()(T b, T y) const { return y + b; }
};

}  // namespace
}  // namespace gpu

void CudaBackend::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias,
                                 const Conv2dParams& p, const Tensor& y) {
  if (y.numel() == 0) return;
  DeviceGuard guard(x.device());
  if (gpu::direct_conv_applies(gpu::DirectPass::Forward, x, w, y, p)) {  // Note [direct convolution]
    gpu::direct_conv_forward(x, w, bias, p, y, current_cuda_stream(x.device()));
    return;
  }
  if (gpu::row_conv_applies(gpu::RowPass::Forward, x, w, y, p)) {  // Note [row convolution]
    gpu::row_conv_forward(x, w, bias, p, y, current_cuda_stream(x.device()));
    return;
  }
  // Note [one-input-channel convolution]
  if (gpu::one_channel_conv_applies(gpu::OneChannelPass::Forward, x, w, y, p)) {
    gpu::one_channel_conv_forward(x, w, bias, p, y, current_cuda_stream(x.device()));
    return;
  }
  dispatch_floating_bf16(x.dtype(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::convolve<gpu::FwdPass, T>(x.device(), x, w, y, p);
    if (bias.defined()) {
      gpu::channel_map_any(y, gpu::AddBias<T>{gpu::cptr<T>(bias)}, gpu::ptr<T>(y), current_cuda_stream(x.device()),
                           gpu::cptr<T>(y));
    }
  });
}

void CudaBackend::conv2d_backward_input(const Tensor& dy, const Tensor& w, const Conv2dParams& p,
                                        const Tensor& dx) {
  if (dx.numel() == 0) return;
  DeviceGuard guard(dx.device());
  if (dy.numel() == 0) {
    fill(dx, 0.0);
    return;
  }
  if (gpu::row_conv_applies(gpu::RowPass::BackwardInput, dx, w, dy, p)) {  // Note [row convolution]
    gpu::row_conv_backward_input(dy, w, p, dx, current_cuda_stream(dx.device()));
    return;
  }
  dispatch_floating_bf16(dx.dtype(), "conv2d_backward_input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::convolve<gpu::BwdDataPass, T>(dx.device(), dx, w, dy, p);
  });
}

void CudaBackend::conv2d_backward_weight(const Tensor& x, const Tensor& dy, const Conv2dParams& p,
                                         const Tensor& dw, const Tensor& db) {
  DeviceGuard guard(dw.device());
  if (x.numel() == 0 || dy.numel() == 0) {  // an empty batch contributes nothing
    if (dw.numel() > 0) fill(dw, 0.0);
    if (db.defined() && db.numel() > 0) fill(db, 0.0);
    return;
  }
  const bool one_channel = (!db.defined() || db.dtype() == dw.dtype()) &&
                           gpu::one_channel_conv_applies(gpu::OneChannelPass::BackwardWeight, x, dw, dy, p);
  if (dw.dtype() != x.dtype() || (db.defined() && db.dtype() != x.dtype())) {
    // float32 gradients of bfloat16 x and dy (kernels/backend.h): written directly by the
    // one-channel kernel, else computed in bfloat16 and converted.
    if (one_channel) {
      gpu::one_channel_conv_backward_weight(x, dy, p, dw, db, current_cuda_stream(dw.device()));
      return;
    }
    const Tensor dw_x = empty(dw.shape(), x.dtype(), dw.device(), suggest_memory_format(dw));
    const Tensor db_x = db.defined() ? empty(db.shape(), x.dtype(), db.device()) : Tensor();
    conv2d_backward_weight(x, dy, p, dw_x, db_x);
    dw.copy_(dw_x);
    if (db.defined()) db.copy_(db_x);
    return;
  }
  if (gpu::direct_conv_applies(gpu::DirectPass::BackwardWeight, x, dw, dy, p)) {
    gpu::direct_conv_backward_weight(x, dy, p, dw, db, current_cuda_stream(dw.device()));
    return;
  }
  if (gpu::row_conv_applies(gpu::RowPass::BackwardWeight, x, dw, dy, p)) {  // Note [row convolution]
    gpu::row_conv_backward_weight(x, dy, p, dw, db, current_cuda_stream(dw.device()));
    return;
  }
  if (one_channel) {  // Note [one-input-channel convolution]
    gpu::one_channel_conv_backward_weight(x, dy, p, dw, db, current_cuda_stream(dw.device()));
    return;
  }
  dispatch_floating_bf16(dw.dtype(), "conv2d_backward_weight", [&](auto tag) {
    using T = typename decltype(tag)::type;
    gpu::convolve<gpu::BwdFilterPass, T>(dw.device(), x, dw, dy, p);
  });
  if (db.defined()) conv2d_backward_bias(dy, db);
}

void CudaBackend::conv2d_backward_bias(const Tensor& dy, const Tensor& db) {
  DeviceGuard guard(db.device());
  if (dy.numel() == 0) {
    if (db.numel() > 0) fill(db, 0.0);
    return;
  }
  dispatch_floating_bf16(db.dtype(), "conv2d_backward_bias", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // db = per-channel sum of dy (Note [split channel reductions], Note [channels-last
    // channel reductions]); a batch norm that takes the bias computes the same bits (Note
    // [conv bias in batch norm] in batchnorm.cuh).
    gpu::channel_sum_any<T>(dy, gpu::ptr<T>(db), current_cuda_stream(db.device()));
  });
}

}  // namespace tandem
