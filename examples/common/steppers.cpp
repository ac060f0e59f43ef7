// The four steppers of stepper.h, in the order make_stepper (at the end) picks them: one
// device, the from-scratch data-parallel path (ScratchTrainer), DataParallel, and one rank of
// a multi-process job (DistributedDataParallel).
#include "common/stepper.h"

#include "common/checkpoint.h"
#include "common/rank_stepper.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "core/cuda_graph.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/optim/adam.h"
#include "nn/optim/sgd.h"
#include "parallel/data_parallel.h"
#include "parallel/distributed/ddp.h"
#include "parallel/flat_buffer.h"
#include "parallel/distributed/process_group.h"
#include "parallel/replicate.h"
#include "parallel/trace.h"
#include "parallel/trainer.h"

namespace tandem::examples {

std::optional<AutocastWeights> make_autocast_weights(const TrainConfig& cfg, const std::vector<Tensor>& params) {
  if (cfg.precision != "bf16") return std::nullopt;
  return AutocastWeights::if_fits(params);
}

void LossLog::set(const Tensor& log, const Tensor& cursor) {
  log_ = log;
  cursor_ = cursor;
  one_ = ones({1}, kInt64, cursor.device());
}

void LossLog::append(const Tensor& loss_sum) const {
  if (!on()) return;
  kernels::index_add_(log_, cursor_, loss_sum.reshape({1}).to(kFloat64));
  kernels::axpby_(1.0, one_, 1.0, cursor_);
}

std::vector<Tensor> LossLog::with(std::vector<Tensor> fixed) const {
  if (on()) {
    fixed.push_back(log_);
    fixed.push_back(cursor_);
  }
  return fixed;
}

std::unique_ptr<nn::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                     std::vector<Tensor> params, bool capturable) {
  if (cfg.optimizer == "adam")
    return std::make_unique<nn::optim::Adam>(
        std::move(params),
        nn::optim::AdamOptions(cfg.lr).weight_decay(cfg.weight_decay).capturable(capturable));
  return std::make_unique<nn::optim::SGD>(std::move(params), nn::optim::SGDOptions(cfg.lr)
                                                                 .momentum(cfg.momentum)
                                                                 .weight_decay(cfg.weight_decay)
                                                                 .capturable(capturable));
}

FunctionModule::FunctionModule(std::string name, std::function<Tensor(const Tensor&)> fn,
                               std::shared_ptr<nn::Module> child)
    : name_(std::move(name)), fn_(std::move(fn)) {
  if (child) register_module("module", std::move(child));
}

std::shared_ptr<nn::Module> FunctionModule::clone() const {
  TANDEM_THROW(Value, "the evaluation module of ", name_, " cannot be cloned");
}

void Stepper::capture_state(nn::TrainingCheckpoint& ckpt) {
  ckpt.model = model().state_dict();
  ckpt.optimizer = optimizer().state_dict();
}

void Stepper::load_state(const nn::TrainingCheckpoint& ckpt, const std::string& source) {
  nn::load_training_state(ckpt, model(), optimizer(), source);
  after_load();
}

std::string Stepper::first_non_finite_weight() { return first_non_finite(model()); }

namespace {

namespace dist = parallel::distributed;

// Traces only the first few steps of the run: enough for a timeline picture, and recording
// every step of an epoch would keep thousands of events alive.
constexpr int64_t kTracedSteps = 5;

// ---- one device ------------------------------------------------------------------------------
// Note [the one-device step]: the parameters live in one buffer (parallel::coalesce) and the
// gradients are views of another (parallel::FlatBuffer), so zeroing the gradients is one fill
// and the optimizer updates the whole model with one kernel (Note [flat optimizer step]). On a
// GPU the step is then captured into a CUDA graph after two eager steps and replayed
// (core/cuda_graph.h): one launch for the ~60 kernels of a LeNet step instead of ~60. The
// graph's input is the batch's index; the gather of its rows from the dataset, the loss and
// the right answers added to the epoch's sums are inside the graph, with the dataset and the
// sums as its fixed tensors (Note [fixed tensors of a step]), so between two replays there is
// only the copy of the index. The optimizer is capturable (Note [capturable optimizer steps]
// in nn/optim/optimizer.h): the learning rate and Adam's step count live on the GPU, so a new
// learning rate is a fill between replays, not a new capture, and Adam steps are graphed like
// SGD's. Under --precision bf16 the forward reads the weights from one bfloat16 copy (Note
// [autocast weight copies] in autograd/autocast.h), which the optimizer's update writes
// (Note [the weight copy written by the update] in nn/optim/optimizer.h; weight_copy_in_update()
// on, kernels/backend.h): the step itself casts nothing. The copy is refreshed with a cast only
// when it is stale -- before the first step, and after a checkpoint is loaded (after_load) --
// eagerly in step(), before the graph runs. So no capture holds that refresh: the warm-up steps
// have made the copy current before the first capture, and after_load invalidates the graph, so
// the very step after it captures again, where a refresh would have run at every replay. Every
// replay's update then writes the copy that the next replay's forward reads. With
// weight_copy_in_update() off, every step begins with the refresh, inside the graph.
class SingleDeviceStepper final : public Stepper {
 public:
  explicit SingleDeviceStepper(const TrainConfig& cfg)
      : model_(build_model(cfg)),
        graph_([this](const std::vector<Tensor>& in) { train_step(in[0], {in[1], in[2]}, in[3], in[4]); },
               {/*warmup_steps=*/2, /*enabled=*/cfg.cuda_graph}) {
    const Device d = cfg.devices.front();
    side_stream_ = d.is_cuda() ? Stream::create(d) : current_stream(d);
    model_->to(d);
    model_->train();
    parallel::try_coalesce(model_->parameters());
    grads_ = parallel::FlatBuffer(model_->parameters());
    grads_.attach();
    // Under autocast, the model's bfloat16 weights from one cast a step (Note [autocast weight
    // copies] in autograd/autocast.h).
    autocast_weights_ = make_autocast_weights(cfg, model_->parameters());
    // Only a graph needs it: StepGraph runs CPU steps eagerly.
    opt_ = make_optimizer(cfg, model_->parameters(), /*capturable=*/cfg.cuda_graph && d.is_cuda());
    copy_in_update_ = autocast_weights_.has_value() && weight_copy_in_update();
    if (copy_in_update_) opt_->set_weight_copy(autocast_weights_->copy());
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor& correct) override {
    // Note [the one-device step]: a stale copy is refreshed here, outside the graph.
    if (copy_in_update_ && !copy_current_) {
      autocast_weights_->refresh();
      copy_current_ = true;
    }
    graph_({index}, loss_log_.with({data.images(), data.labels(), loss_sum, correct}));
  }

  // Note [the loss window inside the step] (train.cpp): appended on the side stream, beside the
  // backward, after the loss is added to the epoch's sum.
  bool append_loss_sums(const Tensor& log, const Tensor& cursor) override {
    loss_log_.set(log, cursor);
    return true;
  }

  // A capturable optimizer writes the new rate into its device tensor, which the replays read:
  // the graph stays. (Without a graph there is nothing to capture again.)
  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override { return *model_; }
  nn::Module& model() override { return *model_; }
  nn::optim::Optimizer& optimizer() override { return *opt_; }
  // A loaded checkpoint may have given the optimizer new state tensors: the graph would still
  // update the old ones, so the next step captures again. It has changed the parameters, so
  // the autocast copy is stale.
  void after_load() override {
    graph_.invalidate();
    copy_current_ = false;
  }

 private:
  // One step on the rows `index` of (images, labels), graph-safe: see Note [the one-device step].
  void train_step(const Tensor& index, const data::TensorDataset& data, const Tensor& loss_sum,
                  const Tensor& correct) {
    const Stream main = current_stream(index.device());
    // The images' gather first, on the main stream: the forward starts from it. Then, beside
    // the forward on the step's side stream, the labels' gather and the zeroing of the
    // gradients, which the step needs only at the loss and the backward. The labels' tensor is
    // made here, on the main stream, which frees it after everything that reads it, and the
    // side stream gathers straight into it.
    data::Batch b;
    const bool beside = index.size(0) > 0;
    if (beside) {
      keep_batch_buffers(data, index.size(0));
      const bool kept = batch_x_.defined() && batch_x_.size(0) == index.size(0);
      b.x = kernels::index_select(data.images(), index, kept ? batch_x_ : Tensor());
      b.y = kept ? batch_y_ : empty(rows_of(data.labels(), index.size(0)), data.labels().dtype(), data.device());
      fork_stream(main, side_stream_, side_fork_);
      {
        const StreamGuard on_side(side_stream_);
        kernels::index_select(data.labels(), index, b.y);
        grads_.zero_();
        ready_.record(side_stream_);
      }
    } else {
      b = data.get(index);
      grads_.zero_();
    }
    // Current when the update writes it: step() refreshed it if stale (Note [the one-device step]).
    const AutocastWeightsGuard weights = refresh_and_install(autocast_weights_, /*refresh=*/!copy_in_update_);
    Tensor logits = (*model_)(b.x);
    if (beside) ready_.wait(main);
    Tensor loss = cross_entropy(logits, b.y);
    // The epoch's sums need only the forward: they run beside the backward, on the side stream
    // forked again here and joined after the optimizer (the tensors they read live till then).
    fork_stream(main, side_stream_, side_fork_);
    {
      const StreamGuard on_side(side_stream_);
      kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
      loss_log_.append(loss_sum);
      kernels::count_correct(logits.detach(), b.y, correct);
      sums_done_.record(side_stream_);
    }
    // The backward's seed, d loss / d loss = 1, made once rather than filled every step.
    if (!seed_.defined() || seed_.dtype() != loss.dtype() || seed_.device() != loss.device())
      seed_ = ones({}, loss.dtype(), loss.device());
    loss.backward(seed_);
    opt_->step();  // and, when it was given it, the autocast copy of the updated parameters
    sums_done_.wait(main);
  }

  static Shape rows_of(const Tensor& t, int64_t rows) {
    Shape s = t.shape();
    s[0] = rows;
    return s;
  }

  // Note [the step's batch buffers]: the batch's images and labels are gathered into two
  // tensors made at the first step and kept, not into new ones each step: the labels' gather
  // on the side stream writes straight into its tensor (no copy node), and the graph's first
  // nodes allocate nothing. They were tried first for another reason: in a replayed LeNet step
  // the images' gather starts some 6 us after the graph's first node (the copy of the row
  // numbers). Measured since, that wait is the same into a kept tensor (docs/09), so it is not
  // the allocator's; its cause is still open. Only batches of the first batch's size use them
  // (an epoch's last, smaller batch runs eagerly on tensors of its own), so the graph's
  // addresses never change. Made outside any capture: the warm-up steps come first.
  void keep_batch_buffers(const data::TensorDataset& data, int64_t rows) {
    if (batch_x_.defined() || is_current_stream_capturing(data.device())) return;
    batch_x_ = empty(rows_of(data.images(), rows), data.images().dtype(), data.device());
    batch_y_ = empty(rows_of(data.labels(), rows), data.labels().dtype(), data.device());
  }

  std::shared_ptr<nn::Module> model_;
  parallel::FlatBuffer grads_;
  Tensor batch_x_, batch_y_;  // Note [the step's batch buffers]
  LossLog loss_log_;  // Note [the loss window inside the step]
  std::optional<AutocastWeights> autocast_weights_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  // Note [the one-device step]: whether the update writes the autocast copy, and whether the
  // copy holds the parameters as they are now (never, when the update does not write it).
  bool copy_in_update_ = false;
  bool copy_current_ = false;
  // The step's side stream on a GPU (the current stream on a CPU): the labels' gather and the
  // gradients' zeroing beside the forward, the epoch's sums beside the backward.
  Stream side_stream_;
  Event side_fork_, ready_, sums_done_;
  Tensor seed_;
  StepGraph graph_;
};

// ---- several devices of this process ---------------------------------------------------------
// The from-scratch path, with a CUDA graph per replica on GPUs (Note [a CUDA graph per
// replica] in parallel/trainer.h), its optimizers capturable for that.
bool all_cuda(const std::vector<Device>& devices) {
  return std::all_of(devices.begin(), devices.end(), [](Device d) { return d.is_cuda(); });
}

class ScratchStepper final : public Stepper {
 public:
  explicit ScratchStepper(const TrainConfig& cfg)
      : trainer_(build_model(cfg), cfg.devices, cfg.comm, [cfg](std::vector<Tensor> ps) {
          return make_optimizer(cfg, std::move(ps), /*capturable=*/cfg.cuda_graph && all_cuda(cfg.devices));
        }) {
    trainer_.module().train();
    trainer_.set_cuda_graph(cfg.cuda_graph && all_cuda(cfg.devices));
    if (!cfg.trace.empty()) {
      trace_ = std::make_unique<parallel::Trace>(cfg.devices);
      trainer_.set_trace(trace_.get());
    }
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor& correct) override {
    if (trace_ && steps_ == kTracedSteps) trainer_.set_trace(nullptr);
    ++steps_;
    const data::Batch b = data.get(index);
    Tensor loss = trainer_.train_batch(b.x, b.y);
    kernels::axpby_(static_cast<double>(b.x.size(0)), loss, 1.0, loss_sum);
  }

  // Each replica counts its right answers on its own device during the epoch; they are
  // gathered once here rather than with cross-device copies every step.
  void collect_metrics(const Tensor& correct) override {
    kernels::axpby_(1.0, trainer_.correct(), 1.0, correct);
    trainer_.reset_metrics();
  }

  void set_lr(double lr) override {
    for (size_t r = 0; r < trainer_.devices().size(); ++r) trainer_.optimizer(r).set_lr(lr);
  }
  nn::Module& eval_model() override { return trainer_.module(); }
  nn::Module& model() override { return trainer_.module(); }
  nn::optim::Optimizer& optimizer() override { return trainer_.optimizer(0); }
  // Replica 0 holds what was loaded: its parameters and buffers go to the other replicas, its
  // optimizer state (copied onto each replica's device) to their optimizers. BatchNorm's
  // running statistics are then replica 0's on every replica (a checkpoint keeps only them).
  // The graphs captured the old state tensors: the next step captures again.
  void after_load() override {
    parallel::broadcast_parameters(trainer_.replicas());
    const nn::StateDict state = trainer_.optimizer(0).state_dict();
    for (size_t r = 1; r < trainer_.devices().size(); ++r) trainer_.optimizer(r).load_state_dict(state);
    trainer_.invalidate_cuda_graph();
  }

  void write_trace(const std::string& path) override {
    if (trace_) trace_->write(path);
  }

 private:
  parallel::ScratchTrainer trainer_;
  std::unique_ptr<parallel::Trace> trace_;
  int64_t steps_ = 0;
};

class DataParallelStepper final : public Stepper {
 public:
  explicit DataParallelStepper(const TrainConfig& cfg) : dp_(build_model(cfg), cfg.devices) {
    dp_.train();
    opt_ = make_optimizer(cfg, dp_.parameters());
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor& correct) override {
    const data::Batch b = data.get(index);
    opt_->zero_grad();
    Tensor logits = dp_(b.x);
    Tensor loss = cross_entropy(logits, b.y);
    loss.backward();
    opt_->step();
    kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), b.y, correct);
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override { return dp_.module(); }
  nn::Module& model() override { return dp_.module(); }  // replicas are copied from it every forward
  nn::optim::Optimizer& optimizer() override { return *opt_; }

 private:
  parallel::DataParallel dp_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
};

// ---- one rank of a multi-process job ---------------------------------------------------------
// DDP moves the model to the group's device (the training device), broadcasts rank 0's
// weights and reduces the gradients while backward runs (parallel/distributed/ddp.h); the rest
// of the step is every data-parallel rank's (rank_stepper.h), replayed from a CUDA graph on GPUs
// (Note [a CUDA graph per DDP rank]).
class DdpStepper final : public RankStepper {
 public:
  explicit DdpStepper(const TrainConfig& cfg)
      : RankStepper(cfg, /*graphable=*/true), ddp_(build_model(cfg), cfg.group, ddp_options(cfg)) {
    ddp_.train();
    opt_ = make_optimizer(cfg, ddp_.parameters(), /*capturable=*/graphed());
    autocast_weights_ = make_autocast_weights(cfg, ddp_.parameters());  // DDP coalesced them
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }
  // Every rank loads the same checkpoint, so parameters and optimizer state agree without a
  // broadcast; buffers follow rank 0's at the next forward (broadcast_buffers).
  nn::Module& model() override { return ddp_.module(); }
  nn::optim::Optimizer& optimizer() override { return *opt_; }

 protected:
  nn::Module& module() override { return ddp_.module(); }
  void zero_grad() override { opt_->zero_grad(); }
  Tensor forward(const Tensor& x) override { return ddp_(x); }
  void optimizer_step() override { opt_->step(); }

 private:
  dist::DistributedDataParallel ddp_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
};

}  // namespace

std::unique_ptr<Stepper> make_stepper(const TrainConfig& cfg) {
  if (cfg.parallel == "pipeline") return make_pipeline_stepper(cfg);
  if (cfg.parallel == "tensor") return make_tensor_parallel_stepper(cfg);
  if (cfg.group) {
    TANDEM_CHECK(cfg.devices.size() == 1 && cfg.devices.front() == cfg.group->device(), Value,
                 "make_stepper: the ", cfg.group->backend(), " group works on ",
                 cfg.group->device().str(), ", not on the training device");
    if (cfg.zero) return make_zero_stepper(cfg);
    return std::make_unique<DdpStepper>(cfg);
  }
  if (cfg.devices.size() == 1) return std::make_unique<SingleDeviceStepper>(cfg);
  if (cfg.parallel == "dp") return std::make_unique<DataParallelStepper>(cfg);
  return std::make_unique<ScratchStepper>(cfg);
}

}  // namespace tandem::examples
