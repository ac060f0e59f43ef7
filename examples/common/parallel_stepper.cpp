// The two data-parallel steppers: the from-scratch path (ScratchTrainer) and DataParallel.
#include <memory>

#include "autograd/ops.h"
#include "common/stepper.h"
#include "kernels/ops.h"
#include "parallel/data_parallel.h"
#include "parallel/trace.h"
#include "parallel/trainer.h"

namespace tandem::examples {

namespace {

// Traces only the first few steps of the run: enough for a timeline picture, and recording
// every step of an epoch would keep thousands of events alive.
constexpr int64_t kTracedSteps = 5;

class ScratchStepper final : public Stepper {
 public:
  explicit ScratchStepper(const TrainConfig& cfg)
      : trainer_(cfg.make_model(), cfg.devices, cfg.comm,
                 [cfg](std::vector<Tensor> ps) { return make_optimizer(cfg, std::move(ps)); }) {
    trainer_.module().train();
    if (!cfg.trace.empty()) {
      trace_ = std::make_unique<parallel::Trace>(cfg.devices);
      trainer_.set_trace(trace_.get());
    }
  }

  void step(const Tensor& x, const Tensor& y, int64_t, const Tensor& loss_sum, const Tensor& correct) override {
    if (trace_ && steps_ == kTracedSteps) trainer_.set_trace(nullptr);
    ++steps_;
    Tensor loss = trainer_.train_batch(x, y);
    kernels::axpby_(static_cast<double>(x.size(0)), loss, 1.0, loss_sum);
  }

  // Each replica counts its right answers on its own device during the epoch; they are
  // gathered once here rather than with cross-device copies every step.
  void end_epoch(const Tensor& correct) override {
    kernels::axpby_(1.0, trainer_.correct(), 1.0, correct);
    trainer_.reset_metrics();
  }

  void set_lr(double lr) override {
    for (size_t r = 0; r < trainer_.devices().size(); ++r) trainer_.optimizer(r).set_lr(lr);
  }
  nn::Module& eval_model() override { return trainer_.module(); }

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
  explicit DataParallelStepper(const TrainConfig& cfg) : dp_(cfg.make_model(), cfg.devices) {
    dp_.train();
    opt_ = make_optimizer(cfg, dp_.parameters());
  }

  void step(const Tensor& x, const Tensor& y, int64_t, const Tensor& loss_sum, const Tensor& correct) override {
    opt_->zero_grad();
    Tensor logits = dp_(x);
    Tensor loss = cross_entropy(logits, y);
    loss.backward();
    opt_->step();
    kernels::axpby_(static_cast<double>(x.size(0)), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), y, correct);
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override { return dp_.module(); }

 private:
  parallel::DataParallel dp_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
};

}  // namespace

std::unique_ptr<Stepper> make_parallel_stepper(const TrainConfig& cfg) {
  if (cfg.parallel == "dp") return std::make_unique<DataParallelStepper>(cfg);
  return std::make_unique<ScratchStepper>(cfg);
}

}  // namespace tandem::examples
