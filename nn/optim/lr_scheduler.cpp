#include "nn/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tandem::nn::optim {

LRScheduler::LRScheduler(const ScheduleTarget& target)
    : optimizer_(target.optimizer), base_lr_(target.base_lr), last_lr_(target.base_lr) {
  TANDEM_CHECK(std::isfinite(base_lr_) && base_lr_ >= 0, Value, "lr scheduler: base lr ", base_lr_,
               " is not a finite value >= 0");
}

void LRScheduler::initial_step() {
  last_epoch_ = -1;
  step();
}

void LRScheduler::step() {
  ++last_epoch_;
  last_lr_ = lr_at(last_epoch_);
  if (optimizer_ != nullptr) optimizer_->set_lr(last_lr_);
}

double LRScheduler::lr_at(int64_t epoch) const {
  TANDEM_CHECK(epoch >= 0, Value, "lr scheduler: epoch ", epoch, " < 0");
  return closed_form(epoch);
}

StepLR::StepLR(const ScheduleTarget& target, int64_t step_size, double gamma)
    : LRScheduler(target), step_size_(step_size), gamma_(gamma) {
  TANDEM_CHECK(step_size >= 1, Value, "StepLR: step_size ", step_size, " < 1");
  initial_step();
}

double StepLR::closed_form(int64_t epoch) const {
  return base_lr() * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

CosineAnnealingLR::CosineAnnealingLR(const ScheduleTarget& target, int64_t T_max, double eta_min)
    : LRScheduler(target), T_max_(T_max), eta_min_(eta_min) {
  TANDEM_CHECK(T_max >= 1, Value, "CosineAnnealingLR: T_max ", T_max, " < 1");
  initial_step();
}

double CosineAnnealingLR::closed_form(int64_t epoch) const {
  const double pi = std::acos(-1.0);
  return eta_min_ + (base_lr() - eta_min_) *
                        (1.0 + std::cos(pi * static_cast<double>(epoch) / static_cast<double>(T_max_))) / 2.0;
}

LinearLR::LinearLR(const ScheduleTarget& target, double start_factor, double end_factor,
                   int64_t total_iters)
    : LRScheduler(target), start_factor_(start_factor), end_factor_(end_factor), total_iters_(total_iters) {
  TANDEM_CHECK(start_factor > 0 && start_factor <= 1, Value, "LinearLR: start_factor ", start_factor,
               " is not in (0, 1]");
  TANDEM_CHECK(end_factor >= 0 && end_factor <= 1, Value, "LinearLR: end_factor ", end_factor,
               " is not in [0, 1]");
  TANDEM_CHECK(total_iters >= 1, Value, "LinearLR: total_iters ", total_iters, " < 1");
  initial_step();
}

double LinearLR::closed_form(int64_t epoch) const {
  const double done = static_cast<double>(std::min(epoch, total_iters_)) / static_cast<double>(total_iters_);
  return base_lr() * (start_factor_ + (end_factor_ - start_factor_) * done);
}

SequentialLR::SequentialLR(const ScheduleTarget& target, std::vector<std::shared_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(target), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  TANDEM_CHECK(!schedulers_.empty(), Value, "SequentialLR: no schedulers");
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    TANDEM_CHECK(schedulers_[i] != nullptr, Value, "SequentialLR: scheduler ", i, " is null");
    TANDEM_CHECK(schedulers_[i]->optimizer() == optimizer(), Value, "SequentialLR: scheduler ", i,
                 " drives another optimizer than the SequentialLR");
  }
  TANDEM_CHECK(milestones_.size() + 1 == schedulers_.size(), Value, "SequentialLR: ", schedulers_.size(),
               " schedulers need ", schedulers_.size() - 1, " milestones, got ", milestones_.size());
  for (size_t i = 0; i < milestones_.size(); ++i) {
    TANDEM_CHECK(milestones_[i] > (i == 0 ? 0 : milestones_[i - 1]), Value, "SequentialLR: milestone ", i,
                 " (", milestones_[i], ") is not a positive epoch after the previous one");
  }
  // Note [one base lr for every phase]: constructing schedulers_[0] over the optimizer already
  // changed its lr (the initial step), so the later phases and this scheduler saw that changed
  // value as their base. PyTorch keeps the first one as `initial_lr`; here it is schedulers_[0]'s.
  base_lr_ = schedulers_[0]->base_lr_;
  for (const auto& s : schedulers_) s->base_lr_ = base_lr_;
  initial_step();
}

double SequentialLR::closed_form(int64_t epoch) const {
  // Phase i covers [milestones[i - 1], milestones[i]).
  const size_t phase = static_cast<size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), epoch) -
                                           milestones_.begin());
  const int64_t start = phase == 0 ? 0 : milestones_[phase - 1];
  return schedulers_[phase]->lr_at(epoch - start);
}

}  // namespace tandem::nn::optim
