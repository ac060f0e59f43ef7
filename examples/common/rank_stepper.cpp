// RankStepper (rank_stepper.h): the part of a data-parallel rank's step that does not depend on
// how the model's state is kept.
#include "common/rank_stepper.h"

#include <algorithm>
#include <vector>

#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/distributed/collective_graph.h"

namespace tandem::examples {

namespace dist = parallel::distributed;

std::shared_ptr<nn::Module> build_model(const TrainConfig& cfg) {
  std::shared_ptr<nn::Module> m = cfg.make_model();
  if (cfg.channels_last) m->to(MemoryFormat::ChannelsLast);
  return m;
}

dist::DistributedDataParallelOptions ddp_options(const TrainConfig& cfg) {
  dist::DistributedDataParallelOptions o;
  o.bucket_cap_mb = cfg.bucket_cap_mb;
  o.first_bucket_cap_mb = std::min(1.0, cfg.bucket_cap_mb);
  o.overlap = cfg.overlap;
  return o;
}

namespace {

// Traces only the first few steps of the run (as the one-process steppers).
constexpr int64_t kTracedSteps = 5;

}  // namespace

// Note [a CUDA graph per DDP rank]: on a GPU with NCCL the rank's whole step -- the gather of
// its rows, forward, backward with the bucket allreduces, the optimizer, the epoch's sums -- is
// captured after two eager steps and replayed, as one device's step is (Note [the one-device
// step] in steppers.cpp); parallel/distributed/collective_graph.h says how the group keeps
// numbering and watching the collectives a replay runs. What the step reads from the host
// lives on the device, so one graph serves every full batch: the learning rate and Adam's step
// count (a capturable optimizer), and the loss scale of an uneven shard (world * rows / global
// rows), a fill before each step -- a rank whose last shard has a full batch's rows but a
// smaller global batch replays with its own scale. Traced steps run eagerly (a graph's spans
// would time the capture), as do a Gloo group's (host collectives) and the steps of ZeRO and
// FSDP, whose hooks have not been made graph-safe.
RankStepper::RankStepper(const TrainConfig& cfg, bool graphable)
    : group_(cfg.group),
      seed_(cfg.seed),
      graphed_(graphable && cfg.cuda_graph && cfg.trace.empty() && cfg.group != nullptr &&
               cfg.group->device().is_cuda()),
      graph_([this](const std::vector<Tensor>& in) { train_step(in[0], {in[1], in[2]}, in[3], in[4], in[5]); },
             {/*warmup_steps=*/2, /*enabled=*/graphed_},
             std::make_unique<dist::CollectiveGraph>(std::vector<std::shared_ptr<dist::ProcessGroup>>{cfg.group})) {
  TANDEM_CHECK(group_ != nullptr, Value, "RankStepper: no process group");
  const Device d = group_->device();
  scale_ = zeros({}, kFloat32, d);
  if (graphed_) {
    const std::string why = dist::CollectiveGraph({group_}).why_not(d);
    if (!why.empty()) {
      graphed_ = false;
      graph_.disable(why);
      if (group_->rank() == 0) std::fprintf(stderr, "tandem: CUDA graph off, steps run eagerly: %s\n", why.c_str());
    }
  }
  if (!cfg.trace.empty()) {
    trace_ = std::make_unique<parallel::Trace>(
        d, group_->rank(), "rank " + std::to_string(group_->rank()) + " " + d.str());
    group_->set_trace(trace_.get());
  }
}

std::shared_ptr<data::DistributedSampler> RankStepper::sampler(int64_t n, bool train) {
  if (train)
    return std::make_shared<data::DistributedSampler>(n, group_->size(), group_->rank(), true,
                                                      seed_);
  return std::make_shared<data::DistributedSampler>(n, group_->size(), group_->rank(), false, 0,
                                                    false,
                                                    /*pad=*/false);
}

void RankStepper::step(const data::TensorDataset& data, const Tensor& index, int64_t global_rows,
                       const Tensor& loss_sum, const Tensor& correct) {
  const int64_t rows = index.size(0);
  if (rows == 0) return empty_step(data, loss_sum);
  last_index_ = index;
  if (trace_ && traced_steps_++ == kTracedSteps) group_->set_trace(nullptr);
  trace_now_ = trace_ && traced_steps_ <= kTracedSteps ? trace_.get() : nullptr;
  // Note [loss scaling for uneven shards] (parallel/trainer.cpp): DDP, ZeRO and FSDP average
  // the ranks' gradients, so the shard's mean loss is weighted by world * rows / global_rows;
  // the average is then the gradient of the global batch's mean loss, as on one process.
  const double scale = static_cast<double>(group_->size()) * static_cast<double>(rows) / static_cast<double>(global_rows);
  if (scale != scale_value_) {
    scale_.fill_(scale);
    scale_value_ = scale;
  }
  graph_({index}, loss_log_.with({data.images(), data.labels(), loss_sum, correct, scale_}));
  after_step();
}

// One step on the rows `index` of (images, labels), graph-safe (Note [graph-safe steps] in
// core/cuda_graph.h): nothing is kept from it but what it adds into the sums.
void RankStepper::train_step(const Tensor& index, const data::TensorDataset& data, const Tensor& loss_sum,
                             const Tensor& correct, const Tensor& scale) {
  const data::Batch b = data.get(index);
  parallel::Trace* trace = trace_now_;
  const Device d = group_->device();
  zero_grad();
  auto span = parallel::Trace::scoped(trace, d, "forward");
  const AutocastWeightsGuard weights = refresh_and_install(autocast_weights_);
  Tensor logits = forward(b.x);
  Tensor loss = cross_entropy(logits, b.y);
  span = parallel::Trace::scoped(trace, d, "backward");
  mul(loss, scale).backward();
  span = parallel::Trace::scoped(trace, d, "optimizer");
  optimizer_step();
  span = {};
  kernels::axpby_(static_cast<double>(b.x.size(0)), loss.detach(), 1.0, loss_sum);
  kernels::count_correct(logits.detach(), b.y, correct);
  loss_log_.append(loss_sum);
}

// Note [an empty shard]: when the global batch is not a multiple of the world size, the last
// batch of an epoch can leave this rank no rows. It must still take the step -- the other ranks
// wait for its buffer broadcast and its gradient collectives -- and contribute a zero gradient.
// A forward of 0 rows is not possible everywhere (BatchNorm refuses it in training), so the rank
// runs a stand-in, eagerly: two rows of its previous batch with the loss weighted by 0, and puts
// its buffers back afterwards so they do not see the stand-in. The first batch of an epoch
// always gives every rank a row (batch_size >= world size), so a previous batch exists.
void RankStepper::empty_step(const data::TensorDataset& data, const Tensor& loss_sum) {
  TANDEM_CHECK(last_index_.defined(), Value, "data-parallel stepper: this rank's first batch is empty");
  const int64_t n = std::min<int64_t>(2, last_index_.size(0));
  const data::Batch b = data.get(last_index_.slice(0, 0, n));
  std::vector<Tensor> buffers = module().buffers(), saved;
  for (const Tensor& t : buffers) saved.push_back(t.clone());
  zero_grad();
  const AutocastWeightsGuard weights = refresh_and_install(autocast_weights_);
  Tensor loss = cross_entropy(forward(b.x), b.y);
  mul(loss, 0.0).backward();
  optimizer_step();
  for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(saved[k]);
  loss_log_.append(loss_sum);  // the sum as it was: this rank added no rows
  after_step();
}

void RankStepper::sum_across_processes(const Tensor& t) {
  group_->allreduce(t, dist::ReduceOp::Sum)->wait();
}

void RankStepper::broadcast_buffers() {
  std::vector<Tensor> buffers = module().buffers();
  if (!buffers.empty() && group_->size() > 1) dist::broadcast_coalesced(*group_, buffers, 0);
}

nn::Module& RankStepper::eval_model() {
  broadcast_buffers();
  return module();
}

// Every rank hands its timeline to rank 0 through the store; rank 0 writes one file with a
// process (pid = rank) per rank, on the shared host clock (parallel/trace.h).
void RankStepper::write_trace(const std::string& path) {
  if (!trace_) return;
  group_->set_trace(nullptr);
  dist::Store& store = group_->store();
  store.set("trace/" + std::to_string(group_->rank()), trace_->json());
  if (group_->rank() != 0) return;
  std::vector<std::string> parts;
  for (int r = 0; r < group_->size(); ++r)
    parts.push_back(store.get_string("trace/" + std::to_string(r)));
  parallel::write_merged_trace(path, parts);
}

}  // namespace tandem::examples
