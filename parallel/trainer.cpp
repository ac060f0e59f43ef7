#include "parallel/trainer.h"

#include <algorithm>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/device_api.h"
#include "parallel/parallel_apply.h"
#include "parallel/scatter.h"

namespace tandem::parallel {

ScratchTrainer::ScratchTrainer(std::shared_ptr<nn::Module> module, std::vector<Device> devices,
                               const std::string& comm_name,
                               const OptimizerFactory& make_optimizer)
    : devices_(std::move(devices)), workers_(devices_) {
  TANDEM_CHECK(make_optimizer != nullptr, Value, "ScratchTrainer: no optimizer factory");
  enable_peer_access(devices_);
  replicas_ = replicate(module, devices_);
  comm_ = make_communicator(comm_name, devices_);
  for (size_t r = 0; r < devices_.size(); ++r) {
    DeviceGuard device(devices_[r]);
    // Parameters back to back, like their gradients: the optimizer then updates a replica
    // with one fused kernel (Note [flat optimizer step]).
    try_coalesce(replicas_[r]->parameters());
    grads_.emplace_back(trainable_parameters(*replicas_[r]));
    optimizers_.push_back(make_optimizer(replicas_[r]->parameters()));
    TANDEM_CHECK(optimizers_.back() != nullptr, Value, "ScratchTrainer: the optimizer factory "
                 "returned null for ", devices_[r].str());
    correct_.push_back(zeros({1}, kInt64, devices_[r]));
  }
}

Tensor ScratchTrainer::train_batch(const Tensor& x, const Tensor& y) {
  TANDEM_CHECK(x.defined() && y.defined() && x.dim() >= 1 && y.dim() == 1 &&
                   x.size(0) == y.size(0),
               Shape, "train_batch: need x [B, ...] and labels y [B], got ",
               x.defined() ? x.str() : "undefined", " and ", y.defined() ? y.str() : "undefined");
  TANDEM_CHECK(x.size(0) > 0, Value, "train_batch: empty batch");
  const size_t n = devices_.size();
  const int64_t batch = x.size(0);
  // Note [batches smaller than the device count]
  // A batch of B < n rows (the last batch of an epoch, typically) runs on the first B devices,
  // one row each, as PyTorch's DataParallel does, so every sample is trained on. The other
  // replicas compute nothing but still join the allreduce with zero gradients and take the same
  // optimizer step on the same sum, so the replicas stay identical.
  const size_t active = std::min(n, static_cast<size_t>(batch));
  const std::vector<Device> active_devices(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(active));
  const std::vector<int64_t> sizes = split_sizes(batch, active);

  // 1. Shards, copied to the devices on their current streams (which the workers use too).
  std::vector<Tensor> xs, ys;
  {
    NoGradGuard no_grad;
    xs = scatter(x, sizes, active_devices);
    ys = scatter(y, sizes, active_devices);
  }

  // 3. Forward and backward of every replica at once.
  //
  // Note [loss scaling for uneven shards]
  // Replica r computes the mean loss over its b_r rows and scales it by b_r / B before
  // backward. The allreduce then *sums* the replicas' gradients:
  //     sum_r (b_r / B) * grad(mean over shard r) = grad(sum over all rows / B),
  // exactly the gradient of the mean loss over the global batch, as one device would compute
  // it, also when B is not a multiple of the device count. (Averaging the replicas' gradients
  // instead would weight the rows of a smaller shard more.)
  std::vector<Tensor> losses = parallel_apply(workers_, [&](size_t r) {
    auto span = Trace::scoped(trace_, devices_[r], "forward+backward");
    grads_[r].zero_();
    grads_[r].attach();
    if (r >= active) return Tensor();  // no rows: a zero gradient for the allreduce
    Tensor logits = replicas_[r]->forward(xs[r]);
    Tensor loss = mul(cross_entropy(logits, ys[r]), double(sizes[r]) / double(batch));
    loss.backward();
    grads_[r].collect();
    kernels::count_correct(logits.detach(), ys[r], correct_[r]);
    return loss.detach();
  });

  // 4. One allreduce for the whole model, on the devices' current streams.
  {
    std::vector<Trace::Span> spans;
    if (trace_) {
      const std::string name = "allreduce " + comm_->name();
      for (Device d : devices_) spans.push_back(Trace::scoped(trace_, d, name, "comm"));
    }
    std::vector<Tensor> flats;
    for (const FlatBuffer& g : grads_) flats.push_back(g.flat());
    comm_->allreduce_sum(flats);
  }

  // 5. The same update on every replica.
  workers_.run([&](size_t r) {
    auto span = Trace::scoped(trace_, devices_[r], "optimizer");
    optimizers_[r]->step();
  });

  examples_ += batch;
  // The scaled shard losses add up to the global-batch mean.
  DeviceGuard device(devices_[0]);
  Tensor total = losses[0];
  for (size_t r = 1; r < active; ++r) total = kernels::binary(BinaryOp::Add, total, losses[r].to(devices_[0]));
  return total;
}

Tensor ScratchTrainer::correct() const {
  DeviceGuard device(devices_[0]);
  Tensor total = correct_[0].clone();
  for (size_t r = 1; r < devices_.size(); ++r) {
    kernels::binary_(BinaryOp::Add, total, correct_[r].to(devices_[0]));
  }
  return total;
}

void ScratchTrainer::reset_metrics() {
  for (const Tensor& c : correct_) c.zero_();
  examples_ = 0;
}

}  // namespace tandem::parallel
