#pragma once
// One rank of a data-parallel job, whatever keeps the model's state: DDP (steppers.cpp), or ZeRO
// and FSDP (zero_stepper.cpp). What they share is here: the rank's DistributedSampler shard of
// each global batch, the loss weighted for uneven shards, the stand-in step of a rank whose shard
// is empty, sums over the ranks, rank 0's buffers for evaluation, and the merged timeline. A
// subclass says how to zero the gradients, run forward and step the optimizer.
#include <memory>
#include <string>

#include "common/stepper.h"
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
  // cfg.group must be set, on cfg.devices.front().
  explicit RankStepper(const TrainConfig& cfg);

  std::shared_ptr<data::DistributedSampler> sampler(int64_t n, bool train) override;
  void step(const data::TensorDataset& data, const Tensor& index, int64_t global_rows,
            const Tensor& loss_sum, const Tensor& correct) override;
  void sum_across_processes(const Tensor& t) override;
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

  std::shared_ptr<parallel::distributed::ProcessGroup> group_;

 private:
  void empty_step();

  uint64_t seed_;
  Tensor last_x_, last_y_;  // this rank's previous batch (Note [an empty shard])
  std::unique_ptr<parallel::Trace> trace_;
  int64_t traced_steps_ = 0;
};

// --zero 1|2|3 (zero_stepper.cpp): ZeRO stage 1 beside DDP, stage 2 on the bare module, or FSDP.
std::unique_ptr<Stepper> make_zero_stepper(const TrainConfig& cfg);

}  // namespace tandem::examples
