#include "parallel/trainer.h"

#include <algorithm>
#include <cstdio>

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

  // 3-5. Forward and backward, allreduce, the optimizers: eagerly, or replayed from a CUDA
  // graph per replica (Note [a CUDA graph per replica]).
  //
  // Note [loss scaling for uneven shards]
  // Replica r computes the mean loss over its b_r rows and scales it by b_r / B before
  // backward. The allreduce then *sums* the replicas' gradients:
  //     sum_r (b_r / B) * grad(mean over shard r) = grad(sum over all rows / B),
  // exactly the gradient of the mean loss over the global batch, as one device would compute
  // it, also when B is not a multiple of the device count. (Averaging the replicas' gradients
  // instead would weight the rows of a smaller shard more.)
  std::vector<double> weights;
  for (int64_t rows : sizes) weights.push_back(double(rows) / double(batch));
  const bool graphable = graph_on_ && graph_reason_.empty() && trace_ == nullptr && active == n;
  std::vector<Tensor> losses = graphable ? graphed_step(xs, ys, weights) : eager_step(xs, ys, weights);

  examples_ += batch;
  // The scaled shard losses add up to the global-batch mean.
  DeviceGuard device(devices_[0]);
  Tensor total = losses[0];
  for (size_t r = 1; r < active; ++r) total = kernels::binary(BinaryOp::Add, total, losses[r].to(devices_[0]));
  return total;
}

Tensor ScratchTrainer::forward_backward(size_t r, const Tensor& x, const Tensor& y, double weight) {
  grads_[r].zero_();
  grads_[r].attach();
  if (!x.defined()) return Tensor();  // no rows: a zero gradient for the allreduce
  Tensor logits = replicas_[r]->forward(x);
  Tensor loss = mul(cross_entropy(logits, y), weight);
  loss.backward();
  grads_[r].collect();
  kernels::count_correct(logits.detach(), y, correct_[r]);
  return loss.detach();
}

void ScratchTrainer::allreduce_gradients() {
  std::vector<Trace::Span> spans;
  if (trace_) {
    const std::string name = "allreduce " + comm_->name();
    for (Device d : devices_) spans.push_back(Trace::scoped(trace_, d, name, "comm"));
  }
  std::vector<Tensor> flats;
  for (const FlatBuffer& g : grads_) flats.push_back(g.flat());
  comm_->allreduce_sum(flats);  // one collective for the whole model, on the devices' current streams
}

std::vector<Tensor> ScratchTrainer::eager_step(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                                               const std::vector<double>& weights) {
  // 3. Forward and backward of every replica at once (replicas past the shards: no rows).
  std::vector<Tensor> losses = parallel_apply(workers_, [&](size_t r) {
    auto span = Trace::scoped(trace_, devices_[r], "forward+backward");
    return r < xs.size() ? forward_backward(r, xs[r], ys[r], weights[r]) : forward_backward(r, {}, {}, 0.0);
  });
  allreduce_gradients();  // 4.
  // 5. The same update on every replica.
  workers_.run([&](size_t r) {
    auto span = Trace::scoped(trace_, devices_[r], "optimizer");
    optimizers_[r]->step();
  });
  return losses;
}

// ---- Note [a CUDA graph per replica] ---------------------------------------------------------

void ScratchTrainer::set_cuda_graph(bool on) {
  invalidate_cuda_graph();
  graph_on_ = on;
  graph_reason_.clear();
  if (!on) return;
  for (Device d : devices_)
    if (!d.is_cuda()) graph_reason_ = "CUDA graphs need GPUs, " + d.str() + " is not one";
  if (graph_reason_.empty() && devices_.size() > 1 && comm_->name() != "nccl")
    graph_reason_ = "the " + comm_->name() + " communicator's copies between devices cannot be captured per device; " +
                    (shares_a_gpu(devices_) ? "nccl, whose collectives can be, refuses devices that share a GPU" : "use nccl");
  for (const auto& opt : optimizers_)
    if (graph_reason_.empty() && !opt->capturable())
      graph_reason_ = "the optimizers are not capturable (a new learning rate would not reach the replays)";
  if (!graph_reason_.empty() && devices_[0].is_cuda())
    std::fprintf(stderr, "tandem: CUDA graphs off, steps run eagerly: %s\n", graph_reason_.c_str());
}

void ScratchTrainer::invalidate_cuda_graph() noexcept {
  for (auto& g : graphs_) g->reset();
}

void ScratchTrainer::graphs_off(std::string reason) {
  graph_reason_ = std::move(reason);
  invalidate_cuda_graph();
  std::fprintf(stderr, "tandem: CUDA graphs off, steps run eagerly: %s\n", graph_reason_.c_str());
}

bool ScratchTrainer::graph_matches(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) const {
  if (graph_x_.empty()) return true;  // nothing captured yet: any shapes
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (xs[r].shape() != graph_x_[r].shape() || xs[r].dtype() != graph_x_[r].dtype()) return false;
    if (ys[r].shape() != graph_y_[r].shape() || ys[r].dtype() != graph_y_[r].dtype()) return false;
  }
  return true;
}

std::vector<Tensor> ScratchTrainer::graphed_step(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                                                 const std::vector<double>& weights) {
  // Other shard shapes (the short last batch) run eagerly, also when a capture is due.
  if (!graph_matches(xs, ys)) return eager_step(xs, ys, weights);
  const bool captured = !graphs_.empty() && graphs_[0]->captured();
  if (!captured && graph_warmup_left_ > 0) {
    --graph_warmup_left_;
    return eager_step(xs, ys, weights);
  }
  if (graph_x_.empty()) {
    for (size_t r = 0; r < devices_.size(); ++r) {
      graph_x_.push_back(empty(xs[r].shape(), xs[r].dtype(), devices_[r]));
      graph_y_.push_back(empty(ys[r].shape(), ys[r].dtype(), devices_[r]));
      graph_loss_.push_back(zeros({}, kFloat32, devices_[r]));
      graphs_.push_back(std::make_unique<CUDAGraph>());
    }
  }
  for (size_t r = 0; r < devices_.size(); ++r) {
    DeviceGuard device(devices_[r]);
    graph_x_[r].copy_(xs[r]);
    graph_y_[r].copy_(ys[r]);
  }
  if (!captured && !capture(weights)) return eager_step(xs, ys, weights);  // the capture ran nothing
  for (const auto& g : graphs_) g->replay();  // each on its device's stream
  ++graph_replays_;
  // The next replay overwrites the buffers: the caller gets a loss of its own (the other
  // replicas' are copied to the first device anyway).
  std::vector<Tensor> losses = graph_loss_;
  losses[0] = losses[0].clone();
  return losses;
}

// One capture per device: each worker begins it on its stream and records its replica's
// forward and backward; NCCL's allreduce, enqueued from here on the capturing streams, goes
// into every graph; each worker records its optimizer step and ends its capture. Work is
// recorded, not run: the first replay is this batch's step.
bool ScratchTrainer::capture(const std::vector<double>& weights) {
  std::string failure;
  try {
    workers_.run([&](size_t r) {
      graphs_[r]->capture_begin(devices_[r]);
      graph_loss_[r].copy_(forward_backward(r, graph_x_[r], graph_y_[r], weights[r]));
    });
    allreduce_gradients();
    workers_.run([&](size_t r) {
      optimizers_[r]->step();
      graphs_[r]->capture_end();
    });
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (failure.empty()) {
    ++graph_captures_;
    return true;
  }
  // A capture is ended by the thread that began it.
  workers_.run([&](size_t r) { graphs_[r]->capture_abort(); });
  graphs_off("the step could not be captured: " + failure);
  return false;
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
