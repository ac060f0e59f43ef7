#pragma once
// CUDA graphs: record the work of a step once, replay it with one launch.
//
// A LeNet training step is ~60 small kernels; launched one by one from the host it costs
// ~0.8 ms on an H200, almost all of it the host launching. Captured into a CUDA graph, the same
// kernels replay with one cudaGraphLaunch and the GPU runs them back to back.
//
// CUDAGraph is PyTorch's torch.cuda.CUDAGraph: capture_begin() starts recording the work this
// thread enqueues on the current stream of a device (nothing runs while recording),
// capture_end() turns it into an executable graph, replay() runs it again, on the same memory:
// a graph reads and writes the very addresses it was captured with. So whatever the captured
// work reads must stay alive and in place (the inputs are copied into fixed buffers before each
// replay), and what it allocates must be released inside it (its activations); see
// Note [allocation under graph capture] in core/allocator.h for how memory behaves.
//
// StepGraph wraps a training step: a few eager steps first (so lazily created state --
// momentum buffers, cuDNN plans, cuBLAS workspaces -- exists before the capture), then one
// capture, then replays. A step whose inputs change shape (the last, smaller batch of an
// epoch) runs eagerly and leaves the graph as it is; a step that cannot be captured (it
// synchronizes the host, say) or whose capture is refused (it keeps memory made during it)
// runs eagerly from then on, with a one-line reason on stderr, and is never captured again
// (Note [a refused capture's memory]).
//
// Note [graph-safe steps]: a captured step replays kernels, not host code. The step given to
// StepGraph must therefore, after its warm-up steps, change no host state that its kernels
// depend on: no host value baked into a kernel argument that later changes (a plain
// optimizer's learning rate: call invalidate() when it changes, and the next step captures
// again; a plain Adam's step count changes at every step; a capturable optimizer keeps both in
// device memory, where the replays read them: Note [capturable optimizer steps] in
// nn/optim/optimizer.h), no tensors created and kept (a capture that leaves memory allocated
// during it in use is refused with an error), no host reads of device values (they
// synchronize: capture fails, eager from then).
// What it writes for the caller goes into tensors it owns, created before the capture, or
// into fixed tensors (below).
//
// Note [a refused capture's memory]: memory a tensor gets during a capture is a graph
// allocation, which exists only while the graph runs. A capture whose work leaves such a
// tensor alive (state made lazily inside the step, an output kept) is refused; before that
// the block is made ordinary memory (the graph is launched once with all its work switched off:
// only its allocation nodes run) and zeroed, so the tensor is as if made by zeros() outside
// the capture, and freed as usual when it goes. None of the captured work ran: a StepGraph
// then runs the batch's step eagerly and every later one too -- a second capture would find
// the lazily made state already there, be accepted, and replay on zeros that no step computed
// (warm up instead: Note [graph-safe steps]). When the capture failed outright (a CudaError,
// an exception inside the step) there is no graph to launch: what a tensor kept from it never
// existed (unbacked_bytes()), and StepGraph throws an Error rather than run a step on it.
//
// Note [fixed tensors of a step]: the inputs of a step are copied into the graph's buffers
// before each replay (on a GPU by the graph's own first nodes: Note [input copies inside the
// graph]); tensors that the step reads or writes in place -- the dataset it
// gathers its batch from, the sums it adds its loss to -- are passed as `fixed` instead:
// never copied, handed to the step after the inputs, and kept alive by the graph (its
// kernels hold their addresses). A graph replays only with the very tensors it was captured
// with (the same memory, shape, strides and dtype): other fixed tensors capture it again, so
// a new dataset or a new sum is never silently ignored.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace tandem {

class CaptureMemory;

class CUDAGraph {
 public:
  CUDAGraph() = default;
  virtual ~CUDAGraph();
  CUDAGraph(const CUDAGraph&) = delete;
  CUDAGraph& operator=(const CUDAGraph&) = delete;

  // The methods are virtual only so that a test can hand StepGraph a stand-in that drives its
  // state machine on the CPU; tandem has one implementation.
  //
  // Whether work on `device` can be captured: CUDA devices.
  virtual bool can_capture(Device device) const { return device.is_cuda(); }
  // Starts capturing what this thread enqueues on the current stream of `device` (a CUDA
  // device; DeviceError otherwise, and in a build without CUDA). Replaces a previous graph.
  virtual void capture_begin(Device device);
  // Ends the capture and instantiates the graph. Throws CudaError when the capture failed (an
  // operation that cannot be captured was enqueued) and Error when memory allocated during
  // the capture is still held by a tensor (Note [graph-safe steps]); the graph is empty then.
  // Such a tensor is not left on memory that does not exist: its block becomes ordinary,
  // zeroed memory and none of the captured work runs (Note [a refused capture's memory]) --
  // unless the graph holds work that cannot be switched off (see unbacked_bytes()).
  virtual void capture_end();
  // Ends a capture without keeping it (after an exception inside the captured code).
  virtual void capture_abort() noexcept;
  // Launches the graph on the stream it was captured on. ValueError when nothing is captured.
  virtual void replay() const;

  // Note [input copies inside the graph]: a step's inputs are copied into the graph's buffers
  // before every replay. Copied by a separate operation, each is one more launch between two
  // replays (LeNet: a 2 KB copy of the batch's rows, ~1.3 us plus a gap, every step); captured
  // as the graph's first nodes, the copy is a node like the others, and only where it reads
  // from changes: before each replay the executable graph's copy node is pointed at the new
  // source (cudaGraphExecMemcpyNodeSetParams1D: host work, no launch).
  //
  // Whether copies into the inputs can be captured on `device` (CUDA devices).
  virtual bool copies_inside(Device device) const { return device.is_cuda(); }
  // After capture_end: finds the captured copy of `bytes` bytes into each address of `dsts`,
  // one copy node each. True when all were found; then replay_from() launches with them.
  virtual bool bind_copies(const std::vector<std::pair<void*, size_t>>& dsts);
  // Points the bound copies at `sources` (device addresses of the bytes each copies, in the
  // order of bind_copies) and launches the graph. ValueError when the counts differ.
  virtual void replay_from(const std::vector<const void*>& sources);
  // Drops the graph (and the memory it kept alive).
  virtual void reset() noexcept;

  virtual bool captured() const { return exec_ != nullptr; }
  bool capturing() const { return capturing_; }
  virtual size_t num_nodes() const { return num_nodes_; }
  // Bytes that tensors made during the last capture still hold although that memory never
  // existed: the capture failed (capture_abort, or a CudaError from capture_end), or was
  // refused with work that cannot be switched off, so its allocations were never made real. Such a tensor must not be used (it is an illegal address
  // on the device); dropping it is harmless. 0 after a successful or a refused capture.
  virtual size_t unbacked_bytes() const { return unbacked_bytes_; }

 private:
  Device device_{};
  void* stream_ = nullptr;  // cudaStream_t
  void* exec_ = nullptr;    // cudaGraphExec_t
  void* graph_ = nullptr;   // cudaGraph_t it was made from (bound copies name its nodes)
  struct BoundCopy {
    void* node;  // cudaGraphNode_t
    void* dst;
    size_t bytes;
  };
  std::vector<BoundCopy> copies_;
  bool capturing_ = false;
  size_t num_nodes_ = 0;
  size_t unbacked_bytes_ = 0;
  std::shared_ptr<CaptureMemory> memory_;
};

// True while the current stream of `device` is being captured by this thread.
bool is_current_stream_capturing(Device device);

// A fork of `main` (Note [weight gradients on a second stream] in autograd/grad_stream.h uses
// one): `side` waits for everything enqueued on main so far (`fork`, recorded on main), and
// when main is being captured into a graph, side's work joins that capture, its allocations
// the capture's (capture_memory_join in core/allocator.h). Join back before the capture ends
// (and before main reads what side writes): an event recorded on side that main waits for.
// Nothing to do on CPU streams.
void fork_stream(const Stream& main, const Stream& side, Event& fork);

class StepGraph {
 public:
  // step(args) runs one training step (Note [graph-safe steps]); args are the inputs, then the
  // fixed tensors, of operator().
  using StepFn = std::function<void(const std::vector<Tensor>& inputs)>;
  struct Options {
    int warmup_steps = 2;  // eager steps before the capture
    bool enabled = true;   // false: every step eager
  };
  explicit StepGraph(StepFn step) : StepGraph(std::move(step), Options{}) {}
  StepGraph(StepFn step, Options options);
  // With another capture than CUDAGraph's own (a test's stand-in).
  StepGraph(StepFn step, Options options, std::unique_ptr<CUDAGraph> graph);

  // One step on `inputs` (and `fixed`: Note [fixed tensors of a step]): eagerly on a CPU
  // device, during warm-up, when disabled and when the inputs' shapes, dtypes or device differ
  // from the captured ones; else by copying them into the graph's input buffers and replaying
  // (after capturing again when `fixed` are not the captured tensors). Work is enqueued on the
  // current stream only: no host synchronization. A failed or refused capture disables the
  // graph and runs the step eagerly; Error when the step keeps memory that a failed capture
  // never made (Note [a refused capture's memory]).
  void operator()(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed = {});

  // The next step captures again (a value captured into a kernel argument has changed).
  void invalidate() noexcept;
  // Every later step runs eagerly; `reason` is kept for eager_reason().
  void disable(std::string reason);

  bool replaying() const { return graph_->captured() && !disabled_; }
  // Why steps run eagerly (empty while the graph is used or still warming up).
  const std::string& eager_reason() const { return reason_; }
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  int64_t eager_steps() const { return eager_; }
  size_t num_nodes() const { return graph_->num_nodes(); }
  // Whether the captured graph copies the inputs itself (Note [input copies inside the graph]).
  bool copies_inside() const { return copies_inside_ && replaying(); }

 private:
  bool matches(const std::vector<Tensor>& inputs) const;
  bool same_fixed(const std::vector<Tensor>& fixed) const;
  void capture(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed);
  void replay(const std::vector<Tensor>& inputs);
  void run_eagerly(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed);

  StepFn step_;
  Options options_;
  int warmup_left_;
  bool disabled_ = false;
  std::string reason_;
  std::unique_ptr<CUDAGraph> graph_;
  std::vector<Tensor> static_inputs_;
  std::vector<Tensor> fixed_;  // the fixed tensors of the capture
  bool copies_inside_ = false;  // Note [input copies inside the graph]
  int64_t captures_ = 0, replays_ = 0, eager_ = 0;
};

}  // namespace tandem
