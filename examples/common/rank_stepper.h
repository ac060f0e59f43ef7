#pragma once
// One rank of a data-parallel job, whatever keeps the model's state: DDP (steppers.cpp), or ZeRO
// and FSDP (zero_stepper.cpp). What they share is here: the rank's DistributedSampler shard of
// each global batch, the loss weighted for uneven shards, the stand-in step of a rank whose shard
// is empty, sums over the ranks, rank 0's buffers for evaluation, and the merged timeline. A
// subclass says how to zero the gradients, run forward and step the optimizer.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "common/stepper.h"
#include "core/cuda_graph.h"
#include "parallel/distributed/ddp.h"
#include "parallel/distributed/process_group.h"
#include "parallel/trace.h"

namespace tandem::examples {

// The program's model, in the memory format the flags ask for (Note [memory formats] in
// core/tensor.h): set before the model is moved, replicated, coalesced or sharded, which all
// keep it.
std::shared_ptr<nn::Module> build_model(const TrainConfig& cfg);
// DDP's options from the flags (bucket size, overlap).
parallel::distributed::DistributedDataParallelOptions ddp_options(const TrainConfig& cfg);

class RankStepper : public Stepper {
 public:
  // cfg.group must be set, on cfg.devices.front(). `graphable`: the subclass's step can be
  // captured (Note [a CUDA graph per DDP rank]); it then makes its optimizer capturable when
  // graphed() is true.
  explicit RankStepper(const TrainConfig& cfg, bool graphable = false);
  // The step is captured into a CUDA graph and replayed (on a GPU, with --cuda-graph, untraced).
  bool graphed() const { return graphed_; }

  std::shared_ptr<data::DistributedSampler> sampler(int64_t n, bool train) override;
  void step(const data::TensorDataset& data, const Tensor& index, int64_t global_rows,
            const Tensor& loss_sum, const Tensor& correct) override;
  void sum_across_processes(const Tensor& t) override;
  // Note [the loss window inside the step] (train.cpp): appended at the end of every step, the
  // stand-in of an empty shard's too.
  bool append_loss_sums(const Tensor& log, const Tensor& cursor) override {
    loss_log_.set(log, cursor);
    return true;
  }
  // The captured optimizer state may have been replaced: the next step captures again.
  void after_load() override { graph_.invalidate(); }
  void write_trace(const std::string& path) override;
  // Rank 0's buffers on every rank (BatchNorm statistics: each rank's own since its last
  // forward), then module(): all ranks evaluate the model one process would.
  nn::Module& eval_model() override;

 protected:
  // The module whose parameters and buffers train (DDP's wrapped one, the bare one, FSDP's).
  virtual nn::Module& module() = 0;
  virtual void zero_grad() = 0;
  virtual Tensor forward(const Tensor& x) = 0;
  virtual void optimizer_step() = 0;
  // After every step's optimizer step (the ZeRO stepper prints its memory line after the first).
  virtual void after_step() {}
  void broadcast_buffers();
  // Under --precision bf16, the steps' bfloat16 weights from one cast a step, when a subclass
  // sets it (make_autocast_weights).
  std::optional<AutocastWeights> autocast_weights_;

  std::shared_ptr<parallel::distributed::ProcessGroup> group_;

 private:
  void train_step(const Tensor& index, const data::TensorDataset& data, const Tensor& loss_sum,
                  const Tensor& correct, const Tensor& scale);
  void empty_step(const data::TensorDataset& data, const Tensor& loss_sum);

  uint64_t seed_;
  bool graphed_;
  Tensor last_index_;  // this rank's previous batch (Note [an empty shard])
  Tensor scale_;       // this step's loss scale, on the device (Note [a CUDA graph per DDP rank])
  double scale_value_ = -1;  // what scale_ holds (a fill only when it changes: one launch fewer between replays)
  LossLog loss_log_;
  std::unique_ptr<parallel::Trace> trace_;
  parallel::Trace* trace_now_ = nullptr;  // the trace while this step is traced
  int64_t traced_steps_ = 0;
  StepGraph graph_;
};

// --zero 1|2|3 (zero_stepper.cpp): ZeRO stage 1 beside DDP, stage 2 on the bare module, or FSDP.
std::unique_ptr<Stepper> make_zero_stepper(const TrainConfig& cfg);

}  // namespace tandem::examples
