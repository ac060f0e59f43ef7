#pragma once
// Learning-rate schedulers, as torch.optim.lr_scheduler:
//
//   SGD opt(model->parameters(), 0.1);
//   StepLR schedule(opt, /*step_size=*/30, /*gamma=*/0.1);
//   for (int epoch = 0; epoch < 90; ++epoch) {
//     train_one_epoch(model, opt);   // steps with opt.lr() == schedule.get_last_lr()
//     schedule.step();
//   }
//
// Construction performs PyTorch's initial step: last_epoch() becomes 0 and the optimizer's lr
// becomes the schedule's value at epoch 0 (LinearLR starts warm-up at once). Each step() then
// advances last_epoch by one and sets the lr to lr_at(last_epoch()).
//
// Every schedule here is its documented closed form of (base lr, epoch), evaluated fresh at
// each step. PyTorch's step() uses a chainable (recursive) form of the same formulas, so its
// sequence agrees with these closed forms to rounding (about 1e-16 relative, tested against
// PyTorch where it is installed), and unlike it a change made to the optimizer's lr between
// steps does not carry over (nothing else changes the lr of a tandem optimizer).
//
// tandem's optimizers have one parameter group, so get_last_lr() is one number where PyTorch
// returns a list with one entry per group.
//
// A scheduler drives an Optimizer, or only a base lr (a ScheduleTarget made from a double):
// then nothing is set, and the caller reads get_last_lr() and applies it itself, e.g. to the
// optimizers of several replicas.
#include <cstdint>
#include <memory>
#include <vector>

#include "nn/optim/optimizer.h"

namespace tandem::nn::optim {

// What a scheduler sets: an optimizer (whose lr at that moment is the base lr), or nothing,
// with an explicit base lr.
struct ScheduleTarget {
  ScheduleTarget(Optimizer& optimizer) : optimizer(&optimizer), base_lr(optimizer.lr()) {}  // NOLINT
  ScheduleTarget(double base_lr) : base_lr(base_lr) {}  // NOLINT
  Optimizer* optimizer = nullptr;
  double base_lr;
};

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances last_epoch by one and sets the optimizer's lr to lr_at(last_epoch).
  void step();
  // The lr of the current epoch (what step() or the constructor set last).
  double get_last_lr() const { return last_lr_; }
  // Steps taken: 0 after construction.
  int64_t last_epoch() const { return last_epoch_; }
  double base_lr() const { return base_lr_; }
  Optimizer* optimizer() const { return optimizer_; }
  // The closed form: the lr after `epoch` steps (epoch >= 0; ValueError otherwise).
  double lr_at(int64_t epoch) const;

 protected:
  explicit LRScheduler(const ScheduleTarget& target);
  // Subclasses call it last in their constructors (a base constructor cannot call closed_form).
  void initial_step();
  virtual double closed_form(int64_t epoch) const = 0;

 private:
  friend class SequentialLR;
  Optimizer* optimizer_;
  double base_lr_;
  int64_t last_epoch_ = -1;
  double last_lr_;
};

// lr = base_lr * gamma^floor(epoch / step_size). ValueError unless step_size >= 1.
class StepLR : public LRScheduler {
 public:
  StepLR(const ScheduleTarget& target, int64_t step_size, double gamma = 0.1);

 protected:
  double closed_form(int64_t epoch) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2: from base_lr at
// epoch 0 down to eta_min at epoch T_max (and, past it, back up: a cosine without restarts, as
// PyTorch's). ValueError unless T_max >= 1.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(const ScheduleTarget& target, int64_t T_max, double eta_min = 0.0);

 protected:
  double closed_form(int64_t epoch) const override;

 private:
  int64_t T_max_;
  double eta_min_;
};

// Linear warm-up (or decay) of a factor of base_lr:
//   lr = base_lr * (start_factor + (end_factor - start_factor) * min(epoch, total_iters) / total_iters)
// ValueError unless 0 < start_factor <= 1, 0 <= end_factor <= 1 (PyTorch's bounds) and
// total_iters >= 1.
class LinearLR : public LRScheduler {
 public:
  LinearLR(const ScheduleTarget& target, double start_factor = 1.0 / 3, double end_factor = 1.0,
           int64_t total_iters = 5);

 protected:
  double closed_form(int64_t epoch) const override;

 private:
  double start_factor_, end_factor_;
  int64_t total_iters_;
};

// Phases one after another: schedulers[i] runs from milestones[i - 1] (0 for the first),
// restarted at its own epoch 0 there, so epoch e of the whole schedule is epoch
// e - milestones[i - 1] of phase i. Warm-up then cosine:
//   SequentialLR(opt, {std::make_shared<LinearLR>(opt, 0.1, 1.0, 5),
//                      std::make_shared<CosineAnnealingLR>(opt, 95)}, {5});
// Every phase uses the base lr of schedulers[0] (PyTorch's initial_lr: constructing the first
// phase already changed the optimizer's lr when the second was made). Step only the
// SequentialLR; the phases serve as closed forms and their own step counts stay as they are.
// ValueError for no or null schedulers, phases over another optimizer, or milestones that
// are not schedulers.size() - 1 strictly increasing positive epochs.
class SequentialLR : public LRScheduler {
 public:
  SequentialLR(const ScheduleTarget& target, std::vector<std::shared_ptr<LRScheduler>> schedulers,
               std::vector<int64_t> milestones);

 protected:
  double closed_form(int64_t epoch) const override;

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<int64_t> milestones_;
};

}  // namespace tandem::nn::optim
