#pragma once
// One training step, four ways (all in steppers.cpp): on one device, the from-scratch
// data-parallel path (parallel::ScratchTrainer) or DataParallel over the devices of this
// process, or one process of a multi-process job through DistributedDataParallel -- or, with
// --zero, with its state sharded (zero_stepper.cpp). The driver in train.cpp does not care which.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "common/train.h"
#include "core/tensor.h"
#include "data/dataset.h"
#include "data/distributed_sampler.h"
#include "nn/container.h"
#include "nn/module.h"
#include "nn/optim/optimizer.h"
#include "nn/serialize_checkpoint.h"

namespace tandem::examples {

// The evaluation model of a stepper that splits the model (pipeline stages, tensor-parallel
// shards, FSDP units): a module whose forward is fn. `child`, when given, is registered as its
// module "module", so that eval() and train() reach the layers fn runs. It cannot be cloned.
class FunctionModule final : public nn::Module {
 public:
  FunctionModule(std::string name, std::function<Tensor(const Tensor&)> fn,
                 std::shared_ptr<nn::Module> child = nullptr);
  std::shared_ptr<nn::Module> clone() const override;
  std::string name() const override { return name_; }

 protected:
  Tensor forward_impl(const Tensor& x) override { return fn_(x); }

 private:
  std::string name_;
  std::function<Tensor(const Tensor&)> fn_;
};

// The driver's loss log and cursor as a stepper that appends to them itself holds them (Note
// [the loss window inside the step] in train.cpp; Stepper::append_loss_sums).
class LossLog {
 public:
  void set(const Tensor& log, const Tensor& cursor);
  bool on() const { return log_.defined(); }
  // log[cursor] += loss_sum, then ++cursor, on the current stream (graph-safe); nothing when off.
  void append(const Tensor& loss_sum) const;
  // The step's fixed tensors (Note [fixed tensors of a step] in core/cuda_graph.h) with the log
  // and the cursor added when on: their addresses are in a captured step.
  std::vector<Tensor> with(std::vector<Tensor> fixed) const;

 private:
  Tensor log_, cursor_, one_;
};

class Stepper {
 public:
  virtual ~Stepper() = default;

  // The part of a dataset of n samples that this process reads: null (the default) for all of
  // it; one rank of a job returns its DistributedSampler -- shuffled with the run's seed and
  // padded for training, in order and unpadded for evaluation (every test image counted once
  // over the ranks). The driver calls set_epoch(epoch - 1) on the training one every epoch.
  virtual std::shared_ptr<data::DistributedSampler> sampler(int64_t n, bool train) {
    return nullptr;
  }

  // One optimizer step on the rows `index` (int64, on the first device) of `data` (there too):
  // the global batch, or this rank's shard of a global batch of global_rows rows (index may
  // then have 0 rows, in the last batch). The stepper gathers the batch itself (data.get(index),
  // or inside its CUDA graph). Adds the summed loss of the batch's rows into loss_sum ([]
  // float32) and their number of right answers into correct ([1] int64), both on the first
  // device, without synchronizing the host; the driver keeps both tensors for the whole run
  // (zeroed every epoch), so a graph may add to them in place. A stepper may instead keep the
  // counts on its own devices and add them in collect_metrics().
  virtual void step(const data::TensorDataset& data, const Tensor& index, int64_t global_rows,
                    const Tensor& loss_sum, const Tensor& correct) = 0;
  // Adds the right answers counted elsewhere since the last call into `correct`; the driver
  // calls it before it reads `correct` (at the end of an epoch, before a checkpoint).
  virtual void collect_metrics(const Tensor& correct) {}
  // Note [the loss window inside the step] (train.cpp): the driver keeps the running loss sum of
  // every step since its last check in `log` ([S] float64, zeros after each check, on the first
  // device) at `cursor` ([1] int64 there, the number of steps since the check). A stepper that
  // returns true appends it itself at the end of every step -- log[cursor] += loss_sum, then
  // ++cursor -- where the step is replayed from a CUDA graph, inside the graph, and the driver
  // launches nothing for it between steps. The default: false, the driver appends.
  virtual bool append_loss_sums(const Tensor& log, const Tensor& cursor) { return false; }

  // The training state a checkpoint holds: the model (replica 0, on the first device) and its
  // optimizer. After loading values into them, the driver calls after_load(), which brings the
  // other replicas of this process in line (their parameters, buffers and optimizer state).
  virtual nn::Module& model() = 0;
  virtual nn::optim::Optimizer& optimizer() = 0;
  virtual void after_load() {}

  // What a checkpoint holds of the model and its optimizer: ckpt.model and ckpt.optimizer,
  // whole, in a plain optimizer's layout (Note [training checkpoint names]), filled on the
  // process that writes the file (reports()); every rank of a job calls it at the same point (a
  // sharded stepper gathers there). Default: model() and optimizer()'s state dicts.
  virtual void capture_state(nn::TrainingCheckpoint& ckpt);
  // The other way, on every rank, from the whole file: default nn::load_training_state into
  // model() and optimizer(), then after_load(). `source` starts the messages.
  virtual void load_state(const nn::TrainingCheckpoint& ckpt, const std::string& source);
  // The name of the first weight that holds a NaN or an Inf, "" when none (the check before a
  // checkpoint); every rank of a job calls it at the same point. Default: model()'s.
  virtual std::string first_non_finite_weight();

  // Sums t (contiguous, on the first device) over the processes of the job, in place; a no-op
  // for a process that trains alone. Every rank calls it at the same points.
  virtual void sum_across_processes(const Tensor& t) {}

  // Sets the learning rate of the optimizer(s) for the following steps.
  virtual void set_lr(double lr) = 0;
  // The model to evaluate (on the first device). Called once per evaluation, on every rank of a
  // job at the same point: the DDP stepper then gives every rank rank 0's buffers (BatchNorm
  // statistics), so all ranks evaluate the same model.
  virtual nn::Module& eval_model() = 0;
  // Writes the timeline of the steps recorded so far (Chrome trace JSON); a no-op when the
  // stepper records none.
  virtual void write_trace(const std::string& path) {}
};

// The stepper for cfg: DDP when cfg.group is set (on cfg.devices.front(), which must be the
// group's device; ZeRO or FSDP with cfg.zero), else one device, or cfg.parallel ("scratch" or "dp") over cfg.devices.
std::unique_ptr<Stepper> make_stepper(const TrainConfig& cfg);
// cfg.parallel == "pipeline": the model's stages on cfg.devices (one process), or this rank's
// stage of cfg.group's pipeline (pipeline_stepper.cpp).
std::unique_ptr<Stepper> make_pipeline_stepper(const TrainConfig& cfg);
// --balance parameters|time (cfg.balance_by): the layers of each of cfg's stages -- the devices
// of this process, or the processes of cfg.group -- chosen on one process and the same on every
// rank (Note [one balance for every rank], pipeline_stepper.cpp). Every rank of a job calls it.
std::vector<int64_t> choose_pipeline_balance(const TrainConfig& cfg);
// cfg.parallel == "tensor": the model's first Linear -> activation -> Linear split over
// cfg.devices (tensor_stepper.cpp).
std::unique_ptr<Stepper> make_tensor_parallel_stepper(const TrainConfig& cfg);
// Where that split starts in `model` for num_devices devices (the first Linear's index), or -1
// when the model has no such layers with at least num_devices features between them.
int64_t tensor_parallel_split_point(const nn::SequentialImpl& model, int64_t num_devices);

// cfg.optimizer ("sgd" or "adam") over params with cfg's lr, momentum and weight decay;
// capturable for a step replayed from a CUDA graph (Note [capturable optimizer steps]).
std::unique_ptr<nn::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                     std::vector<Tensor> params,
                                                     bool capturable = false);

// Under --precision bf16, one bfloat16 copy of params refreshed by one cast a step, when params
// fit (Note [autocast weight copies] in autograd/autocast.h); otherwise none.
std::optional<AutocastWeights> make_autocast_weights(const TrainConfig& cfg, const std::vector<Tensor>& params);

}  // namespace tandem::examples
