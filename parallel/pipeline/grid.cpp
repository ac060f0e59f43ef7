#include "parallel/pipeline/grid.h"

#include "autograd/ops.h"
#include "core/error.h"

namespace tandem::parallel::pipeline {

GridLayout::GridLayout(std::shared_ptr<distributed::ProcessGroup> world, int num_stages, int num_replicas)
    : num_stages_(num_stages), num_replicas_(num_replicas) {
  TANDEM_CHECK(world != nullptr, Value, "GridLayout: no process group");
  TANDEM_CHECK(num_stages >= 1 && num_replicas >= 1 && num_stages * num_replicas == world->size(), Value,
               "GridLayout: ", num_stages, " stages x ", num_replicas, " replicas = ", num_stages * num_replicas,
               " processes, but the world has ", world->size());
  stage_ = world->rank() / num_replicas;
  replica_ = world->rank() % num_replicas;
  // Note [grid layout]: the same calls in the same order on every rank.
  for (int d = 0; d < num_replicas; ++d) {
    std::vector<int> ranks;
    for (int s = 0; s < num_stages; ++s) ranks.push_back(rank_of(s, d));
    auto g = world->new_group(ranks);
    if (d == replica_) pipeline_group_ = g;
  }
  for (int s = 0; s < num_stages; ++s) {
    std::vector<int> ranks;
    for (int d = 0; d < num_replicas; ++d) ranks.push_back(rank_of(s, d));
    auto g = world->new_group(ranks);
    if (s == stage_) data_group_ = g;
  }
}

std::pair<int64_t, int64_t> GridLayout::shard(int64_t batch, int replica) const {
  const int64_t base = batch / num_replicas_, extra = batch % num_replicas_;
  const int64_t begin = replica * base + std::min<int64_t>(replica, extra);
  return {begin, begin + base + (replica < extra ? 1 : 0)};
}

GridPipeline::GridPipeline(Stage stage, Schedule schedule, LossFn loss_fn, const GridLayout& grid)
    : grid_(grid),
      pipe_(std::move(stage), std::move(schedule),
            // The replica's loss, scaled (Note [grid gradient averaging]); scale_ is set per step.
            loss_fn ? LossFn([this, fn = std::move(loss_fn)](const Tensor& out, const Tensor& y) {
              return mul(fn(out, y), scale_);
            })
                    : LossFn(),
            grid.pipeline_group()) {}

Tensor GridPipeline::step(const Tensor& x, const Tensor& target, std::vector<Tensor>* losses) {
  TANDEM_CHECK(x.defined() && target.defined() && x.dim() >= 1 && target.dim() >= 1, Shape,
               "GridPipeline::step: need an input and a target with a batch dim");
  TANDEM_CHECK(x.size(0) == target.size(0), Shape, "GridPipeline::step: input ", shape_str(x.shape()),
               " and target ", shape_str(target.shape()), " differ in rows");
  const int64_t B = x.size(0);
  const int D = grid_.num_replicas(), M = pipe_.schedule().num_micro_batches;
  TANDEM_CHECK(B >= int64_t(D) * M, Value, "GridPipeline::step: a batch of ", B, " rows for ", D,
               " replicas x ", M, " micro-batches");
  const auto [begin, end] = grid_.shard(B, grid_.replica());
  scale_ = double(D) * double(end - begin) / double(B);
  std::vector<Tensor> mine;
  Tensor loss = pipe_.step(x.slice(0, begin, end), target.slice(0, begin, end), &mine);
  // The M backwards are done: average the accumulated gradients over this stage's replicas.
  const auto& dp = grid_.data_group();
  std::vector<distributed::WorkPtr> works;
  for (const Tensor& p : pipe_.stage().module->parameters()) {
    Tensor g = p.grad();
    if (g.defined()) works.push_back(dp->allreduce(g, distributed::ReduceOp::Avg));
  }
  for (auto& w : works) w->wait();
  // The average of the scaled replica losses is the global batch's mean loss.
  Tensor total = loss.reshape({1}).contiguous().clone();
  dp->allreduce(total, distributed::ReduceOp::Avg)->wait();
  if (losses != nullptr) {
    losses->clear();
    for (const Tensor& l : mine) losses->push_back(mul(l, 1.0 / scale_));
  }
  return total.reshape(Shape{});
}

}  // namespace tandem::parallel::pipeline
