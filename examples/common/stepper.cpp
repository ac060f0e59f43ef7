#include "common/stepper.h"

#include "autograd/ops.h"
#include "kernels/ops.h"
#include "nn/optim/adam.h"
#include "nn/optim/sgd.h"

namespace tandem::examples {

std::unique_ptr<nn::optim::Optimizer> make_optimizer(const TrainConfig& cfg, std::vector<Tensor> params) {
  if (cfg.optimizer == "adam")
    return std::make_unique<nn::optim::Adam>(
        std::move(params), nn::optim::AdamOptions(cfg.lr).weight_decay(cfg.weight_decay));
  return std::make_unique<nn::optim::SGD>(
      std::move(params),
      nn::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay));
}

namespace {

class SingleDeviceStepper final : public Stepper {
 public:
  explicit SingleDeviceStepper(const TrainConfig& cfg) : model_(cfg.make_model()) {
    model_->to(cfg.devices.front());
    model_->train();
    opt_ = make_optimizer(cfg, model_->parameters());
  }

  void step(const Tensor& x, const Tensor& y, int64_t, const Tensor& loss_sum, const Tensor& correct) override {
    opt_->zero_grad();
    Tensor logits = (*model_)(x);
    Tensor loss = cross_entropy(logits, y);
    loss.backward();
    opt_->step();
    kernels::axpby_(static_cast<double>(x.size(0)), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), y, correct);
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }
  nn::Module& eval_model() override { return *model_; }

 private:
  std::shared_ptr<nn::Module> model_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
};

}  // namespace

std::unique_ptr<Stepper> make_stepper(const TrainConfig& cfg) {
  if (cfg.group) return make_ddp_stepper(cfg);
  if (cfg.devices.size() == 1) return std::make_unique<SingleDeviceStepper>(cfg);
  return make_parallel_stepper(cfg);
}

}  // namespace tandem::examples
