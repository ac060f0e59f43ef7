#pragma once
// One training step, three ways: on one device, the from-scratch data-parallel path, or
// DataParallel. The driver in train.cpp does not care which.
#include <memory>
#include <string>

#include "common/train.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace tandem::examples {

class Stepper {
 public:
  virtual ~Stepper() = default;
  // One optimizer step on the global batch (x, y) on the first device. Adds the batch's summed
  // loss into loss_sum ([] float32) and its number of right answers into correct ([1] int64),
  // both on the first device, without synchronizing the host. A stepper may instead keep the
  // counts on its own devices and add them in end_epoch().
  virtual void step(const Tensor& x, const Tensor& y, const Tensor& loss_sum, const Tensor& correct) = 0;
  // Called once after the last step of an epoch, before the driver reads `correct`.
  virtual void end_epoch(const Tensor& correct) {}
  // Sets the learning rate of the optimizer(s) for the following steps.
  virtual void set_lr(double lr) = 0;
  // The model to evaluate (on the first device).
  virtual nn::Module& eval_model() = 0;
  // Writes the timeline of the steps recorded so far (Chrome trace JSON); a no-op when the
  // stepper records none.
  virtual void write_trace(const std::string& path) {}
};

std::unique_ptr<Stepper> make_stepper(const TrainConfig& cfg);

}  // namespace tandem::examples
