#pragma once
// The in-process pipeline executor: stages on devices of one process, any schedule.
//
//   auto stages = pipeline::split_by_balance(*model, {6, 6}, parallel::cpu_devices(2));
//   pipeline::Pipeline pipe(stages, pipeline::schedule_1f1b(2, /*micro-batches=*/4),
//                           [](const Tensor& out, const Tensor& y) { return cross_entropy(out, y);
//                           });
//   nn::optim::SGD opt(model->parameters(), 0.1, 0.9);
//   opt.zero_grad();
//   Tensor loss = pipe.step(x, y);   // forward and backward of every micro-batch, by the schedule
//   opt.step();
//
// This is torch.distributed.pipelining's `ScheduleGPipe(stage, n_microbatches, loss_fn)
// .step(x, target=y, losses=losses)`, with every stage in this process: each stage's actions
// run on its device's persistent worker thread (DeviceWorkers), in the schedule's order, and
// stages talk only through a Boundary (Note [explicit stage boundary] in boundary.h).
//
// step() splits the batch into the schedule's M micro-batches (microbatch.h), scales micro-batch
// m's mean loss by n_m / B (Note [loss scaling for micro-batches]) and accumulates every
// micro-batch's gradient into the parameters' .grad, as one device computes the whole batch's
// mean loss; the caller zeroes gradients and steps the optimizer, as with PyTorch. BatchNorm
// sees one micro-batch at a time (microbatch.h says what that means).
//
// A failure in one stage stops the others at once (their receives are aborted) and is rethrown
// with the stage, its device and the action named, with its own error type.
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "parallel/pipeline/boundary.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/split.h"
#include "parallel/trace.h"
#include "parallel/workers.h"

namespace tandem::parallel::pipeline {

// The mean loss of one micro-batch from the last stage's output and the micro-batch's targets.
using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

struct PipelineOptions {
  // How long a stage waits for a neighbour's activation or gradient before a TimeoutError. A
  // schedule that passed check_schedule cannot deadlock; this catches a neighbour that died.
  std::chrono::milliseconds timeout{60000};
};

// What one stage did in the last step.
struct StageStats {
  // The most micro-batches whose forward had run and backward not yet: the activations the
  // stage held at once (max_in_flight of its list: P - s for 1F1B, M for GPipe).
  int max_in_flight = 0;
  // The allocator's peak on the stage's device during the step (max_allocated_bytes after a
  // reset at the start). CUDA devices only: the virtual CPU devices share one counter, so 0.
  size_t peak_bytes = 0;
};

// One stage's part of a step: its actions in order, talking to its neighbours only through
// `boundary`. Pipeline::step runs one per stage on that stage's worker thread; one process per
// stage runs the same function with a boundary over send/recv.
struct StageStep {
  int stage = 0, num_stages = 1;
  nn::Module* module = nullptr;
  Device device;
  const std::vector<Action>* actions = nullptr;
  const std::vector<Tensor>* inputs = nullptr;   // stage 0: the micro-batches' inputs
  const std::vector<Tensor>* targets = nullptr;  // last stage: the micro-batches' targets
  const std::vector<double>* weights = nullptr;  // last stage: n_m / B per micro-batch
  const LossFn* loss_fn = nullptr;               // last stage
  std::vector<Tensor>* losses = nullptr;         // last stage writes micro-batch m's mean loss
  Trace* trace = nullptr;                        // one span per action on track "pipeline"
};
// Runs step.actions; returns the stage's max_in_flight. Rethrows what an action throws (after
// nothing else); the caller aborts the boundary.
int run_stage(const StageStep& step, Boundary& boundary);

class Pipeline {
 public:
  // ValueError unless the schedule passes check_schedule and has one stage per Stage; the
  // stages' devices as check_device_list wants them.
  Pipeline(std::vector<Stage> stages, Schedule schedule, LossFn loss_fn,
           PipelineOptions options = {});

  // One step's forward and backward on (x, target), split along dim 0 into the schedule's
  // micro-batches (ValueError when the batch has fewer rows than micro-batches, ShapeError
  // when x and target differ in rows). Returns the whole batch's mean loss (sum of n_m / B
  // times micro-batch m's loss), detached, on the last stage's device; `losses`, when given,
  // receives each micro-batch's own mean loss. Needs grad mode (ValueError under NoGradGuard).
  Tensor step(const Tensor& x, const Tensor& target, std::vector<Tensor>* losses = nullptr);

  // The stages one after another on the whole batch (no micro-batches, no schedule), on the
  // calling thread: for evaluation, under NoGradGuard. The result is on the last device.
  Tensor forward(const Tensor& x);

  // Every stage's parameters, stage by stage (the model's order).
  std::vector<Tensor> parameters() const;
  const std::vector<Stage>& stages() const { return stages_; }
  const Schedule& schedule() const { return schedule_; }
  // Per stage, of the last step.
  const std::vector<StageStats>& stats() const { return stats_; }
  // Records one span per action ("F3", "B3") on each stage's device, track "pipeline", in
  // `trace` (whose devices include the stages'); null stops it.
  void set_trace(Trace* trace) { trace_ = trace; }

 private:
  std::vector<Stage> stages_;
  std::vector<Device> devices_;
  Schedule schedule_;
  LossFn loss_fn_;
  PipelineOptions options_;
  std::unique_ptr<DeviceWorkers> workers_;
  std::unique_ptr<LocalBoundary> boundary_;
  std::vector<StageStats> stats_;
  Trace* trace_ = nullptr;
};

}  // namespace tandem::parallel::pipeline
