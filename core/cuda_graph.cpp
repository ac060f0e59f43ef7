#include "core/cuda_graph.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#include "core/cuda_stream.h"
#endif

namespace tandem {

// In core/allocator.cpp, beside the capture record (Note [allocation under graph capture]); only
// CUDAGraph uses it: the blocks allocated during the record's capture that tensors still hold.
std::vector<std::pair<void*, size_t>> capture_memory_held(const CaptureMemory& record);

CUDAGraph::~CUDAGraph() {
  capture_abort();
  reset();
}

#ifdef TANDEM_WITH_CUDA

namespace {

// Note [a refused capture's memory] (cuda_graph.h): a graph allocation exists only once the
// graph runs, and one that the graph does not free itself outlives the graph (destroying a
// graph frees no live graph allocation; cudaFreeAsync frees it like any block). So the refused
// graph is launched once with every node that does work switched off -- only its allocation
// and free nodes run -- which makes the kept blocks ordinary memory that their tensors free
// as usual; they are then zeroed. False (nothing launched) when the graph holds work that
// cannot be switched off (a host function, a child graph) or a call fails.
bool back_kept_memory(cudaGraph_t graph, cudaStream_t stream, const std::vector<std::pair<void*, size_t>>& kept) {
  size_t n = 0;
  if (cudaGraphGetNodes(graph, nullptr, &n) != cudaSuccess) return false;
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0 && cudaGraphGetNodes(graph, nodes.data(), &n) != cudaSuccess) return false;
  std::vector<cudaGraphNode_t> work;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess) return false;
    switch (type) {
      case cudaGraphNodeTypeKernel:
      case cudaGraphNodeTypeMemcpy:
      case cudaGraphNodeTypeMemset:
        work.push_back(node);
        break;
      case cudaGraphNodeTypeMemAlloc:
      case cudaGraphNodeTypeMemFree:
      case cudaGraphNodeTypeEmpty:
      case cudaGraphNodeTypeWaitEvent:
      case cudaGraphNodeTypeEventRecord:
        break;
      default:
        return false;
    }
  }
  cudaGraphExec_t exec = nullptr;
  if (cudaGraphInstantiateWithFlags(&exec, graph, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  bool ok = true;
  for (cudaGraphNode_t node : work) ok = ok && cudaGraphNodeSetEnabled(exec, node, 0) == cudaSuccess;
  ok = ok && cudaGraphLaunch(exec, stream) == cudaSuccess;
  TANDEM_CUDA_CHECK_LOG(cudaGraphExecDestroy(exec));  // released once the launch is done
  if (!ok) {
    (void)cudaGetLastError();
    return false;
  }
  for (const auto& [q, nbytes] : kept) TANDEM_CUDA_CHECK(cudaMemsetAsync(q, 0, nbytes, stream));
  return true;
}

}  // namespace

void CUDAGraph::capture_begin(Device device) {
  TANDEM_CHECK(device.is_cuda(), Device, "CUDAGraph: capture needs a CUDA device, got ", device.str());
  TANDEM_CHECK(!capturing_, Value, "CUDAGraph: capture_begin while a capture is under way");
  check_device_exists(device);
  reset();
  unbacked_bytes_ = 0;
  DeviceGuard guard(device);
  device_ = device;
  auto stream = current_cuda_stream(device);
  stream_ = stream;
  memory_ = capture_memory_begin(device, stream);
  // Thread-local mode: only this thread's unsafe calls (a cudaMalloc, a synchronization)
  // break the capture; other threads driving other devices are not affected.
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    capture_memory_abandon(*memory_);
    memory_.reset();
    TANDEM_THROW(Cuda, "CUDAGraph: cudaStreamBeginCapture on ", device.str(), " failed: ",
                 cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  capturing_ = true;
}

void CUDAGraph::capture_end() {
  TANDEM_CHECK(capturing_, Value, "CUDAGraph: capture_end without capture_begin");
  DeviceGuard guard(device_);
  auto stream = static_cast<cudaStream_t>(stream_);
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(stream, &graph);
  capturing_ = false;
  const size_t held = capture_memory_end(*memory_);
  if (err != cudaSuccess || graph == nullptr) {
    (void)cudaGetLastError();  // a failed capture leaves its error as the last error
    if (graph != nullptr) cudaGraphDestroy(graph);
    capture_memory_abandon(*memory_);
    memory_.reset();
    unbacked_bytes_ = held;
    TANDEM_THROW(Cuda, "CUDAGraph: capture on ", device_.str(), " failed: ", cudaGetErrorName(err),
                 " (", cudaGetErrorString(err), ")");
  }
  if (held != 0) {
    // Note [a refused capture's memory]: the tensors that keep those blocks get real memory.
    const bool backed = back_kept_memory(graph, stream, capture_memory_held(*memory_));
    cudaGraphDestroy(graph);
    if (!backed) {
      capture_memory_abandon(*memory_);
      unbacked_bytes_ = held;
    }
    memory_.reset();  // frees, in stream order, what the capture kept for the graph
    TANDEM_THROW(Error, "CUDAGraph: the captured work on ", device_.str(), " left ", held,
                 " bytes allocated during the capture in use after it, so it was not kept (a replay would "
                 "reuse them; ", backed ? "they are zeroed memory now, none of the work ran" : "they never existed",
                 "; create state before capturing: Note [graph-safe steps] in core/cuda_graph.h)");
  }
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes_));
  cudaGraphExec_t exec = nullptr;
  // Each kernel keeps the priority of the stream it was captured on (Note [stream priorities]).
  err = cudaGraphInstantiateWithFlags(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
  if (err != cudaSuccess) {
    cudaGraphDestroy(graph);
    memory_.reset();
    TANDEM_THROW(Cuda, "CUDAGraph: cudaGraphInstantiate on ", device_.str(), " failed: ",
                 cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  exec_ = exec;
  graph_ = graph;  // kept: bind_copies names its nodes
  TANDEM_CUDA_CHECK(cudaGraphUpload(exec, stream));
}

bool CUDAGraph::bind_copies(const std::vector<std::pair<void*, size_t>>& dsts) {
  copies_.clear();
  if (graph_ == nullptr) return false;
  auto graph = static_cast<cudaGraph_t>(graph_);
  size_t n = 0;
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  TANDEM_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (const auto& [dst, bytes] : dsts) {
    void* found = nullptr;
    int matches = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type{};
      TANDEM_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
      if (type != cudaGraphNodeTypeMemcpy) continue;
      cudaMemcpy3DParms p{};
      TANDEM_CUDA_CHECK(cudaGraphMemcpyNodeGetParams(node, &p));
      const bool one_row = p.extent.height == 1 && p.extent.depth == 1 && p.dstPos.x == 0 && p.dstPos.y == 0 &&
                           p.dstPos.z == 0 && p.srcPos.x == 0 && p.srcPos.y == 0 && p.srcPos.z == 0;
      if (one_row && p.dstPtr.ptr == dst && p.extent.width == bytes) {
        found = node;
        ++matches;
      }
    }
    if (matches != 1) {
      copies_.clear();
      return false;
    }
    copies_.push_back({found, dst, bytes});
  }
  return true;
}

void CUDAGraph::replay_from(const std::vector<const void*>& sources) {
  TANDEM_CHECK(exec_ != nullptr, Value, "CUDAGraph: replay before a successful capture");
  TANDEM_CHECK(sources.size() == copies_.size(), Value, "CUDAGraph: ", sources.size(), " sources for ",
               copies_.size(), " bound copies");
  DeviceGuard guard(device_);
  auto exec = static_cast<cudaGraphExec_t>(exec_);
  for (size_t i = 0; i < copies_.size(); ++i) {
    const BoundCopy& c = copies_[i];
    TANDEM_CUDA_CHECK(cudaGraphExecMemcpyNodeSetParams1D(exec, static_cast<cudaGraphNode_t>(c.node), c.dst,
                                                         sources[i], c.bytes, cudaMemcpyDeviceToDevice));
  }
  TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, static_cast<cudaStream_t>(stream_)));
}

void CUDAGraph::capture_abort() noexcept {
  if (!capturing_) return;
  DeviceGuard guard(device_);
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(static_cast<cudaStream_t>(stream_), &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  capturing_ = false;
  unbacked_bytes_ = capture_memory_end(*memory_);  // no graph: what tensors still hold never existed
  capture_memory_abandon(*memory_);
  memory_.reset();
}

void CUDAGraph::replay() const {
  TANDEM_CHECK(exec_ != nullptr, Value, "CUDAGraph: replay before a successful capture");
  DeviceGuard guard(device_);
  TANDEM_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream_)));
}

void CUDAGraph::reset() noexcept {
  if (capturing_) return;
  if (exec_ != nullptr) {
    DeviceGuard guard(device_);
    // An executable graph still running is freed when it completes.
    TANDEM_CUDA_CHECK_LOG(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_)));
    exec_ = nullptr;
  }
  if (graph_ != nullptr) {
    TANDEM_CUDA_CHECK_LOG(cudaGraphDestroy(static_cast<cudaGraph_t>(graph_)));
    graph_ = nullptr;
  }
  copies_.clear();
  memory_.reset();  // frees, in stream order, the blocks the graph kept alive
  num_nodes_ = 0;
}

namespace {
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TANDEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}
}  // namespace

bool is_current_stream_capturing(Device device) {
  return device.is_cuda() && capturing(current_cuda_stream(device));
}

void fork_stream(const Stream& main, const Stream& side, Event& fork) {
  if (!main.device().is_cuda()) return;
  fork.record(main);
  fork.wait(side);
  if (capturing(static_cast<cudaStream_t>(main.handle()))) capture_memory_join(main.device(), main.handle(), side.handle());
}

#else  // no CUDA: nothing can be captured

void CUDAGraph::capture_begin(Device device) {
  TANDEM_THROW(Device, "CUDAGraph: capture on ", device.str(), " needs a CUDA build of tandem");
}
void CUDAGraph::capture_end() { TANDEM_THROW(Value, "CUDAGraph: capture_end without capture_begin"); }
void CUDAGraph::capture_abort() noexcept {}
void CUDAGraph::replay() const { TANDEM_THROW(Value, "CUDAGraph: replay before a successful capture"); }
void CUDAGraph::reset() noexcept {}
bool CUDAGraph::bind_copies(const std::vector<std::pair<void*, size_t>>&) { return false; }
void CUDAGraph::replay_from(const std::vector<const void*>&) {
  TANDEM_THROW(Value, "CUDAGraph: replay before a successful capture");
}
bool is_current_stream_capturing(Device) { return false; }
void fork_stream(const Stream&, const Stream&, Event&) {}

#endif

StepGraph::StepGraph(StepFn step, Options options) : StepGraph(std::move(step), options, std::make_unique<CUDAGraph>()) {}

StepGraph::StepGraph(StepFn step, Options options, std::unique_ptr<CUDAGraph> graph)
    : step_(std::move(step)), options_(options), warmup_left_(options.warmup_steps), graph_(std::move(graph)) {
  TANDEM_CHECK(options.warmup_steps >= 0, Value, "StepGraph: warmup_steps must be >= 0, got ",
               options.warmup_steps);
  TANDEM_CHECK(graph_ != nullptr, Value, "StepGraph: no graph");
}

bool StepGraph::matches(const std::vector<Tensor>& inputs) const {
  if (inputs.size() != static_inputs_.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& a = inputs[i];
    const Tensor& b = static_inputs_[i];
    if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.device() != b.device()) return false;
  }
  return true;
}

// The very tensor: the same memory, shape, strides and dtype (Note [fixed tensors of a step]).
bool StepGraph::same_fixed(const std::vector<Tensor>& fixed) const {
  if (fixed.size() != fixed_.size()) return false;
  for (size_t i = 0; i < fixed.size(); ++i) {
    const Tensor& a = fixed[i];
    const Tensor& b = fixed_[i];
    if (a.defined() != b.defined()) return false;
    if (!a.defined()) continue;
    if (a.raw_data() != b.raw_data() || a.shape() != b.shape() || a.strides() != b.strides() ||
        a.dtype() != b.dtype() || a.device() != b.device())
      return false;
  }
  return true;
}

void StepGraph::invalidate() noexcept { graph_->reset(); }

void StepGraph::disable(std::string reason) {
  disabled_ = true;
  reason_ = std::move(reason);
  graph_->reset();
  fixed_.clear();
}

namespace {
std::vector<Tensor> joined(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  std::vector<Tensor> all(a);
  all.insert(all.end(), b.begin(), b.end());
  return all;
}
}  // namespace

void StepGraph::run_eagerly(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed) {
  ++eager_;
  step_(fixed.empty() ? inputs : joined(inputs, fixed));
}

void StepGraph::operator()(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed) {
  const bool capturable = !inputs.empty() && inputs[0].defined() && graph_->can_capture(inputs[0].device());
  if (!capturable || disabled_ || !options_.enabled) return run_eagerly(inputs, fixed);
  // After the first capture the graph's input shapes are fixed: other shapes (the last batch
  // of an epoch) run eagerly, also when a capture is due, so it is never taken on them.
  const bool shaped = static_inputs_.empty() || matches(inputs);
  if (shaped && graph_->captured() && !same_fixed(fixed)) graph_->reset();  // warmed up: capture again
  if (shaped && graph_->captured()) {
    replay(inputs);
    return;
  }
  if (shaped && warmup_left_ == 0) return capture(inputs, fixed);
  if (shaped) --warmup_left_;
  run_eagerly(inputs, fixed);
}

void StepGraph::replay(const std::vector<Tensor>& inputs) {
  if (copies_inside_) {  // Note [input copies inside the graph]
    std::vector<Tensor> packed;  // alive until the launch is enqueued; freed after it in stream order
    std::vector<const void*> sources;
    for (const Tensor& t : inputs) {
      packed.push_back(t.contiguous());
      sources.push_back(packed.back().raw_data());
    }
    graph_->replay_from(sources);
  } else {
    for (size_t i = 0; i < inputs.size(); ++i) static_inputs_[i].copy_(inputs[i]);
    graph_->replay();
  }
  ++replays_;
}

void StepGraph::capture(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed) {
  if (static_inputs_.empty()) {
    for (const Tensor& t : inputs) static_inputs_.push_back(empty(t.shape(), t.dtype(), t.device()));
  }
  // The copies into the inputs inside the graph where they are plain copies of bytes (Note
  // [input copies inside the graph]); else before every replay, as here before the capture.
  bool inside = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    inside = inside && graph_->copies_inside(inputs[i].device()) && inputs[i].is_contiguous() &&
             static_inputs_[i].nbytes() > 0;
  }
  copies_inside_ = false;
  if (!inside) {
    for (size_t i = 0; i < inputs.size(); ++i) static_inputs_[i].copy_(inputs[i]);
  }
  // Note [a refused capture's memory] (cuda_graph.h): any refusal turns the graph off for good.
  // Capturing again would be worse than useless: state the step made lazily during this
  // capture exists now, so the next capture would keep nothing new, be accepted, and replay
  // on memory whose contents no step ever computed.
  const auto refuse = [&](const std::exception& e) {
    const size_t unbacked = graph_->unbacked_bytes();
    disable(std::string("the step could not be captured: ") + e.what());
    std::fprintf(stderr, "tandem: CUDA graph off, steps run eagerly: %s\n", reason_.c_str());
    TANDEM_CHECK(unbacked == 0, Error, "StepGraph: ", reason_, "; and the step keeps ", unbacked,
                 " bytes it allocated during that capture, memory that never existed, so it cannot run "
                 "eagerly either: create the step's state before capturing (warm-up steps, Note "
                 "[graph-safe steps] in core/cuda_graph.h)");
    run_eagerly(inputs, fixed);  // the captured work never ran: this batch still gets its step
  };
  graph_->capture_begin(inputs[0].device());
  try {
    if (inside) {
      for (size_t i = 0; i < inputs.size(); ++i) static_inputs_[i].copy_(inputs[i]);
    }
    step_(joined(static_inputs_, fixed));
  } catch (const std::exception& e) {
    graph_->capture_abort();
    refuse(e);
    return;
  }
  try {
    graph_->capture_end();
    if (inside) {
      std::vector<std::pair<void*, size_t>> dsts;
      for (const Tensor& t : static_inputs_) dsts.emplace_back(t.raw_data(), t.nbytes());
      // A captured copy not found would copy the capture's source at every replay: never kept.
      TANDEM_CHECK(graph_->bind_copies(dsts), Error, "StepGraph: the copies into the step's inputs are not "
                   "single copy nodes of the graph");
    }
  } catch (const std::exception& e) {  // a failed capture (CudaError) or a refused one (Error)
    refuse(e);
    return;
  }
  fixed_ = fixed;
  copies_inside_ = inside;
  ++captures_;
  replay(inputs);  // capturing ran nothing: this replay is the batch's step
}

}  // namespace tandem
