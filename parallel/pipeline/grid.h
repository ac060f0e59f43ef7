#pragma once
// Pipeline stages x data-parallel replicas: a grid of P * D processes.
//
//   auto ctx = distributed::init_process_group("gloo", kCPU);      // 4 ranks under tandem-run
//   pipeline::GridLayout grid(ctx.group, /*num_stages=*/2, /*num_replicas=*/2);
//   auto stage = pipeline::stage_of_balance(*model, {7, 5}, grid.stage(), kCPU);
//   pipeline::GridPipeline pipe(stage, pipeline::schedule_1f1b(2, 4), loss_fn, grid);
//   Tensor loss = pipe.step(x, y);   // every rank passes the same global batch
//
// Note [grid layout]
// Rank r of the world is stage r / D of replica r % D (rank = stage * D + replica): the
// replicas of one stage are neighbours in rank order (on one host, the GPUs that allreduce
// most are adjacent). The pipeline group of replica d is the ranks {d, D + d, 2D + d, ...}
// (stage s is rank s of it) and carries activations and gradients (ProcessPipeline); the
// data-parallel group of stage s is {s*D, ..., s*D + D - 1} and averages that stage's gradients.
// Every rank makes the D + P new_group calls in the same order (pipelines, then stages).
//
// Note [grid gradient averaging]
// A stage's gradients are averaged explicitly after the pipeline step, not by DDP: DDP's
// forward arms one reduction for the next backward, while a pipeline step runs M forwards and
// M backwards on each stage (interleaved under 1F1B), and the gradient is only complete after
// the last of them. One allreduce per parameter after the step reduces the sum of the M
// micro-batches' contributions, once. Each replica takes its rows of the global batch as DDP's
// sampler splits it (contiguous, sizes differing by at most one), and its loss is scaled by
// D * b_d / B (b_d its rows, B the global batch) so that the average over replicas is the
// gradient of the mean loss over the global batch, uneven shards included. The cost: the
// allreduce does not overlap the backward (a bucketed overlap would start it at the last
// micro-batch's backward of each parameter).
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "parallel/distributed/process_group.h"
#include "parallel/pipeline/process_boundary.h"

namespace tandem::parallel::pipeline {

class GridLayout {
 public:
  // ValueError unless num_stages * num_replicas == world->size() (both named) and both >= 1.
  // Collective over `world`: every rank calls it with the same numbers.
  GridLayout(std::shared_ptr<distributed::ProcessGroup> world, int num_stages, int num_replicas);

  int num_stages() const { return num_stages_; }
  int num_replicas() const { return num_replicas_; }
  int stage() const { return stage_; }      // world rank / num_replicas
  int replica() const { return replica_; }  // world rank % num_replicas
  // This replica's stages, one per rank (rank s = stage s).
  const std::shared_ptr<distributed::ProcessGroup>& pipeline_group() const { return pipeline_group_; }
  // This stage's replicas (rank d = replica d).
  const std::shared_ptr<distributed::ProcessGroup>& data_group() const { return data_group_; }
  // The world rank of (stage, replica): stage * num_replicas + replica (Note [grid layout]).
  int rank_of(int stage, int replica) const { return stage * num_replicas_ + replica; }
  // Replica d's rows [begin, end) of a global batch of `batch` rows.
  std::pair<int64_t, int64_t> shard(int64_t batch, int replica) const;

 private:
  int num_stages_, num_replicas_, stage_, replica_;
  std::shared_ptr<distributed::ProcessGroup> pipeline_group_, data_group_;
};

// This rank's stage of its replica's pipeline, with the stage's gradients averaged over the
// replicas after every step (Note [grid gradient averaging]).
class GridPipeline {
 public:
  // ValueError as ProcessPipeline (the schedule has grid.num_stages() stages). `grid` must
  // outlive the GridPipeline.
  GridPipeline(Stage stage, Schedule schedule, LossFn loss_fn, const GridLayout& grid);

  // One step on the global batch (x, target), the same on every rank: this replica's shard
  // through the pipeline, then the stage's gradients averaged in the data-parallel group.
  // ValueError when the batch has fewer rows than replicas * micro-batches. Returns the mean
  // loss over the global batch on every rank (group device); `losses` gets this replica's
  // micro-batch mean losses.
  Tensor step(const Tensor& x, const Tensor& target, std::vector<Tensor>* losses = nullptr);

  const ProcessPipeline& pipeline() const { return pipe_; }

 private:
  const GridLayout& grid_;
  double scale_ = 1.0;  // D * b_d / B of the current step
  ProcessPipeline pipe_;
};

}  // namespace tandem::parallel::pipeline
