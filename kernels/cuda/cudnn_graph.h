#pragma once
// One convolution pass as a cuDNN graph (cuDNN's backend API), built once per configuration
// and then run with one small "variant pack" of pointers per call.
//
// Note [cuDNN graph vs legacy calls]: cuDNN 9 implements its legacy entry points
// (cudnnConvolutionForward and friends) on top of this same graph machinery, and pays for it on
// every call: measured on an H200, 85-115 us of host time per legacy call against ~10 us for
// a launch of tandem's own kernels. A ResNet-18 step makes 60 such calls, LeNet 6, so the
// legacy path put the launching thread, not the GPU, on the critical path of small steps.
// Building the operation graph and its execution plan once and executing the cached plan
// skips that per-call work (PyTorch's cuDNN v8 path does the same).
//
// The engine is cuDNN's heuristics' (mode A) first choice that finalizes, preferring a
// deterministic one (Note [deterministic reductions]; any, in cuDNN's order, when
// `deterministic` is false) and, when TF32 is not allowed for float32,
// skipping engines whose numerical notes say tensor cores or down-converted inputs
// (Note [TF32] in conv.cu). The pointers' alignment is part of the configuration: a plan built
// for 16-byte aligned buffers may use vector loads that smaller alignment would break.
//
// Note [measured engine choice]: the heuristics' first choice can be far from the fastest
// engine: for LeNet's weight gradients on an H200 it picks a deterministic kernel taking
// 200 us where others take a few. In benchmark mode (cudnn_benchmark() in kernels/backend.h)
// build() instead runs each of the first cudnn_benchmark_engines() acceptable engines
// (deterministic ones; nondeterministic only when no deterministic one exists; 16 by default)
// on the real buffers and keeps the fastest. That synchronizes the host once per configuration
// -- which is why it is a mode, as torch.backends.cudnn.benchmark is -- so it happens in a
// warm-up step, never inside a CUDA graph capture (there the first choice is taken). Each
// candidate is timed cudnn_benchmark_rounds() times (3 by default), every candidate once per
// round, and keeps its least time: timed once each, in a row, a choice between engines within
// a few percent of each other is left to noise and to the clocks rising over the first
// candidates. cudnn_benchmark_log() prints every candidate's time. The choice is still a
// measurement: two runs may pick different engines, and so differ in the last bits of their
// results.
//
// Note [engines timed in a graph]: a replayed CUDA graph does not pay what eager launches pay.
// Many of cuDNN's sm_90 engines clear a few bytes of their workspace with a memset before the
// kernel (4 bytes, in ResNet-18's step), and in a replayed graph each such memset node stood
// between gaps of about 4 and 5 us where kernel follows kernel after 0.4 (26 of them, ~250 us
// of a 3.5 ms step on an H200); launched eagerly, the memset hides behind the host's launches.
// So benchmark mode times each candidate as the step will run it: its runs captured into a
// small graph of their own (the stream captured thread-locally, the workspace allocated
// before), replayed once untimed and then timed; a stream that refuses the capture has its
// candidates timed as launched. cudnn_benchmark_in_graph() off times eager launches always.
// Measured on ResNet-18's step (H200, bf16, channels-last): the same speed either way (1.003),
// and as many memsets -- the engines that win without them win with them too -- so the
// timing is kept for what it measures, not for a gain seen yet. Since then a captured call's
// memsets become kernels (Note [cuDNN's memsets in a captured graph] in graph_memset.cu), and
// the candidates are timed that way too: their small capture goes through the same path.
#include <cudnn.h>

#include <array>
#include <memory>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/cuda/graph_memset.h"

namespace tandem::gpu {

enum class ConvPass : int64_t { Forward, BackwardData, BackwardFilter };

// Owns one backend descriptor.
class BackendDesc {
 public:
  explicit BackendDesc(cudnnBackendDescriptorType_t type);
  ~BackendDesc();
  BackendDesc(const BackendDesc&) = delete;
  BackendDesc& operator=(const BackendDesc&) = delete;
  BackendDesc(BackendDesc&& o) noexcept : d_(o.d_) { o.d_ = nullptr; }
  BackendDesc& operator=(BackendDesc&&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  // Throws (naming `what`) when cuDNN refuses the attribute.
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values, const char* what);
  void set_desc(cudnnBackendAttributeName_t name, const BackendDesc& d, const char* what);
  cudnnStatus_t finalize() { return cudnnBackendFinalize(d_); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

class ConvGraph {
 public:
  // x [N, C, H, W], w [K, C, R, S], y [N, K, P, Q] (packed NCHW, or all three channels-last:
  // Note [memory formats] in core/tensor.h); `alignment` is the byte
  // alignment every pointer passed to run() will have. Returns nullptr when no engine of
  // cuDNN's graph API takes the configuration (the caller then uses the legacy calls).
  // With `timed` (benchmark mode: buffers of the call, in the forward roles, on `device`), the
  // fastest of the acceptable engines (Note [measured engine choice]); the output buffer of the
  // pass is overwritten while timing.
  struct TimedBuffers {
    Device device;
    void* x;
    void* w;
    void* y;
  };
  static std::unique_ptr<ConvGraph> build(cudnnHandle_t h, ConvPass pass, DType dtype, bool channels_last,
                                          const Shape& xs,
                                          const Shape& ws, const Shape& ys, const Conv2dParams& p,
                                          int64_t alignment, bool allow_tf32, bool deterministic,
                                          size_t max_workspace, const TimedBuffers* timed = nullptr);

  size_t workspace() const { return workspace_; }
  // Runs the pass on h's stream: forward y = conv(x, w); backward data x = dgrad(y, w);
  // backward filter w = wgrad(x, y). The output is overwritten.
  // With `ahead`, `workspace` is that stream workspace (Note [a workspace prepared ahead] in
  // graph_memset.cu).
  void run(cudnnHandle_t h, void* x, void* w, void* y, void* workspace, const StreamWorkspace* ahead = nullptr) const;

 private:
  ConvGraph() = default;
  std::unique_ptr<BackendDesc> plan_;
  size_t workspace_ = 0;
};

// The largest power of two (at most 16) that divides every address: the alignment a plan
// for these buffers may assume.
int64_t common_alignment(std::initializer_list<const void*> ptrs);

// ---- the pieces of a graph of several operations ------------------------------------------
//
// Note [fused graphs]: a graph of cuDNN's backend API may hold more than one operation -- a
// convolution with pointwise operations before or after it, or with per-channel statistics of
// its output (genstats) -- and cuDNN then looks for an engine that runs the graph as one
// kernel, so that the tensors between the operations (marked virtual) never reach memory.
// Which graphs have an engine depends on the GPU, the cuDNN version, the dtypes, the layout
// and the shapes: the only way to know is to build the graph and ask (bench/bench_conv_bn.cpp
// does, for ResNet-18's layers). These are the pieces ConvGraph is made of, exposed so that
// such graphs are built the same way.

// A 4-D tensor of a graph, dims in [N, C, H, W] order with the strides of each; a virtual
// tensor lives only inside the fused kernel and has no pointer in a variant pack.
BackendDesc graph_tensor(int64_t uid, cudnnDataType_t dt, const std::array<int64_t, 4>& dims,
                         const std::array<int64_t, 4>& strides, int64_t alignment, bool is_virtual = false);
// A tensor of shape s in format f (strides_for).
BackendDesc graph_tensor(int64_t uid, cudnnDataType_t dt, const Shape& s, MemoryFormat f, int64_t alignment,
                         bool is_virtual = false);
// A cross-correlation of p's strides and padding (dilation 1) computed in `compute`.
BackendDesc convolution_desc(const Conv2dParams& p, cudnnDataType_t compute);
// One pass of a convolution: forward y = conv(x, w), backward data x = dgrad(y, w), backward
// filter w = wgrad(x, y); alpha 1, beta 0 (float64 when compute is, else float32).
BackendDesc convolution_op(ConvPass pass, const BackendDesc& conv, cudnnDataType_t compute,
                           const BackendDesc& x, const BackendDesc& w, const BackendDesc& y);
// y = mode(x) or y = mode(x, b) (b broadcast along the dims where it has size 1), computed in
// float32. For CUDNN_POINTWISE_RELU_BWD, x is the ReLU's input, b its output gradient dy and
// y the input gradient dx.
BackendDesc pointwise_op(cudnnPointwiseMode_t mode, const BackendDesc& x, const BackendDesc* b,
                         const BackendDesc& y);
// sum and sqsum [1, C, 1, 1] (float32) = the per-channel sum and sum of squares of x.
BackendDesc genstats_op(const BackendDesc& x, const BackendDesc& sum, const BackendDesc& sqsum);

// y = the sum of x over the dims where y has size 1, computed in float32 (deterministic: the
// same bits every run, where cuDNN's engine honours it).
BackendDesc reduction_sum_op(const BackendDesc& x, const BackendDesc& y);

// An execution plan of a graph of operations, with the workspace it needs and what cuDNN says
// of its engine.
struct GraphPlan {
  std::unique_ptr<BackendDesc> plan;
  size_t workspace = 0;
  int64_t engine = -1;          // the engine's global index
  bool runtime_compiled = false;  // built by cuDNN at run time (CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION)
};
// The plans cuDNN's heuristics propose for the graph of `ops` (mode A's, then the fallback
// mode's when mode A has none) that finalize with at most max_workspace bytes, best first; at
// most `limit`. Empty when cuDNN has no engine for the graph (or refuses the graph itself).
std::vector<GraphPlan> graph_plans(cudnnHandle_t h, const std::vector<const BackendDesc*>& ops,
                                   size_t max_workspace, size_t limit);
// Runs `plan` on h's stream with the tensors of the given unique ids at the given pointers (no
// allocation: a convolution runs through here on every call).
// With `ahead`, `workspace` is that stream workspace (run_memsets_as_kernels in graph_memset.h).
void execute_plan(cudnnHandle_t h, const BackendDesc& plan, std::span<const int64_t> uids,
                  std::span<void* const> ptrs, void* workspace, const StreamWorkspace* ahead = nullptr);

}  // namespace tandem::gpu
