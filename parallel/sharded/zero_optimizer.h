#pragma once
// ZeroRedundancyOptimizer: ZeRO stages 1 and 2 (Rajbhandari et al., 2020), PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer by name and shape.
//
// Data parallelism keeps everything on every rank: Ψ parameters, Ψ gradients and the optimizer
// state (SGD's momentum: Ψ more; Adam's two moments: 2Ψ more). Only the parameters must be
// whole on every rank to run forward and backward; the rest can be sharded:
//
//   stage 1  each rank keeps the optimizer state of its shard only (1/N of it) and updates only
//            its shard of the parameters; the updated shards are all-gathered.
//   stage 2  the gradients too: each bucket's gradient is reduce-scattered the moment backward
//            has finished it, each rank keeps its 1/N and the full gradient is freed.
//
//   auto ctx = parallel::distributed::init_process_group("gloo", kCPU);
//   auto model = make_model();                                   // same architecture everywhere
//   ZeroRedundancyOptimizer opt(model->parameters(),
//                               optimizer_class<nn::optim::Adam>(nn::optim::AdamOptions(1e-3)),
//                               ctx.group);                      // rank 0's parameters everywhere
//   for (...) {
//     opt.zero_grad();
//     cross_entropy((*model)(x), y).backward();                  // x: this rank's shard of the
//     batch opt.step();                                                // reduce-scatter, shard
//     step, all-gather
//   }
//
// Layout (Note [zero layout] in zero_optimizer.cpp): the parameters go into buckets in reverse
// order as DDP's (parallel/reducer.h; stage 1 by default one bucket per dtype and device). A
// bucket of n elements is padded to N * S, S = ceil(n / N), and rank r owns elements
// [r S, (r + 1) S) of it: a contiguous shard of the bucket's flat buffer, any n, any N (the
// padding is zeros that never reach a parameter). Each rank keeps its shards as one flat
// float buffer (the "shard parameters", the fp32 master copy of the ZeRO paper) that the wrapped
// optimizer steps; state made by it therefore exists for the shard alone.
//
// Gradients (Options::gradients_reduced):
//   false (default)  the parameters' .grad are this rank's own gradients: stage 1 reduce-scatters
//                    them (average) in step(), stage 2 during backward. Together with the
//                    all-gather this moves what one allreduce moves (2 (N-1)/N Ψ per rank).
//   true             the gradients are already averaged over the ranks (a DistributedDataParallel
//                    wraps the model, as in PyTorch's usage): step() takes its shard of them, no
//                    reduction. Stage 1 only. Leaving it false beside DDP is also right (an
//                    average of equal values), it only reduces twice.
// The average is DDP's: with uneven batch shards scale each rank's loss (Note [loss scaling for
// uneven shards] in parallel/trainer.cpp). A parameter without a gradient counts as zero (as DDP
// with find_unused_parameters): it differs from a plain optimizer only there.
//
// Stage 2 hangs a gradient hook on every parameter (Tensor::register_grad_hook, called when a
// leaf's gradient is final): the gradient is copied into its bucket's padded staging buffer and
// the parameter's .grad is released; a full bucket is reduce-scattered into this rank's shard
// (in bucket order, the same on every rank), at most two buckets in flight; the shard
// gradients accumulate across backward passes until zero_grad(). After backward the
// parameters have no .grad: only the shard gradients exist. Stage 2 replaces DDP (use the
// bare module; BatchNorm buffers are not broadcast in forward).
//
// Every rank must build the same parameters (names aside: count, shapes, dtypes) in the same
// order; the constructor broadcasts rank 0's values. A failed collective (a dead rank, a
// timeout) surfaces as the process group's DistError from step() or backward, naming the
// collective and the rank.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/optim/optimizer.h"
#include "parallel/distributed/process_group.h"
#include "parallel/sharded/shard_state.h"

namespace tandem::parallel::sharded {

// Builds the wrapped optimizer over the given parameters (the shard parameters): PyTorch's
// optimizer_class plus its keyword arguments.
using OptimizerFactory = std::function<std::unique_ptr<nn::optim::Optimizer>(std::vector<Tensor>)>;

// optimizer_class<nn::optim::SGD>(nn::optim::SGDOptions(0.1).momentum(0.9)),
// optimizer_class<nn::optim::AdamW>(nn::optim::AdamWOptions(1e-3)).
template <typename O, typename Options>
OptimizerFactory optimizer_class(Options options) {
  return [options](std::vector<Tensor> params) -> std::unique_ptr<nn::optim::Optimizer> {
    return std::make_unique<O>(std::move(params), options);
  };
}

struct ZeroRedundancyOptimizerOptions {
  int stage = 1;                   // 1: optimizer state sharded; 2: gradients too
  bool gradients_reduced = false;  // see the header comment (stage 1 only)
  // Bucket cap; unset: stage 1 one bucket per dtype and device (one contiguous shard), stage 2
  // 25 MB (DDP's default).
  std::optional<double> bucket_cap_mb;
};

// Bytes that one rank holds, measured from the tensors it holds (distinct tensors, numel *
// element size), and the same model's figures under DDP.
struct ShardedMemory {
  int rank = 0, world_size = 1, stage = 1;
  int64_t numel = 0;             // Ψ, the model's parameter count
  int64_t shard_numel = 0;       // this rank's shard, padding included
  int64_t parameters = 0;        // the model's parameters (whole on every rank)
  int64_t shard_parameters = 0;  // the flat master shard the wrapped optimizer steps
  int64_t gradients = 0;         // parameters' .grad plus the shard gradients
  int64_t optimizer_state = 0;   // the wrapped optimizer's state tensors
  // DDP on the same model: parameters, gradients and, per element, the same optimizer state.
  int64_t ddp_parameters = 0, ddp_gradients = 0, ddp_optimizer_state = 0;
  // "ZeRO-2 rank 1/3: params 9.7 KiB + shard 3.2 KiB, grads 3.2 KiB, optimizer state 6.5 KiB
  //  (DDP: params 9.7 KiB, grads 9.7 KiB, optimizer state 19.4 KiB)"
  std::string str() const;
};

class ZeroRedundancyOptimizer {
 public:
  // params: the model's trainable parameters, the same list on every rank (ValueError/
  // DistError naming the parameter and the ranks otherwise; an undefined, non-leaf or
  // repeated parameter is a ValueError). ValueError for a stage other than 1 or 2,
  // gradients_reduced with stage 2, or a bucket cap <= 0.
  ZeroRedundancyOptimizer(std::vector<Tensor> params, OptimizerFactory optimizer_class,
                          std::shared_ptr<distributed::ProcessGroup> group,
                          ZeroRedundancyOptimizerOptions options = {});
  ~ZeroRedundancyOptimizer();  // removes the stage-2 hooks
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // reduce_gradients(), the wrapped optimizer's step on the shard, gather_parameters().
  void step();
  // The parameters' .grad and the shard gradients: undefined (default) or zeros.
  void zero_grad(bool set_to_none = true);

  // The pieces of step(), for callers that interleave other work. Stage 1: reduce-scatters the
  // parameters' gradients into the shard gradients (or, gradients_reduced, copies this rank's
  // part); stage 2: nothing (backward did it).
  void reduce_gradients();
  // All-gathers every rank's updated shard into the parameters.
  void gather_parameters();

  // Gathers the whole optimizer state onto rank `to`, one rank's shard at a time (a broadcast
  // from each rank in turn of each state tensor, copied into per-parameter tensors there: `to`
  // holds the whole state once plus one shard; every rank must call it). Afterwards
  // state_dict() on `to` returns it in the layout of a plain optimizer over `params`
  // ("state.<i>.<name>", i the parameter's position, tensors shaped like it), loadable into
  // one; the other ranks hold nothing. ValueError for `to` out of range.
  void consolidate_state_dict(int to = 0);
  // The consolidated state (see above); Error on a rank that holds none (call
  // consolidate_state_dict(to) on every rank first).
  const nn::StateDict& state_dict() const;
  // The other way: every rank passes the whole state in a plain optimizer's layout (a
  // consolidated state_dict(), or a plain optimizer's over the same parameters) and keeps its
  // shard of it. Within a bucket every parameter must have state, or none, and one step count
  // (the shard steps as one tensor); ValueError naming the entry otherwise. Shapes and dtypes
  // are checked by the wrapped optimizer's load_state_dict. Communicates nothing.
  void load_state_dict(const nn::StateDict& state);

  double lr() const { return optim_->lr(); }
  void set_lr(double lr) { optim_->set_lr(lr); }
  const std::vector<Tensor>& params() const { return params_; }
  // The wrapped optimizer (its params() are the shard parameters).
  nn::optim::Optimizer& optim() { return *optim_; }
  const ZeroRedundancyOptimizerOptions& options() const { return options_; }
  distributed::ProcessGroup& process_group() { return *group_; }
  size_t num_buckets() const { return buckets_.size(); }
  // Bucket b: this rank's shard length S and the bucket's unpadded length n.
  int64_t bucket_shard_numel(size_t b) const { return buckets_.at(b).shard; }
  int64_t bucket_numel(size_t b) const { return buckets_.at(b).numel; }

  // What this rank holds now (see ShardedMemory).
  ShardedMemory memory() const;

 private:
  struct Bucket {
    std::vector<size_t> params;   // indices into params_, in bucket order
    std::vector<int64_t> offset;  // offset[k]: params[k]'s first element in the bucket
    int64_t numel = 0, shard = 0;
    Tensor shard_param;  // [shard] view of shard_params_flat_
    Tensor shard_grad;   // [shard] the reduced gradient (undefined when none)
    // Stage 2, during backward:
    size_t pending = 0;
    Tensor staging;   // [N * shard] the bucket's gradients, padded
    Tensor incoming;  // [shard] the reduce-scatter's output
    distributed::WorkPtr work;
  };
  Tensor packed_gradients(const Bucket& b) const;  // [N * shard]
  std::vector<FlatGroup> flat_groups() const;        // the buckets, for shard_state.h
  void attach_shard_grads();
  // Stage 2.
  void on_gradient(size_t param, const Tensor& grad);
  void launch_ready();
  void finish_bucket(Bucket& b);
  void finish_backward();

  std::vector<Tensor> params_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  ZeroRedundancyOptimizerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, slot_of_;  // per parameter
  Tensor shard_params_flat_;                 // [sum of shards]
  std::unique_ptr<nn::optim::Optimizer> optim_;
  std::vector<int> hook_ids_;
  bool in_backward_ = false;
  size_t next_launch_ = 0, next_finish_ = 0;
  std::vector<char> ready_;
  nn::StateDict consolidated_;
  bool has_consolidated_ = false;
};

}  // namespace tandem::parallel::sharded
