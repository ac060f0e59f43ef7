#pragma once
// FullyShardedDataParallel: parameters sharded per unit, PyTorch's torch.distributed.fsdp by
// name and shape (ZeRO-3; docs/12-sharding.md).
//
//   FullyShardedDataParallel fsdp(model, ctx.group);  // FULL_SHARD, as PyTorch's default
//   nn::optim::Adam opt(fsdp.parameters(), 1e-3);   // the flat shards, one per unit
//   for (...) {
//     opt.zero_grad();
//     cross_entropy(fsdp(x), y).backward();         // x: this rank's shard of the batch
//     opt.step();                                   // steps the shards only
//   }
//   { auto full = fsdp.summon_full_params(); save(*model); }
//
// Units: each child of a Sequential root that has trainable parameters (FSDP's auto-wrap of
// every child), or the whole module otherwise. A unit's parameters are laid out as one flat
// buffer padded to N * S, S = ceil(n / N) (Note [zero layout] in zero_optimizer.cpp); rank r
// keeps elements [r S, (r + 1) S) as a leaf tensor, the unit's flat parameter, which the
// optimizer steps, so its state exists for the shard only. The module's parameters are views of
// one Storage per unit that holds bytes only while the unit is gathered (Note [fsdp parameter
// views], Note [releasing a storage] in core/storage.h).
//
//   forward   before each unit runs, its flat parameter is all-gathered into its Storage (every
//             forward: the shards may have been stepped since); with forward_prefetch the next
//             unit's all-gather is issued before this unit computes;
//   after     FULL_SHARD (reshard_after_forward): the unit's Storage is released right after its
//             forward, although autograd's saved tensors alias it: the bytes go (not the last
//             unit's, whose backward comes next, as PyTorch keeps the root unsharded);
//   backward  FULL_SHARD: a hook on the unit's output gradient gathers the unit again into the
//             same Storage before its backward runs (BACKWARD_PRE prefetch: the previous unit's
//             all-gather is issued first); once all of a unit's gradients are final (gradient
//             hooks), they are packed, the unit is released, and they are reduce-scattered
//             (average, DDP's) in unit order on every rank and added into the flat parameter's
//             .grad (BACKWARD_POST prefetch: the previous unit's all-gather is issued then);
//   no grad   (eval, NoGradGuard) a unit is released right after its forward.
// Every rank issues the same collectives in the same order: the graphs are the same, and the
// engine runs them in a fixed order.
//
// Strategies (PyTorch's ShardingStrategy):
//   FULL_SHARD     parameters, gradients and optimizer state sharded; a unit is whole only
//                  during its forward and its backward (ZeRO-3). The default.
//   SHARD_GRAD_OP  parameters sharded at rest, whole from a unit's forward to its backward;
//                  gradients and optimizer state sharded (ZeRO-2 plus parameters at rest).
//   NO_SHARD       nothing sharded: each unit's parameters live in its flat parameter, gradients
//                  are allreduced per unit (DDP).
// Outside forward, backward and summon_full_params() the module's sharded parameters hold no
// bytes: a kernel that reads one then is a ValueError naming it (Tensor::raw_data).
// BatchNorm buffers are not broadcast in forward.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/stream.h"
#include "nn/module.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel {
class Trace;
}

namespace tandem::parallel::sharded {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD };
const char* sharding_strategy_name(ShardingStrategy s);
// When backward issues the all-gather of the unit it needs next (PyTorch's BackwardPrefetch):
// BACKWARD_PRE before the current unit's gradients are computed (more memory: two units whole
// during them), BACKWARD_POST after (once the current unit is released).
enum class BackwardPrefetch { BACKWARD_PRE, BACKWARD_POST };

struct FullyShardedDataParallelOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  // Release each unit after its forward and gather it again before its backward. Unset: the
  // strategy's (FULL_SHARD true, the others false); true with NO_SHARD is a ValueError.
  std::optional<bool> reshard_after_forward;
  // Unset: no prefetch in backward (each unit gathered when its backward begins).
  std::optional<BackwardPrefetch> backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  // Issue the next unit's all-gather before the current unit's forward computes.
  bool forward_prefetch = false;
};

// Bytes one rank holds now, from the tensors it holds.
struct FsdpMemory {
  int rank = 0, world_size = 1;
  int64_t numel = 0;            // Ψ
  int64_t shard_numel = 0;      // this rank's flat parameters, padding included
  int64_t parameters = 0;       // the module's parameters that hold bytes now
  int64_t flat_parameters = 0;  // the flat parameters (shards)
  int64_t gradients = 0;        // the module's parameters' .grad plus the flat ones'
  int64_t element_size = 4;     // of the parameters' dtype (DDP's figures: numel times this)
  std::string str() const;
};

class FullyShardedDataParallel {
 public:
  // Broadcasts rank 0's parameters and buffers, builds the units and their shards, and (when
  // sharded) releases the module's parameters. ValueError for NO_SHARD with
  // reshard_after_forward, a module without trainable parameters, parameters of several dtypes
  // or on another device than the group's.
  FullyShardedDataParallel(std::shared_ptr<nn::Module> module,
                           std::shared_ptr<distributed::ProcessGroup> group,
                           FullyShardedDataParallelOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // The flat parameters, one per unit: what the optimizer steps.
  std::vector<Tensor> parameters() const;
  size_t num_units() const { return units_.size(); }
  // Unit u: its parameters' count n and this rank's shard length S.
  int64_t unit_numel(size_t u) const { return units_.at(u).numel; }
  int64_t unit_shard_numel(size_t u) const { return units_.at(u).shard; }
  // Unit u's parameters (the module's), in their order in its flat buffer (fsdp_state_dict.h).
  const std::vector<Tensor>& unit_parameters(size_t u) const { return units_.at(u).params; }

  // RAII: every unit's parameters whole (all-gathered) while alive, released again after. Not
  // between a forward and its backward (the release would leave the backward nothing to read:
  // a ValueError naming the parameter).
  class FullParams {
   public:
    explicit FullParams(FullyShardedDataParallel& fsdp);
    ~FullParams();
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    FullyShardedDataParallel& fsdp_;
  };
  FullParams summon_full_params() { return FullParams(*this); }

  nn::Module& module() { return *module_; }
  distributed::ProcessGroup& process_group() { return *group_; }
  const FullyShardedDataParallelOptions& options() const { return options_; }
  FsdpMemory memory() const;
  bool reshard_after_forward() const { return reshard_; }

  // Spans per unit on the trace's device (null: none): "gather u" and "reduce-scatter u" (or
  // "allreduce u") on track "comm" from issue to wait, "forward u", "backward u" (FULL_SHARD:
  // from the gathered unit to its final gradients) and "free u" on track "compute".
  void set_trace(Trace* trace) { trace_ = trace; }

 private:
  struct Unit {
    nn::Module* module = nullptr;  // the child (or the root)
    std::vector<Tensor> params;
    std::vector<int64_t> offset;
    int64_t numel = 0, shard = 0;
    Tensor flat_param;  // [S] a leaf: the optimizer's parameter
    Tensor full;        // [N S] on the Storage the parameters view (sharded strategies)
    bool current = false;  // full holds the all-gathered shards of this forward or backward
    distributed::WorkPtr gathering;  // the all-gather in flight into full
    // During backward:
    size_t pending = 0;
    Tensor staging, incoming;
    distributed::WorkPtr work;
    // Trace: when the all-gather, the backward and the reduce-scatter began.
    Event gather_start{true}, backward_start{true}, reduce_start{true};
    bool backward_open = false;
  };
  bool sharded() const { return options_.sharding_strategy != ShardingStrategy::NO_SHARD; }
  void issue_gather(size_t unit);
  void wait_gather(size_t unit);
  void release(size_t unit);
  Tensor run_unit(size_t unit, nn::Module& m, const Tensor& x, bool backward_follows);
  void pre_backward(size_t unit);
  void begin_backward();
  void on_gradient(size_t unit, size_t slot, const Tensor& grad);
  void launch_ready(bool prefetch);
  void finish_unit(size_t unit);
  void finish_backward();
  Event now() const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  FullyShardedDataParallelOptions options_;
  bool reshard_ = false;
  Trace* trace_ = nullptr;
  std::vector<Unit> units_;
  std::vector<int> unit_of_child_;  // per child of a Sequential root: its unit or -1
  bool sequential_ = false;
  std::vector<std::pair<Tensor, int>> hooks_;  // (parameter, hook id)
  std::vector<std::vector<char>> ready_;
  bool in_backward_ = false;
  size_t next_launch_ = 0, next_finish_ = 0;  // in launch order: units from last to first
};

}  // namespace tandem::parallel::sharded
