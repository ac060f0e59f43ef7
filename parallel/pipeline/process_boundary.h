#pragma once
// One process per stage: the Boundary over a process group's send/recv, and the per-process
// executor around run_stage (torch.distributed.pipelining's PipelineStage plus a schedule's
// step(), on one rank).
//
//   auto ctx = distributed::init_process_group("gloo", kCPU);        // under tandem-run
//   auto stage = pipeline::stage_of_balance(*model, {7, 5}, ctx.group->rank(), kCPU);
//   pipeline::ProcessPipeline pipe(stage, pipeline::schedule_1f1b(2, 4), loss_fn, ctx.group);
//   Tensor loss = pipe.step(x, y);   // every rank passes the same batch; stage 0 reads x, the
//                                    // last stage y; the loss comes back on every rank
//
// Stage s is rank s of the group (a group of exactly P ranks). The schedules and run_stage
// are the in-process ones (pipeline.h): only the boundary differs.
//
// Note [process boundary messages]
// Every activation or gradient travels as two point-to-point messages to the neighbour: a
// header of kHeaderSize int64 (what: activation or gradient, the micro-batch, the dtype, the
// rank and dims), then the payload, allocated by the receiver from the header. The group pairs
// the k-th send from a to b with the k-th recv of b from a (process_group.cpp), and between
// two neighbours activations flow one way and gradients the other, each in the schedule's
// micro-batch order, so the header a receiver gets is the one it expects; one that is not (a
// schedule that differs between ranks, a gradient whose shape is not that of the activation
// sent) is a ValueError naming both sides instead of garbage. Sends do not wait: a stage
// that waited for its send to be received could deadlock with a neighbour that is itself
// sending (1F1B's steady state); a sent tensor is kept until a later receive proves that the
// neighbour has it (Note [sent tensors are released]), and finish() waits for the rest at the
// end of the step. Every receive waits at most the group's timeout, and a neighbour that
// died fails it through the group (its monitor names the rank).
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "parallel/distributed/process_group.h"
#include "parallel/pipeline/pipeline.h"

namespace tandem::parallel::pipeline {

class ProcessBoundary : public Boundary {
 public:
  static constexpr int kMaxDims = 8;
  static constexpr int kHeaderSize = 4 + kMaxDims;  // Note [process boundary messages]

  // Stage s is rank s of `group`. Tensors travel on the group's device (the CPU for Gloo,
  // the rank's GPU for NCCL) and are moved to the stage's device on receipt.
  explicit ProcessBoundary(std::shared_ptr<distributed::ProcessGroup> group);

  void send_activation(int stage, int micro_batch, const Tensor& output) override;
  Tensor recv_activation(int stage, int micro_batch, Device device) override;
  void send_grad(int stage, int micro_batch, const Tensor& input_grad) override;
  Tensor recv_grad(int stage, int micro_batch, Device device) override;
  // Later receives throw at once (the stage's own failure; the neighbours learn of it through
  // the group or the launcher).
  void abort(const std::string& why) override;
  // The schedule every rank runs, which lets a receive release the sends it proves received
  // (Note [sent tensors are released]); null (the default): every send is kept until finish().
  // It must outlive its use here.
  void set_schedule(const Schedule* schedule) { schedule_ = schedule; }
  // Sends not yet known to be received (their tensors held).
  size_t pending_sends() const { return pending_.size(); }
  // Waits for every send since the last call (rethrowing a failed one) and forgets the shapes
  // of the activations sent. The end of a step.
  void finish();

 private:
  enum What { kActivation = 0, kGrad = 1 };
  void send(What what, int to, int micro_batch, const Tensor& t);
  // Where stage `stage` receives (or sends) micro-batch m's message of kind `what`: the index
  // in its action list of F(m) for an activation, B(m) for a gradient; -1 without a schedule.
  int position(int stage, What what, int micro_batch) const;
  // Waits for and drops the sends to `peer` that it received before its action `at`.
  void release_received(int peer, int at);
  Tensor recv(What what, int stage, int from, int micro_batch, Device device);

  std::shared_ptr<distributed::ProcessGroup> group_;
  struct Pending {
    distributed::WorkPtr work;
    Tensor keep;  // alive until the send completed
    int to = -1;
    int received_at = -1;  // position(to, ...) of the message; -1: unknown, kept until finish()
  };
  const Schedule* schedule_ = nullptr;
  std::vector<Pending> pending_;
  // The shape of micro-batch m's activation sent forward, which its gradient must have.
  std::vector<std::vector<int64_t>> sent_shape_;
  bool aborted_ = false;
  std::string abort_reason_;
};

// Stage `stage` of split_by_balance(model, balance, ...) alone, moved to `device`: what one
// process of a pipeline holds (the model's other layers stay where they are). ValueError as
// split_by_balance for a bad balance, and for a stage outside [0, balance.size()).
Stage stage_of_balance(const nn::SequentialImpl& model, const std::vector<int64_t>& balance, int stage,
                       Device device);

// This process's stage of a pipeline of group->size() processes.
class ProcessPipeline {
 public:
  // ValueError unless schedule has group->size() stages, passes check_schedule, and the stage
  // has a module on `stage.device`.
  ProcessPipeline(Stage stage, Schedule schedule, LossFn loss_fn,
                  std::shared_ptr<distributed::ProcessGroup> group);
  // The boundary reads schedule_ where it is: not copied, not moved.
  ProcessPipeline(const ProcessPipeline&) = delete;
  ProcessPipeline& operator=(const ProcessPipeline&) = delete;

  // One step on this stage: every rank passes the same (x, target) (stage 0 uses x, the last
  // stage the targets; the others only their row count), as Pipeline::step. Returns the whole
  // batch's mean loss on every rank (broadcast from the last stage), on the group's device;
  // `losses` gets every micro-batch's mean loss. Rethrows a stage's failure with the stage
  // named (the caller's process then ends, and the launcher ends the others).
  Tensor step(const Tensor& x, const Tensor& target, std::vector<Tensor>* losses = nullptr);

  // The stages one after another on the whole batch, for evaluation (under NoGradGuard):
  // the last stage's output, on every rank (broadcast), on the group's device.
  Tensor forward(const Tensor& x);

  int stage_index() const { return stage_index_; }
  const Stage& stage() const { return stage_; }
  const Schedule& schedule() const { return schedule_; }
  // The stage's max_in_flight in the last step.
  int max_in_flight() const { return max_in_flight_; }
  // One span per action on this stage's device, track "pipeline"; null stops it.
  void set_trace(Trace* trace) { trace_ = trace; }

 private:
  // Every rank gets the last stage's `t` (whose shape only the last stage knows).
  Tensor broadcast_from_last(const Tensor& t);

  Stage stage_;
  Schedule schedule_;
  LossFn loss_fn_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  int stage_index_ = 0;
  ProcessBoundary boundary_;
  int max_in_flight_ = 0;
  Trace* trace_ = nullptr;
};

}  // namespace tandem::parallel::pipeline
