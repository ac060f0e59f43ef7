// The multi-process stepper: this process is one rank of a job, with one device, and trains its
// shard of every global batch through DistributedDataParallel.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "common/stepper.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/dist/ddp.h"
#include "parallel/dist/process_group.h"
#include "parallel/trace.h"

namespace tandem::examples {

namespace {

namespace dist = parallel::dist;

dist::DistributedDataParallelOptions ddp_options(const TrainConfig& cfg) {
  dist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = cfg.bucket_cap_mb;
  o.first_bucket_cap_mb = std::min(1.0, cfg.bucket_cap_mb);
  o.overlap = cfg.overlap;
  return o;
}

// DDP moves the model to the group's device (the training device), broadcasts rank 0's
// weights and reduces the gradients while backward runs (parallel/dist/ddp.h).
class DdpStepper final : public Stepper {
 public:
  explicit DdpStepper(const TrainConfig& cfg)
      : group_(cfg.group), seed_(cfg.seed), ddp_(cfg.make_model(), cfg.group, ddp_options(cfg)) {
    ddp_.train();
    opt_ = make_optimizer(cfg, ddp_.parameters());
    if (!cfg.trace.empty()) {
      const Device d = group_->device();
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

  void step(const Tensor& x, const Tensor& y, int64_t global_rows, const Tensor& loss_sum,
            const Tensor& correct) override {
    const int64_t rows = x.size(0);
    if (rows == 0) return empty_step();
    last_x_ = x;
    last_y_ = y;
    if (trace_ && traced_steps_++ == kTracedSteps) group_->set_trace(nullptr);
    const bool tracing = trace_ && traced_steps_ <= kTracedSteps;
    const Device d = group_->device();
    opt_->zero_grad();
    std::optional<parallel::Trace::Span> span;
    if (tracing) span = trace_->span(d, "forward");
    Tensor logits = ddp_(x);
    Tensor loss = cross_entropy(logits, y);
    if (tracing) span = trace_->span(d, "backward");
    // Note [loss scaling for uneven shards] (parallel/trainer.cpp): DDP averages the ranks'
    // gradients, so the shard's mean loss is weighted by world * rows / global_rows; the
    // average is then the gradient of the global batch's mean loss, as on one process.
    const double scale = static_cast<double>(group_->size()) * static_cast<double>(rows) /
                         static_cast<double>(global_rows);
    mul(loss, scale).backward();
    if (tracing) span = trace_->span(d, "optimizer");
    opt_->step();
    span.reset();
    kernels::axpby_(static_cast<double>(rows), loss.detach(), 1.0, loss_sum);
    kernels::count_correct(logits.detach(), y, correct);
  }

  void sum_across_processes(const Tensor& t) override {
    group_->allreduce(t, dist::ReduceOp::Sum)->wait();
  }

  void set_lr(double lr) override { opt_->set_lr(lr); }

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
  // Note [an empty shard]: when the global batch is not a multiple of the world size, the last
  // batch of an epoch can leave this rank no rows. It must still take the step -- the other
  // ranks wait for its buffer broadcast and its bucket allreduces -- and contribute a zero
  // gradient. A forward of 0 rows is not possible everywhere (BatchNorm refuses it in
  // training), so the rank runs a stand-in: two rows of its previous batch with the loss
  // weighted by 0, and puts its buffers back afterwards so they do not see the stand-in. The
  // first batch of an epoch always gives every rank a row (batch_size >= world size), so a
  // previous batch exists.
  void empty_step() {
    TANDEM_CHECK(last_x_.defined(), Value, "DDP stepper: this rank's first batch is empty");
    const int64_t n = std::min<int64_t>(2, last_x_.size(0));
    std::vector<Tensor> buffers = ddp_.module().buffers(), saved;
    for (const Tensor& b : buffers) saved.push_back(b.clone());
    opt_->zero_grad();
    Tensor loss = cross_entropy(ddp_(last_x_.slice(0, 0, n)), last_y_.slice(0, 0, n));
    mul(loss, 0.0).backward();
    opt_->step();
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
  }

  std::shared_ptr<dist::ProcessGroup> group_;
  uint64_t seed_;
  dist::DistributedDataParallel ddp_;
  std::unique_ptr<nn::optim::Optimizer> opt_;
  Tensor last_x_, last_y_;  // this rank's previous batch (Note [an empty shard])
  std::unique_ptr<parallel::Trace> trace_;
  int64_t traced_steps_ = 0;
  static constexpr int64_t kTracedSteps = 5;  // as the in-process steppers
};

}  // namespace

std::unique_ptr<Stepper> make_ddp_stepper(const TrainConfig& cfg) {
  TANDEM_CHECK(cfg.group, Value, "make_ddp_stepper: no process group");
  TANDEM_CHECK(cfg.devices.size() == 1 && cfg.devices.front() == cfg.group->device(), Value,
               "make_ddp_stepper: the ", cfg.group->backend(), " group works on ",
               cfg.group->device().str(), ", not on the training device");
  return std::make_unique<DdpStepper>(cfg);
}

}  // namespace tandem::examples
