#pragma once
// ScratchTrainer: data-parallel training written out step by step, the way d2l's "Training
// on Multiple GPUs" chapter builds it from scratch, with each stage a piece of parallel/:
//
//   1. split_sizes + scatter  cut the global batch into shards, one per device
//   2. replicate              one model copy per device, made once (Note [why replicas are
//                             not re-copied])
//   3. parallel_apply         forward + backward of every replica at once, one host thread,
//                             device and stream each, gradients landing in a FlatBuffer
//   4. allreduce_sum          one collective over the flat gradient buffers
//   5. step                   every replica applies its own optimizer to the same summed
//                             gradient, which keeps the replicas identical
//
// BatchNorm: every replica normalizes with its own shard's statistics and keeps its own
// running statistics; module() (replica 0) holds those of shard 0 (as DistributedDataParallel
// with broadcast_buffers would hand to every rank at the next step).
//
// Nothing in a step synchronizes the host: the loss comes back as a device tensor and the
// accuracy counts accumulate on the device; read them when you need the numbers.
//
// Note [a CUDA graph per replica]: with set_cuda_graph(true) on GPUs, stages 3-5 of a step are
// captured once per device -- each worker thread captures its replica's forward, backward
// and optimizer step on its own stream, and NCCL's allreduce, called between the two halves,
// is captured into every device's graph -- and later steps copy the shards into the graphs'
// input buffers and launch one graph per device (NCCL's kernels in the graphs meet as they
// would eagerly). As StepGraph (core/cuda_graph.h) does for one device: two eager warm-up
// steps first; a batch of other shard sizes (the short last batch) runs eagerly and keeps the
// graphs; a capture that fails turns the graphs off with a one-line reason and the step runs
// eagerly. Graphs need the "nccl" communicator (the naive and ring ones order their copies
// between devices with events across streams, which per-device captures cannot hold) and
// capturable optimizers (a new learning rate must reach the replays: Note [capturable
// optimizer steps]); otherwise, and while a trace records, steps run eagerly, and
// graph_eager_reason() says why.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_graph.h"
#include "nn/module.h"
#include "nn/optim/optimizer.h"
#include "parallel/comm.h"
#include "parallel/flat_buffer.h"
#include "parallel/replicate.h"
#include "parallel/trace.h"
#include "parallel/workers.h"

namespace tandem::parallel {

// Builds an optimizer over one replica's parameters, e.g.
//   [](std::vector<Tensor> ps) { return std::make_unique<nn::optim::SGD>(std::move(ps), 0.1); }
using OptimizerFactory =
    std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<Tensor> params)>;

class ScratchTrainer {
 public:
  // `module` becomes replica 0 (moved to devices[0]); comm_name is "naive", "ring" or "nccl".
  // Each replica's parameters are coalesced into one flat tensor (parallel::coalesce; the
  // tensors keep their identity), so its optimizer takes one fused step.
  // The trainable parameters must all be of one dtype (one flat gradient buffer per device).
  ScratchTrainer(std::shared_ptr<nn::Module> module, std::vector<Device> devices,
                 const std::string& comm_name, const OptimizerFactory& make_optimizer);

  // One training step on the global batch: x [B, ...] and int64 labels y [B], on any device.
  // Returns the mean cross-entropy over the B rows, on devices()[0], without host sync.
  // Replica r scales its shard's mean loss by b_r / B, so the allreduce *sum* of the
  // gradients is the gradient of the global-batch mean, also for uneven shards (Note [loss
  // scaling for uneven shards] in trainer.cpp).
  // A batch of B < devices().size() rows runs on the first B devices, one row each; the others
  // add zero gradients and take the same step (Note [batches smaller than the device count]).
  // ValueError for an empty batch, ShapeError when x and y disagree in B.
  Tensor train_batch(const Tensor& x, const Tensor& y);

  // Rows predicted correctly by train_batch since reset_metrics(): int64 [1] on devices()[0].
  Tensor correct() const;
  int64_t examples() const { return examples_; }  // rows seen since reset_metrics()
  void reset_metrics();

  // Records per-device spans (forward+backward, allreduce, optimizer) into `trace` from now
  // on; nullptr stops. The trace must cover devices() and outlive its use here.
  void set_trace(Trace* trace) { trace_ = trace; }

  // Note [a CUDA graph per replica]. Off by default; CPU devices always run eagerly.
  void set_cuda_graph(bool on);
  // The next graphable step captures again (the optimizers' state tensors were replaced, say).
  void invalidate_cuda_graph() noexcept;
  // Why steps run eagerly although set_cuda_graph(true) was asked (empty otherwise).
  const std::string& graph_eager_reason() const { return graph_reason_; }
  int64_t graph_captures() const { return graph_captures_; }
  int64_t graph_replays() const { return graph_replays_; }

  nn::Module& module() { return *replicas_[0]; }
  const Replicas& replicas() const { return replicas_; }
  const std::vector<Device>& devices() const { return devices_; }
  Communicator& communicator() { return *comm_; }
  DeviceWorkers& workers() { return workers_; }
  nn::optim::Optimizer& optimizer(size_t rank) { return *optimizers_.at(rank); }
  const FlatBuffer& grads(size_t rank) const { return grads_.at(rank); }

 private:
  std::vector<Device> devices_;
  DeviceWorkers workers_;
  Replicas replicas_;
  std::unique_ptr<Communicator> comm_;
  std::vector<FlatBuffer> grads_;  // per device: every parameter's .grad is a view into it
  std::vector<std::unique_ptr<nn::optim::Optimizer>> optimizers_;  // per device
  std::vector<Tensor> correct_;  // per device: int64 [1]
  int64_t examples_ = 0;
  Trace* trace_ = nullptr;

  // Replica r's forward and backward on its shard (undefined: no rows, a zero gradient), the
  // gradients into grads_[r]; returns the loss weighted by `weight`, detached.
  Tensor forward_backward(size_t r, const Tensor& x, const Tensor& y, double weight);
  void allreduce_gradients();  // stage 4
  // Stages 3-5 eagerly, or from the graphs; the replicas' weighted losses.
  std::vector<Tensor> eager_step(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                                 const std::vector<double>& weights);
  std::vector<Tensor> graphed_step(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                                   const std::vector<double>& weights);
  bool capture(const std::vector<double>& weights);  // false: the graphs are off now
  bool graph_matches(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) const;
  void graphs_off(std::string reason);

  // Note [a CUDA graph per replica]
  bool graph_on_ = false;
  int graph_warmup_left_ = 2;
  std::string graph_reason_;
  std::vector<std::unique_ptr<CUDAGraph>> graphs_;  // per device
  std::vector<Tensor> graph_x_, graph_y_, graph_loss_;  // per device: the graphs' buffers
  int64_t graph_captures_ = 0, graph_replays_ = 0;
};

}  // namespace tandem::parallel
