#include "kernels/cuda/cudnn_graph.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/cuda_stream.h"
#include "kernels/cuda/cudnn_util.h"
#include "kernels/cuda/graph_memset.h"

namespace tandem::gpu {

namespace {

// Unique ids of the three tensors of a pass, whatever their roles.
constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3;

// The attribute names of the three tensors and the descriptor of each pass's operation.
struct PassAttrs {
  cudnnBackendDescriptorType_t op;
  cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
};

PassAttrs attrs_of(ConvPass pass) {
  switch (pass) {
    case ConvPass::Forward:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA};
    case ConvPass::BackwardData:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA};
    case ConvPass::BackwardFilter:
      return {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA};
  }
  TANDEM_THROW(Value, "conv2d: unknown pass");
}

bool has_note(const std::vector<cudnnBackendNumericalNote_t>& notes, cudnnBackendNumericalNote_t n) {
  return std::find(notes.begin(), notes.end(), n) != notes.end();
}

// What cuDNN says of the engine of an engine configuration: its numerical notes, its
// behaviour notes and its global index (empty and -1 where cuDNN does not say).
struct EngineInfo {
  std::vector<cudnnBackendNumericalNote_t> numerical;
  std::vector<cudnnBackendBehaviorNote_t> behavior;
  int64_t index = -1;
};

// The notes of type T an engine has (its numerical or behaviour notes); empty where cuDNN does
// not say.
template <typename T>
std::vector<T> engine_notes(cudnnBackendDescriptor_t e, cudnnBackendAttributeName_t name,
                            cudnnBackendAttributeType_t type, int64_t max_count) {
  std::vector<T> notes(static_cast<size_t>(max_count));
  int64_t got = 0;
  if (cudnnBackendGetAttribute(e, name, type, max_count, &got, notes.data()) != CUDNN_STATUS_SUCCESS) got = 0;
  notes.resize(static_cast<size_t>(std::clamp<int64_t>(got, 0, max_count)));
  return notes;
}

EngineInfo engine_info(const BackendDesc& cfg) {
  EngineInfo info;
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t got = 0;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got,
                               &e) != CUDNN_STATUS_SUCCESS) {
    return info;
  }
  info.numerical = engine_notes<cudnnBackendNumericalNote_t>(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                                             CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT);
  info.behavior = engine_notes<cudnnBackendBehaviorNote_t>(e, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
                                                           CUDNN_TYPE_BEHAVIOR_NOTE, CUDNN_BEHAVIOR_NOTE_TYPE_COUNT);
  int64_t index = -1;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &index) ==
      CUDNN_STATUS_SUCCESS) {
    info.index = index;
  }
  return info;
}

// The execution plan of one engine configuration, when it finalizes and needs at most
// max_workspace bytes.
std::optional<GraphPlan> plan_of(cudnnHandle_t h, const BackendDesc& cfg, const EngineInfo& info,
                                 size_t max_workspace) {
  auto plan = std::make_unique<BackendDesc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "plan handle");
  plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg, "plan engine");
  if (plan->finalize() != CUDNN_STATUS_SUCCESS) return std::nullopt;
  int64_t bytes = 0, got = 0;
  if (cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                               &bytes) != CUDNN_STATUS_SUCCESS ||
      bytes < 0 || static_cast<size_t>(bytes) > max_workspace) {
    return std::nullopt;
  }
  GraphPlan p;
  p.plan = std::move(plan);
  p.workspace = static_cast<size_t>(bytes);
  p.engine = info.index;
  p.runtime_compiled = std::find(info.behavior.begin(), info.behavior.end(),
                                 CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION) != info.behavior.end();
  return p;
}

// The finalized graph of `ops` on h, or nullopt when cuDNN refuses it.
std::optional<BackendDesc> operation_graph(cudnnHandle_t h, const std::vector<const BackendDesc*>& ops) {
  std::vector<cudnnBackendDescriptor_t> raw;
  for (const BackendDesc* op : ops) raw.push_back(op->get());
  BackendDesc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(raw.size()),
            raw.data(), "graph ops");
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h, "graph handle");
  if (graph.finalize() != CUDNN_STATUS_SUCCESS) return std::nullopt;
  return graph;
}

// Engine configurations cuDNN's heuristics propose for the graph, best first.
std::vector<std::unique_ptr<BackendDesc>> engine_configs(const BackendDesc& graph, cudnnBackendHeurMode_t mode) {
  BackendDesc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  if (heur.finalize() != CUDNN_STATUS_SUCCESS) return {};
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr) != CUDNN_STATUS_SUCCESS || count <= 0) {
    return {};
  }
  std::vector<std::unique_ptr<BackendDesc>> cfgs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    cfgs.push_back(std::make_unique<BackendDesc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(cfgs.back()->get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                               raw.data()) != CUDNN_STATUS_SUCCESS) {
    return {};
  }
  cfgs.resize(static_cast<size_t>(std::clamp<int64_t>(got, 0, count)));
  return cfgs;
}

// Runs `plan` on the three pointers (uids kUidX/W/Y) and a workspace, on h's stream.
void execute(cudnnHandle_t h, const BackendDesc& plan, void* x, void* w, void* y, void* workspace,
             const StreamWorkspace* ahead = nullptr) {
  const std::array<int64_t, 3> uids{kUidX, kUidW, kUidY};
  const std::array<void*, 3> ptrs{x, w, y};
  execute_plan(h, plan, uids, ptrs, workspace, ahead);
}

// An executable graph, destroyed with its owner.
struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  ~GraphExec() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
};

// One candidate's timing: `runs` runs of its plan on `stream`, captured once into a CUDA graph
// of their own and replayed (in_graph: Note [engines timed in a graph]) or launched one by one.
// Construction runs one untimed round (a graph's first launch uploads it); the workspace exists
// before and outlives the timer.
class CandidateTimer {
 public:
  CandidateTimer(cudnnHandle_t h, const BackendDesc& plan, const ConvGraph::TimedBuffers& b, void* ws, Stream s,
                 int runs, bool in_graph)
      : h_(h), plan_(plan), b_(b), ws_(ws), s_(s), runs_(runs) {
    const auto stream = static_cast<cudaStream_t>(s.handle());
    if (in_graph && cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();  // a stream that cannot be captured: timed as launched instead
      in_graph = false;
    }
    if (in_graph) {
      cudaGraph_t graph = nullptr;
      try {
        run_all();
      } catch (...) {
        if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) cudaGraphDestroy(graph);
        throw;
      }
      TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      const cudaError_t made = cudaGraphInstantiate(&exec_.exec, graph, 0);
      cudaGraphDestroy(graph);
      TANDEM_CUDA_CHECK(made);
    }
    round();
  }

  // The milliseconds of one round (synchronizes the host with the stream).
  float time() {
    Event start(/*enable_timing=*/true), stop(/*enable_timing=*/true);
    start.record(s_);
    round();
    stop.record(s_);
    return start.elapsed_ms(stop);
  }

 private:
  void run_all() {
    for (int r = 0; r < runs_; ++r) execute(h_, plan_, b_.x, b_.w, b_.y, ws_);
  }
  void round() {
    if (exec_.exec != nullptr) {
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec_.exec, static_cast<cudaStream_t>(s_.handle())));
    } else {
      run_all();
    }
  }

  cudnnHandle_t h_;
  const BackendDesc& plan_;
  const ConvGraph::TimedBuffers& b_;
  void* ws_;
  Stream s_;
  int runs_;
  GraphExec exec_;  // none when timed as launched
};

// Note [measured engine choice]: the index of the candidate with the least time for
// kTimedRuns runs (in a graph or launched: Note [engines timed in a graph]), on the current
// stream: each candidate's least time over cudnn_benchmark_rounds() rounds, every candidate
// timed once per round. `what` names the configuration in cudnn_benchmark_log()'s line.
template <typename Candidates>
size_t fastest_engine(cudnnHandle_t h, const Candidates& found, const ConvGraph::TimedBuffers& b,
                      const std::function<std::string()>& what) {
  constexpr int kTimedRuns = 3;
  const bool in_graph = cudnn_benchmark_in_graph();
  size_t max_ws = 0;
  for (const auto& c : found) max_ws = std::max(max_ws, c.workspace);
  DataPtr ws = allocate(b.device, max_ws);
  const Stream stream = current_stream(b.device);
  std::vector<std::unique_ptr<CandidateTimer>> timers;
  for (const auto& c : found) {
    execute(h, *c.plan, b.x, b.w, b.y, ws.get());  // loads the engine's kernels, outside any capture
    timers.push_back(std::make_unique<CandidateTimer>(h, *c.plan, b, ws.get(), stream, kTimedRuns, in_graph));
  }
  std::vector<float> least(found.size(), std::numeric_limits<float>::infinity());
  for (int r = 0; r < cudnn_benchmark_rounds(); ++r) {
    for (size_t i = 0; i < found.size(); ++i) least[i] = std::min(least[i], timers[i]->time());
  }
  const auto best = static_cast<size_t>(std::min_element(least.begin(), least.end()) - least.begin());
  if (cudnn_benchmark_log()) {
    std::string line = "tandem: cuDNN benchmark, " + what() + ": ms per " + std::to_string(kTimedRuns) + " runs,";
    for (size_t i = 0; i < found.size(); ++i) {
      line += (i == best ? " [engine " : " engine ") + std::to_string(found[i].engine) + " " + std::to_string(least[i]) +
              (i == best ? "]" : "");
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  return best;
}

// The operation of one convolution pass, not finalized (ConvGraph::build finalizes it itself:
// a refusal there means "use the legacy calls", not an error).
BackendDesc unfinalized_convolution_op(ConvPass pass, const BackendDesc& conv, cudnnDataType_t compute,
                                       const BackendDesc& x, const BackendDesc& w, const BackendDesc& y) {
  const PassAttrs a = attrs_of(pass);
  BackendDesc op(a.op);
  op.set_desc(a.x, x, "x");
  op.set_desc(a.w, w, "w");
  op.set_desc(a.y, y, "y");
  op.set_desc(a.conv, conv, "convolution");
  const double one64 = 1, zero64 = 0;
  const float one32 = 1, zero32 = 0;
  const bool f64 = compute == CUDNN_DATA_DOUBLE;
  op.set(a.alpha, f64 ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT, 1, f64 ? static_cast<const void*>(&one64) : &one32,
         "alpha");
  op.set(a.beta, f64 ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT, 1, f64 ? static_cast<const void*>(&zero64) : &zero32,
         "beta");
  return op;
}

}  // namespace

BackendDesc::BackendDesc(cudnnBackendDescriptorType_t type) {
  TANDEM_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_));
}

BackendDesc::~BackendDesc() {
  if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
}

void BackendDesc::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
                      const void* values, const char* what) {
  cudnnStatus_t st = cudnnBackendSetAttribute(d_, name, type, count, values);
  if (st != CUDNN_STATUS_SUCCESS) TANDEM_THROW(Cudnn, "cuDNN graph: setting ", what, " failed: ", cudnnGetErrorString(st));
}

void BackendDesc::set_desc(cudnnBackendAttributeName_t name, const BackendDesc& d, const char* what) {
  cudnnBackendDescriptor_t raw = d.get();
  set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw, what);
}

int64_t common_alignment(std::initializer_list<const void*> ptrs) {
  int64_t a = 16;
  for (const void* p : ptrs) {
    const auto v = reinterpret_cast<uintptr_t>(p);
    while (a > 1 && v % static_cast<uintptr_t>(a) != 0) a /= 2;
  }
  return a;
}

BackendDesc graph_tensor(int64_t uid, cudnnDataType_t dt, const std::array<int64_t, 4>& dims,
                         const std::array<int64_t, 4>& strides, int64_t alignment, bool is_virtual) {
  BackendDesc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data(), "tensor dims");
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data(), "tensor strides");
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor id");
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
  if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual");
  TANDEM_CUDNN_CHECK(t.finalize());
  return t;
}

BackendDesc graph_tensor(int64_t uid, cudnnDataType_t dt, const Shape& s, MemoryFormat f, int64_t alignment,
                         bool is_virtual) {
  TANDEM_CHECK(s.size() == 4, Shape, "cuDNN graph: expected a 4-D shape, got ", shape_str(s));
  const Strides st = strides_for(s, f);
  return graph_tensor(uid, dt, {s[0], s[1], s[2], s[3]}, {st[0], st[1], st[2], st[3]}, alignment, is_virtual);
}

BackendDesc convolution_desc(const Conv2dParams& p, cudnnDataType_t compute) {
  BackendDesc conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const int64_t spatial = 2;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const std::array<int64_t, 2> dilation{1, 1}, stride{p.stride_h, p.stride_w}, pad{p.pad_h, p.pad_w};
  conv.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial, "spatial dims");
  conv.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "compute type");
  conv.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode, "mode");
  conv.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation.data(), "dilations");
  conv.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride.data(), "strides");
  conv.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad.data(), "padding");
  conv.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad.data(), "padding");
  TANDEM_CUDNN_CHECK(conv.finalize());
  return conv;
}

BackendDesc convolution_op(ConvPass pass, const BackendDesc& conv, cudnnDataType_t compute,
                           const BackendDesc& x, const BackendDesc& w, const BackendDesc& y) {
  BackendDesc op = unfinalized_convolution_op(pass, conv, compute, x, w, y);
  TANDEM_CUDNN_CHECK(op.finalize());
  return op;
}

BackendDesc pointwise_op(cudnnPointwiseMode_t mode, const BackendDesc& x, const BackendDesc* b,
                         const BackendDesc& y) {
  BackendDesc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
  pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
  TANDEM_CUDNN_CHECK(pw.finalize());
  BackendDesc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, "pointwise descriptor");
  if (mode == CUDNN_POINTWISE_RELU_BWD) {
    TANDEM_CHECK(b != nullptr, Value, "cuDNN graph: a ReLU backward needs its output gradient");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "relu input");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, *b, "relu dy");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_DXDESC, y, "relu dx");
  } else {
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
    if (b != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b, "pointwise b");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
  }
  TANDEM_CUDNN_CHECK(op.finalize());
  return op;
}

BackendDesc genstats_op(const BackendDesc& x, const BackendDesc& sum, const BackendDesc& sqsum) {
  BackendDesc op(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR);
  const cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  op.set(CUDNN_ATTR_OPERATION_GENSTATS_MODE, CUDNN_TYPE_GENSTATS_MODE, 1, &mode, "genstats mode");
  op.set(CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "genstats precision");
  op.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_XDESC, x, "genstats x");
  op.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum, "genstats sum");
  op.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum, "genstats sqsum");
  TANDEM_CUDNN_CHECK(op.finalize());
  return op;
}

BackendDesc reduction_sum_op(const BackendDesc& x, const BackendDesc& y) {
  BackendDesc red(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  const cudnnReduceTensorOp_t add = CUDNN_REDUCE_TENSOR_ADD;
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  const bool deterministic = true;
  red.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &add, "reduction operator");
  red.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &prec, "reduction precision");
  red.set(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic, "reduction determinism");
  TANDEM_CUDNN_CHECK(red.finalize());
  BackendDesc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
  op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
  op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red, "reduction");
  TANDEM_CUDNN_CHECK(op.finalize());
  return op;
}

std::vector<GraphPlan> graph_plans(cudnnHandle_t h, const std::vector<const BackendDesc*>& ops,
                                   size_t max_workspace, size_t limit) {
  std::vector<GraphPlan> plans;
  std::optional<BackendDesc> graph = operation_graph(h, ops);
  if (!graph) return plans;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (const auto& cfg : engine_configs(*graph, mode)) {
      if (plans.size() >= limit) break;
      if (auto p = plan_of(h, *cfg, engine_info(*cfg), max_workspace)) plans.push_back(std::move(*p));
    }
    if (!plans.empty()) break;
  }
  return plans;
}

void execute_plan(cudnnHandle_t h, const BackendDesc& plan, std::span<const int64_t> uids,
                  std::span<void* const> ptrs, void* workspace, const StreamWorkspace* ahead) {
  TANDEM_CHECK(uids.size() == ptrs.size(), Value, "cuDNN graph: ", uids.size(), " tensor ids for ", ptrs.size(),
               " pointers");
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const auto n = static_cast<int64_t>(uids.size());
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data(), "variant ids");
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs.data(), "variant pointers");
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "workspace");
  TANDEM_CUDNN_CHECK(pack.finalize());
  cudaStream_t stream = nullptr;
  TANDEM_CUDNN_CHECK(cudnnGetStream(h, &stream));
  // Inside a capture, on a stream of its own whose memsets become kernels (Note [cuDNN's
  // memsets in a captured graph] in graph_memset.cu); h goes back to `stream` after.
  run_memsets_as_kernels(stream, [&](cudaStream_t s) {
    if (s == stream) {
      TANDEM_CUDNN_CHECK(cudnnBackendExecute(h, plan.get(), pack.get()));
      return;
    }
    TANDEM_CUDNN_CHECK(cudnnSetStream(h, s));
    const cudnnStatus_t ran = cudnnBackendExecute(h, plan.get(), pack.get());
    TANDEM_CUDNN_CHECK(cudnnSetStream(h, stream));
    TANDEM_CUDNN_CHECK(ran);
  }, ahead);
}

std::unique_ptr<ConvGraph> ConvGraph::build(cudnnHandle_t h, ConvPass pass, DType dtype, bool channels_last,
                                            const Shape& xs,
                                            const Shape& ws, const Shape& ys, const Conv2dParams& p,
                                            int64_t alignment, bool allow_tf32, bool deterministic,
                                            size_t max_workspace, const TimedBuffers* timed) {
  const cudnnDataType_t dt = cudnn_dtype(dtype), compute = cudnn_compute_dtype(dtype);
  const MemoryFormat format = channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  BackendDesc x = graph_tensor(kUidX, dt, xs, format, alignment);
  BackendDesc w = graph_tensor(kUidW, dt, ws, format, alignment);
  BackendDesc y = graph_tensor(kUidY, dt, ys, format, alignment);
  BackendDesc conv = convolution_desc(p, compute);
  BackendDesc op = unfinalized_convolution_op(pass, conv, compute, x, w, y);
  if (op.finalize() != CUDNN_STATUS_SUCCESS) return nullptr;
  std::optional<BackendDesc> graph = operation_graph(h, {&op});
  if (!graph) return nullptr;

  // Acceptable engines in order of preference: mode A's deterministic ones, else its
  // nondeterministic ones; the fallback mode's (in the same order) only when mode A has none.
  std::vector<GraphPlan> found;
  const size_t wanted = timed != nullptr ? static_cast<size_t>(cudnn_benchmark_engines()) : 1;
  for (cudnnBackendHeurMode_t mode_h : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (int round = 0; round < 2 && found.empty(); ++round) {
      for (const auto& cfg : engine_configs(*graph, mode_h)) {
        if (found.size() >= wanted) break;
        const EngineInfo info = engine_info(*cfg);
        const auto& notes = info.numerical;
        // Round 0 takes what `deterministic` allows; round 1 the nondeterministic rest.
        const bool nondeterministic = has_note(notes, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
        if (round == 0 ? deterministic && nondeterministic : !deterministic || !nondeterministic) continue;
        if (dtype == kFloat32 && !allow_tf32 &&
            (has_note(notes, CUDNN_NUMERICAL_NOTE_TENSOR_CORE) ||
             has_note(notes, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS))) {
          continue;
        }
        if (auto plan = plan_of(h, *cfg, info, max_workspace)) found.push_back(std::move(*plan));
      }
    }
    if (!found.empty()) break;
  }
  if (found.empty()) return nullptr;
  size_t best = 0;
  if (timed != nullptr && found.size() > 1 && !is_current_stream_capturing(timed->device)) {
    best = fastest_engine(h, found, *timed, [&] {
      const char* names[] = {"forward", "input gradient", "weight gradient"};
      return std::string(names[static_cast<int>(pass)]) + " x " + shape_str(xs) + " w " + shape_str(ws) + " " +
             dtype_name(dtype) + (channels_last ? " channels-last" : "");
    });
  }
  std::unique_ptr<ConvGraph> g(new ConvGraph());
  g->plan_ = std::move(found[best].plan);
  g->workspace_ = found[best].workspace;
  return g;
}

void ConvGraph::run(cudnnHandle_t h, void* x, void* w, void* y, void* workspace, const StreamWorkspace* ahead) const {
  execute(h, *plan_, x, w, y, workspace, ahead);
}

}  // namespace tandem::gpu
