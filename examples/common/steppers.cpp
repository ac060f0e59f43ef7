// The four steppers of stepper.h, in the order make_stepper (at the end) picks them: one
// device, the from-scratch data-parallel path (ScratchTrainer), DataParallel, and one rank of
// a multi-process job (DistributedDataParallel).
#include "common/stepper.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "core/cuda_graph.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/optim/adam.h"
#include "nn/optim/sgd.h"
#include "parallel/data_parallel.h"
#include "parallel/distributed/collective_graph.h"
#include "parallel/distributed/ddp.h"
#include "parallel/flat_buffer.h"
#include "parallel/distributed/process_group.h"
#include "parallel/replicate.h"
#include "parallel/trace.h"
#include "parallel/trainer.h"

namespace tandem::examples {

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

namespace {

namespace dist = parallel::distributed;

// The program's model, in the memory format the flags ask for (Note [memory formats] in
// core/tensor.h): set before the model is moved, replicated or coalesced, which all keep it.
std::shared_ptr<nn::Module> build_model(const TrainConfig& cfg) {
  std::shared_ptr<nn::Module> m = cfg.make_model();
  if (cfg.channels_last) m->to(MemoryFormat::ChannelsLast);
  return m;
}

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
// SGD's.
class SingleDeviceStepper final : public Stepper {
 public:
  explicit SingleDeviceStepper(const TrainConfig& cfg)
      : model_(build_model(cfg)),
        graph_([this](const std::vector<Tensor>& in) { train_step(in[0], {in[1], in[2]}, in[3], in[4]); },
               {/*warmup_steps=*/2, /*enabled=*/cfg.cuda_graph}) {
    const Device d = cfg.devices.front();
    model_->to(d);
    model_->train();
    parallel::try_coalesce(model_->parameters());
    grads_ = parallel::FlatBuffer(model_->parameters());
    grads_.attach();
    // Only a graph needs it: StepGraph runs CPU steps eagerly.
    opt_ = make_optimizer(cfg, model_->parameters(), /*capturable=*/cfg.cuda_graph && d.is_cuda());
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor& correct) override {
    graph_({index}, {data.images(), data.labels(), loss_sum, correct});
  }

  // A capturable optimizer writes the new rate into its device tensor, which the replays read:
  // the graph stays. (Without a graph there is nothing to capture again.)
  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override { return *model_; }
  nn::Module& model() override { return *model_; }
  nn::optim::Optimizer& optimizer() override { return *opt_; }
  // A loaded checkpoint may have given the optimizer new state tensors: the graph would still
  // update the old ones, so the next step captures again.
  void after_load() override { graph_.invalidate(); }

 private:
  // One step on the rows `index` of (images, labels), graph-safe: see Note [the one-device step].
  void train_step(const Tensor& index, const data::TensorDataset& data, const Tensor& loss_sum,
                  const Tensor& correct) {
    const data::Batch b = data.get(index);
    grads_.zero_();
    Tensor logits = (*model_)(b.x);
    Tensor loss = cross_entropy(logits, b.y);
    loss.backward();
    opt_->step();
    kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), b.y, correct);
  }

  std::shared_ptr<nn::Module> model_;
  parallel::FlatBuffer grads_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
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
dist::DistributedDataParallelOptions ddp_options(const TrainConfig& cfg) {
  dist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = cfg.bucket_cap_mb;
  o.first_bucket_cap_mb = std::min(1.0, cfg.bucket_cap_mb);
  o.overlap = cfg.overlap;
  return o;
}

// DDP moves the model to the group's device (the training device), broadcasts rank 0's
// weights and reduces the gradients while backward runs (parallel/distributed/ddp.h).
//
// Note [a CUDA graph per DDP rank]: on a GPU with NCCL the rank's whole step -- the gather of its
// rows, forward, backward with the bucket allreduces, the optimizer, the epoch's sums -- is
// captured after two eager steps and replayed, as one device's step is (Note [the one-device
// step]); parallel/distributed/collective_graph.h says how the group keeps numbering and
// watching the collectives a replay runs. What the step reads from the host lives on the
// device, so the same graph serves every full batch: the learning rate and Adam's step count
// (a capturable optimizer), and the loss scale of an uneven shard (world * rows / global
// rows), a fill before each step -- a rank whose last shard has a full batch's rows but a
// smaller global batch replays with its own scale. Steps that are traced run eagerly (a
// graph's spans would time the capture), as do the steps of a Gloo group (host collectives).
class DdpStepper final : public Stepper {
 public:
  explicit DdpStepper(const TrainConfig& cfg)
      : group_(cfg.group),
        seed_(cfg.seed),
        ddp_(build_model(cfg), cfg.group, ddp_options(cfg)),
        graph_([this](const std::vector<Tensor>& in) { train_step(in[0], {in[1], in[2]}, in[3], in[4], in[5]); },
               {/*warmup_steps=*/2, /*enabled=*/cfg.cuda_graph && cfg.trace.empty()},
               std::make_unique<dist::CollectiveGraph>(std::vector<std::shared_ptr<dist::ProcessGroup>>{cfg.group})) {
    ddp_.train();
    const Device d = group_->device();
    const bool graphed = cfg.cuda_graph && cfg.trace.empty() && d.is_cuda();
    opt_ = make_optimizer(cfg, ddp_.parameters(), /*capturable=*/graphed);
    scale_ = zeros({}, kFloat32, d);
    if (graphed) {
      const std::string why = dist::CollectiveGraph({group_}).why_not(d);
      if (!why.empty()) {
        graph_.disable(why);
        if (group_->rank() == 0) std::fprintf(stderr, "tandem: CUDA graph off, steps run eagerly: %s\n", why.c_str());
      }
    }
    if (!cfg.trace.empty()) {
      trace_ = std::make_unique<parallel::Trace>(d, group_->rank(),
                                                 "rank " + std::to_string(group_->rank()) + " " + d.str());
      group_->set_trace(trace_.get());
    }
  }

  std::shared_ptr<data::DistributedSampler> sampler(int64_t n, bool train) override {
    if (train)
      return std::make_shared<data::DistributedSampler>(n, group_->size(), group_->rank(), true,
                                                        seed_);
    return std::make_shared<data::DistributedSampler>(n, group_->size(), group_->rank(), false, 0,
                                                      false,
                                                      /*pad=*/false);
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t global_rows,
            const Tensor& loss_sum, const Tensor& correct) override {
    const int64_t rows = index.size(0);
    if (rows == 0) return empty_step(data);
    last_index_ = index;
    if (trace_ && traced_steps_++ == kTracedSteps) group_->set_trace(nullptr);
    trace_now_ = trace_ && traced_steps_ <= kTracedSteps ? trace_.get() : nullptr;
    // Note [loss scaling for uneven shards] (parallel/trainer.cpp): DDP averages the ranks'
    // gradients, so the shard's mean loss is weighted by world * rows / global_rows; the
    // average is then the gradient of the global batch's mean loss, as on one process.
    scale_.fill_(static_cast<double>(group_->size()) * static_cast<double>(rows) / static_cast<double>(global_rows));
    graph_({index}, {data.images(), data.labels(), loss_sum, correct, scale_});
  }

  // The captured optimizer state may have been replaced: capture again.
  void after_load() override { graph_.invalidate(); }

  void sum_across_processes(const Tensor& t) override {
    group_->allreduce(t, dist::ReduceOp::Sum)->wait();
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }
  // Every rank loads the same checkpoint, so parameters and optimizer state agree without a
  // broadcast; buffers follow rank 0's at the next forward (broadcast_buffers).
  nn::Module& model() override { return ddp_.module(); }
  nn::optim::Optimizer& optimizer() override { return *opt_; }

  // Every rank hands its timeline to rank 0 through the store; rank 0 writes one file with a
  // process (pid = rank) per rank, on the shared host clock (parallel/trace.h).
  void write_trace(const std::string& path) override {
    if (!trace_) return;
    group_->set_trace(nullptr);
    dist::Store& store = group_->store();
    store.set("trace/" + std::to_string(group_->rank()), trace_->json());
    if (group_->rank() != 0) return;
    std::vector<std::string> parts;
    for (int r = 0; r < group_->size(); ++r) parts.push_back(store.get_string("trace/" + std::to_string(r)));
    parallel::write_merged_trace(path, parts);
  }

  nn::Module& eval_model() override {
    // Parameters are equal on every rank after each step; buffers are each rank's own since the
    // last forward. Evaluate rank 0's, as one process would.
    std::vector<Tensor> buffers = ddp_.module().buffers();
    if (!buffers.empty() && group_->size() > 1) dist::broadcast_coalesced(*group_, buffers, 0);
    return ddp_.module();
  }

 private:
  // One step on the rows `index` of (images, labels), graph-safe (Note [graph-safe steps] in
  // core/cuda_graph.h): nothing is kept from it but what it writes into the sums.
  void train_step(const Tensor& index, const data::TensorDataset& data, const Tensor& loss_sum, const Tensor& correct,
                  const Tensor& scale) {
    const data::Batch b = data.get(index);
    parallel::Trace* trace = trace_now_;
    const Device d = group_->device();
    opt_->zero_grad();
    auto span = parallel::Trace::scoped(trace, d, "forward");
    Tensor logits = ddp_(b.x);
    Tensor loss = cross_entropy(logits, b.y);
    span = parallel::Trace::scoped(trace, d, "backward");
    mul(loss, scale).backward();
    span = parallel::Trace::scoped(trace, d, "optimizer");
    opt_->step();
    span = {};
    kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), b.y, correct);
  }

  // Note [an empty shard]: when the global batch is not a multiple of the world size, the last
  // batch of an epoch can leave this rank no rows. It must still take the step -- the other
  // ranks wait for its buffer broadcast and its bucket allreduces -- and contribute a zero
  // gradient. A forward of 0 rows is not possible everywhere (BatchNorm refuses it in
  // training), so the rank runs a stand-in, eagerly: two rows of its previous batch with the
  // loss weighted by 0, and puts its buffers back afterwards so they do not see the stand-in.
  // The first batch of an epoch always gives every rank a row (batch_size >= world size), so a
  // previous batch exists.
  void empty_step(const data::TensorDataset& data) {
    TANDEM_CHECK(last_index_.defined(), Value, "DDP stepper: this rank's first batch is empty");
    const int64_t n = std::min<int64_t>(2, last_index_.size(0));
    const data::Batch b = data.get(last_index_.slice(0, 0, n));
    std::vector<Tensor> buffers = ddp_.module().buffers(), saved;
    for (const Tensor& t : buffers) saved.push_back(t.clone());
    opt_->zero_grad();
    Tensor loss = cross_entropy(ddp_(b.x), b.y);
    mul(loss, 0.0).backward();
    opt_->step();
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
  }

  std::shared_ptr<dist::ProcessGroup> group_;
  uint64_t seed_;
  dist::DistributedDataParallel ddp_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  Tensor last_index_;  // this rank's previous batch (Note [an empty shard])
  Tensor scale_;       // this step's loss scale, on the device (Note [a CUDA graph per DDP rank])
  std::unique_ptr<parallel::Trace> trace_;
  parallel::Trace* trace_now_ = nullptr;  // the trace while this step is traced
  int64_t traced_steps_ = 0;
  StepGraph graph_;
};

}  // namespace

std::unique_ptr<Stepper> make_stepper(const TrainConfig& cfg) {
  if (cfg.parallel == "pipeline") return make_pipeline_stepper(cfg);
  if (cfg.parallel == "tensor") return make_tensor_parallel_stepper(cfg);
  if (cfg.group) {
    TANDEM_CHECK(cfg.devices.size() == 1 && cfg.devices.front() == cfg.group->device(), Value,
                 "make_stepper: the ", cfg.group->backend(), " group works on ",
                 cfg.group->device().str(), ", not on the training device");
    return std::make_unique<DdpStepper>(cfg);
  }
  if (cfg.devices.size() == 1) return std::make_unique<SingleDeviceStepper>(cfg);
  if (cfg.parallel == "dp") return std::make_unique<DataParallelStepper>(cfg);
  return std::make_unique<ScratchStepper>(cfg);
}

}  // namespace tandem::examples
