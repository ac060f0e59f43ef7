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
// synchronizes the host, say) runs eagerly from then on, with a one-line reason on stderr.
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
// Note [fixed tensors of a step]: the inputs of a step are copied into the graph's buffers
// before each replay; tensors that the step reads or writes in place -- the dataset it
// gathers its batch from, the sums it adds its loss to -- are passed as `fixed` instead:
// never copied, handed to the step after the inputs, and kept alive by the graph (its
// kernels hold their addresses). A graph replays only with the very tensors it was captured
// with (the same memory, shape, strides and dtype): other fixed tensors capture it again, so
// a new dataset or a new sum is never silently ignored.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem {

class CaptureMemory;

class CUDAGraph {
 public:
  CUDAGraph() = default;
  ~CUDAGraph();
  CUDAGraph(const CUDAGraph&) = delete;
  CUDAGraph& operator=(const CUDAGraph&) = delete;

  // Starts capturing what this thread enqueues on the current stream of `device` (a CUDA
  // device; DeviceError otherwise, and in a build without CUDA). Replaces a previous graph.
  void capture_begin(Device device);
  // Ends the capture and instantiates the graph. Throws CudaError when the capture failed (an
  // operation that cannot be captured was enqueued) and Error when memory allocated during
  // the capture is still held by a tensor (Note [graph-safe steps]); the graph is empty then.
  void capture_end();
  // Ends a capture without keeping it (after an exception inside the captured code).
  void capture_abort() noexcept;
  // Launches the graph on the stream it was captured on. ValueError when nothing is captured.
  void replay() const;
  // Drops the graph (and the memory it kept alive).
  void reset() noexcept;

  bool captured() const { return exec_ != nullptr; }
  bool capturing() const { return capturing_; }
  size_t num_nodes() const { return num_nodes_; }

 private:
  Device device_{};
  void* stream_ = nullptr;  // cudaStream_t
  void* exec_ = nullptr;    // cudaGraphExec_t
  bool capturing_ = false;
  size_t num_nodes_ = 0;
  std::shared_ptr<CaptureMemory> memory_;
};

// True while the current stream of `device` is being captured by this thread.
bool is_current_stream_capturing(Device device);

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

  // One step on `inputs` (and `fixed`: Note [fixed tensors of a step]): eagerly on a CPU
  // device, during warm-up, when disabled and when the inputs' shapes, dtypes or device differ
  // from the captured ones; else by copying them into the graph's input buffers and replaying
  // (after capturing again when `fixed` are not the captured tensors). Work is enqueued on the
  // current stream only: no host synchronization.
  void operator()(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed = {});

  // The next step captures again (a value captured into a kernel argument has changed).
  void invalidate() noexcept;
  // Every later step runs eagerly; `reason` is kept for eager_reason().
  void disable(std::string reason);

  bool replaying() const { return graph_.captured() && !disabled_; }
  // Why steps run eagerly (empty while the graph is used or still warming up).
  const std::string& eager_reason() const { return reason_; }
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  int64_t eager_steps() const { return eager_; }
  size_t num_nodes() const { return graph_.num_nodes(); }

 private:
  bool matches(const std::vector<Tensor>& inputs) const;
  bool same_fixed(const std::vector<Tensor>& fixed) const;
  void capture(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed);
  void run_eagerly(const std::vector<Tensor>& inputs, const std::vector<Tensor>& fixed);

  StepFn step_;
  Options options_;
  int warmup_left_;
  bool disabled_ = false;
  std::string reason_;
  CUDAGraph graph_;
  std::vector<Tensor> static_inputs_;
  std::vector<Tensor> fixed_;  // the fixed tensors of the capture
  int64_t captures_ = 0, replays_ = 0, eager_ = 0;
};

}  // namespace tandem
