// The pipeline steppers (--parallel pipeline): the model's layers cut into stages, on the
// devices of this process (parallel::pipeline::Pipeline, one worker thread per stage) or one
// stage per process of a job (ProcessPipeline, stage s on rank s). The cut is cfg.balance (from
// --balance), else balance_by_parameters; the optimizer of each process is over the parameters
// it holds.
//
// Note [pipeline stepper numbers]
// Every micro-batch's loss is scaled by n_m / B (Note [loss scaling for micro-batches]), so a
// step's gradient and update are the one-device step's up to rounding, and the epoch lines are
// those of the program on one device (BatchNorm aside: it sees one micro-batch at a time). The
// right answers are counted on the last stage, inside the loss function. In a job every rank
// reads the whole batch (stage 0 needs the images, the last stage the labels), the last stage
// broadcasts the step's loss and, for evaluation, the logits: so every rank holds the same
// epoch numbers, and "summing across processes" is a broadcast from the last stage
// (the numbers the others hold are the last stage's anyway, and a stop vote counts when the
// last stage got the signal). A batch with fewer rows than micro-batches (the last of an
// epoch) runs with one micro-batch per row.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "common/stepper.h"
#include "core/error.h"
#include "core/generator.h"
#include "kernels/ops.h"
#include "nn/container.h"
#include "parallel/distributed/process_group.h"
#include "parallel/pipeline/microbatch.h"
#include "parallel/pipeline/pipeline.h"
#include "parallel/pipeline/process_boundary.h"
#include "parallel/pipeline/split.h"
#include "parallel/trace.h"
#include "parallel/workers.h"

namespace tandem::examples {

namespace {

namespace pp = parallel::pipeline;

constexpr int64_t kTracedPipelineSteps = 5;

std::shared_ptr<nn::SequentialImpl> build_sequential(const TrainConfig& cfg) {
  auto model = std::dynamic_pointer_cast<nn::SequentialImpl>(cfg.make_model());
  TANDEM_CHECK(model != nullptr, Value, "--parallel pipeline cuts a Sequential model into stages; ",
               cfg.model_name, " is not one");
  return model;
}

// The loss of one micro-batch, counting its right answers into `correct` (on the last stage).
pp::LossFn counting_loss(const Tensor& correct) {
  return [correct](const Tensor& out, const Tensor& y) {
    kernels::count_correct(out.detach(), y, correct);
    return cross_entropy(out, y);
  };
}

// ---- stages on the devices of this process ------------------------------------------------
class PipelineStepper final : public Stepper {
 public:
  explicit PipelineStepper(const TrainConfig& cfg)
      : cfg_(cfg), model_(build_sequential(cfg)), home_(cfg.devices.front()) {
    model_->train();
    stages_ = cfg.balance.empty() ? pp::split_by_parameters(*model_, cfg.devices)
                                  : pp::split_by_balance(*model_, cfg.balance, cfg.devices);
    correct_ = zeros({1}, kInt64, cfg.devices.back());
    opt_ = make_optimizer(cfg, model_->parameters());
    if (!cfg.trace.empty()) trace_ = std::make_unique<parallel::Trace>(cfg.devices);
    eval_ = std::make_shared<FunctionModule>("Pipeline", [this](const Tensor& x) {
      return pipeline(static_cast<int>(cfg_.micro_batches)).forward(x).to(home_);
    });
    eval_->to(home_);
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor&) override {
    if (!model_->is_training()) model_->train();  // after an evaluation (eval_model())
    const data::Batch b = data.get(index);
    const int64_t rows = b.x.size(0);
    pp::Pipeline& pipe = pipeline(static_cast<int>(std::min<int64_t>(cfg_.micro_batches, rows)));
    pipe.set_trace(trace_ && steps_ < kTracedPipelineSteps ? trace_.get() : nullptr);
    ++steps_;
    opt_->zero_grad();
    Tensor loss = pipe.step(b.x, b.y);
    opt_->step();
    kernels::axpby_(static_cast<double>(rows), loss.to(home_), 1.0, loss_sum);
  }
  void collect_metrics(const Tensor& correct) override {
    kernels::axpby_(1.0, correct_.to(correct.device()), 1.0, correct);
    correct_.zero_();
  }
  void set_lr(double lr) override { opt_->set_lr(lr); }
  // The driver puts eval_model() in eval mode; the stages are what runs, and step() puts them
  // back in training mode.
  nn::Module& eval_model() override {
    model_->eval();
    return *eval_;
  }
  nn::Module& model() override { return *model_; }
  nn::optim::Optimizer& optimizer() override { return *opt_; }
  void write_trace(const std::string& path) override {
    if (trace_) trace_->write(path);
  }

 private:
  // The executor for m micro-batches (the configured M, and fewer for a short last batch).
  pp::Pipeline& pipeline(int m) {
    auto it = pipes_.find(m);
    if (it == pipes_.end()) {
      const int P = static_cast<int>(stages_.size());
      it = pipes_
               .emplace(m, std::make_unique<pp::Pipeline>(stages_,
                                                          pp::schedule_by_name(cfg_.schedule, P, m),
                                                          counting_loss(correct_)))
               .first;
    }
    return *it->second;
  }

  TrainConfig cfg_;
  std::shared_ptr<nn::SequentialImpl> model_;
  Device home_;
  std::vector<pp::Stage> stages_;
  std::map<int, std::unique_ptr<pp::Pipeline>> pipes_;
  Tensor correct_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  std::unique_ptr<parallel::Trace> trace_;
  std::shared_ptr<FunctionModule> eval_;
  int64_t steps_ = 0;
};

// ---- one stage per process ------------------------------------------------------------------
class ProcessPipelineStepper final : public Stepper {
 public:
  explicit ProcessPipelineStepper(const TrainConfig& cfg)
      : cfg_(cfg), group_(cfg.group), model_(build_sequential(cfg)), device_(cfg.devices.front()) {
    model_->train();
    const auto balance =
        cfg.balance.empty() ? pp::balance_by_parameters(*model_, group_->size()) : cfg.balance;
    stage_ = pp::stage_of_balance(*model_, balance, group_->rank(), device_);
    correct_ = zeros({1}, kInt64, device_);
    opt_ = make_optimizer(cfg, stage_.module->parameters());
    if (!cfg.trace.empty()) {
      trace_ = std::make_unique<parallel::Trace>(device_, group_->rank(),
                                                 "stage " + std::to_string(group_->rank()) +
                                                     " (rank " + std::to_string(group_->rank()) +
                                                     ") " + device_.str());
    }
    eval_ = std::make_shared<FunctionModule>("Pipeline", [this](const Tensor& x) {
      return pipeline(static_cast<int>(cfg_.micro_batches)).forward(x).to(device_);
    });
    eval_->to(device_);
  }

  void step(const data::TensorDataset& data, const Tensor& index, int64_t, const Tensor& loss_sum,
            const Tensor&) override {
    if (!stage_.module->is_training()) stage_.module->train();  // after an evaluation
    const data::Batch b = data.get(index);
    const int64_t rows = b.x.size(0);
    pp::ProcessPipeline& pipe =
        pipeline(static_cast<int>(std::min<int64_t>(cfg_.micro_batches, rows)));
    pipe.set_trace(trace_ && steps_ < kTracedPipelineSteps ? trace_.get() : nullptr);
    ++steps_;
    opt_->zero_grad();
    Tensor loss = pipe.step(b.x, b.y);
    opt_->step();
    kernels::axpby_(static_cast<double>(rows), loss.to(device_), 1.0, loss_sum);
  }
  void collect_metrics(const Tensor& correct) override {
    kernels::axpby_(1.0, correct_, 1.0, correct);
    correct_.zero_();
  }
  // Note [pipeline stepper numbers]: the last stage's values, on every rank.
  void sum_across_processes(const Tensor& t) override {
    group_->broadcast(t, group_->size() - 1)->wait();
  }
  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override {
    stage_.module->eval();  // as PipelineStepper's
    return *eval_;
  }
  nn::Module& model() override { return *stage_.module; }
  nn::optim::Optimizer& optimizer() override { return *opt_; }
  // Every rank hands its timeline to rank 0 through the store; rank 0 writes one file with a
  // lane per stage (as the DDP stepper does with a lane per rank).
  void write_trace(const std::string& path) override {
    if (!trace_) return;
    parallel::distributed::Store& store = group_->store();
    store.set("pipeline-trace/" + std::to_string(group_->rank()), trace_->json());
    if (group_->rank() != 0) return;
    std::vector<std::string> parts;
    for (int r = 0; r < group_->size(); ++r)
      parts.push_back(store.get_string("pipeline-trace/" + std::to_string(r)));
    parallel::write_merged_trace(path, parts);
  }

 private:
  pp::ProcessPipeline& pipeline(int m) {
    auto it = pipes_.find(m);
    if (it == pipes_.end()) {
      it = pipes_
               .emplace(m, std::make_unique<pp::ProcessPipeline>(
                               stage_, pp::schedule_by_name(cfg_.schedule, group_->size(), m),
                               counting_loss(correct_), group_))
               .first;
    }
    return *it->second;
  }

  TrainConfig cfg_;
  std::shared_ptr<parallel::distributed::ProcessGroup> group_;
  std::shared_ptr<nn::SequentialImpl> model_;
  Device device_;
  pp::Stage stage_;
  std::map<int, std::unique_ptr<pp::ProcessPipeline>> pipes_;
  Tensor correct_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  std::unique_ptr<parallel::Trace> trace_;
  std::shared_ptr<FunctionModule> eval_;
  int64_t steps_ = 0;
};

// The profile's repeats: the median of 5 runs per layer, after a warm-up.
constexpr int kBalanceRepeats = 5;

// What balance_by_time profiles: one micro-batch of random images (torchgpipe's sample is
// torch.rand too; a layer's time does not depend on the values), drawn from a generator of its
// own so that the run's random numbers stay those of a run without the profile.
Tensor sample_micro_batch(const TrainConfig& cfg) {
  const int64_t batch = cfg.train_limit > 0 ? std::min(cfg.batch_size, cfg.train_limit) : cfg.batch_size;
  Shape shape = {pp::micro_batch_sizes(batch, static_cast<int>(std::min(cfg.micro_batches, batch)))[0]};
  shape.insert(shape.end(), cfg.input_shape.begin(), cfg.input_shape.end());
  Generator gen(cfg.seed);
  return rand(shape, kFloat32, kCPU, &gen);
}

std::vector<int64_t> choose_balance_here(const TrainConfig& cfg, int num_stages) {
  auto model = build_sequential(cfg);
  if (cfg.balance_by == "parameters") return pp::balance_by_parameters(*model, num_stages);
  model->to(cfg.devices.front());
  model->train();
  const Tensor sample = sample_micro_batch(cfg);
  auto measure = [&] { return pp::balance_by_time(*model, sample, num_stages, kBalanceRepeats); };
  if (cfg.group) return measure();
  // In one process each stage runs on its device's worker thread with one BLAS thread (Note
  // [one BLAS thread per virtual device]); profiled on the main thread with all of OpenBLAS's
  // threads, the convolutions' products looked cheaper than the stages then found them. So the
  // profile runs where stage 0 will, on the first device's worker.
  std::vector<int64_t> balance;
  parallel::DeviceWorkers workers(cfg.devices);
  workers.run([&](size_t rank) {
    if (rank == 0) balance = measure();
  });
  return balance;
}

}  // namespace

// Note [one balance for every rank]
// Every rank of a job cuts the same model, and the ranks must agree on where: a rank that took
// layers 0-6 and a neighbour that took 8-11 would exchange activations of the wrong shape, or
// wait for each other's messages forever. Parameter counts are the same everywhere, measured
// times are not (each process measures its own noise). So rank 0 chooses and broadcasts the
// balance over the group, and every rank uses what it received; in one process the devices'
// stages are cut from the one answer anyway. The time is measured on the first device (in a
// job, rank 0's), on one micro-batch: what each stage runs at once.
std::vector<int64_t> choose_pipeline_balance(const TrainConfig& cfg) {
  if (!cfg.group) return choose_balance_here(cfg, static_cast<int>(cfg.devices.size()));
  const int P = cfg.group->size();
  Tensor balance = zeros({P}, kInt64, cfg.devices.front());
  if (cfg.group->rank() == 0)
    balance.copy_(from_vector(choose_balance_here(cfg, P), {P}).to(balance.device()));
  cfg.group->broadcast(balance, 0)->wait();
  return balance.to_vector<int64_t>();
}

std::unique_ptr<Stepper> make_pipeline_stepper(const TrainConfig& cfg) {
  if (cfg.group) return std::make_unique<ProcessPipelineStepper>(cfg);
  return std::make_unique<PipelineStepper>(cfg);
}

}  // namespace tandem::examples
