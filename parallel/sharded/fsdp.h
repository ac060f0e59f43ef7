#pragma once
// FullyShardedDataParallel: parameters sharded per unit, PyTorch's torch.distributed.fsdp by
// name and shape (ZeRO-3's idea; docs/12-sharding.md).
//
//   FullyShardedDataParallel fsdp(model, ctx.group, {ShardingStrategy::SHARD_GRAD_OP});
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
// optimizer steps, so its state exists for the shard only.
//
//   forward   before each unit runs, its flat parameter is all-gathered into a fresh buffer and
//             the module's parameters become views of it (every forward: the shards may have
//             been stepped since);
//   backward  once all of a unit's gradients are final (gradient hooks), they are packed,
//             reduce-scattered (average, DDP's) in unit order on every rank, added into the flat
//             parameter's .grad, and the module's parameters are released (their storage becomes
//             empty; the memory goes once autograd frees the graph);
//   no grad   (eval, NoGradGuard) a unit is released right after its forward.
//
// Strategies (PyTorch's ShardingStrategy):
//   SHARD_GRAD_OP  parameters sharded at rest, whole from a unit's forward to its backward;
//                  gradients and optimizer state sharded (ZeRO-2 plus parameters at rest).
//   NO_SHARD       nothing sharded: each unit's parameters live in its flat parameter, gradients
//                  are allreduced per unit (DDP).
//   FULL_SHARD     resharding right after forward, gathering again before backward: not built
//                  (a ValueError). Autograd's saved tensors share the parameters' storage, and a
//                  storage cannot release its bytes while they hold it (docs/12-sharding.md).
// Outside forward and backward the module's sharded parameters hold no bytes: read them inside
// summon_full_params(), not otherwise (a kernel on a released parameter reads no memory).
// BatchNorm buffers are not broadcast in forward.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel::sharded {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD };
const char* sharding_strategy_name(ShardingStrategy s);

struct FullyShardedDataParallelOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::SHARD_GRAD_OP;
  // Unset: the strategy's (FULL_SHARD true, the others false). true is not built.
  std::optional<bool> reshard_after_forward;
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
  // sharded) releases the module's parameters. ValueError for FULL_SHARD or
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

  // RAII: every unit's parameters whole (all-gathered) while alive, released again after.
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

 private:
  struct Unit {
    nn::Module* module = nullptr;  // the child (or the root)
    std::vector<Tensor> params;
    std::vector<int64_t> offset;
    int64_t numel = 0, shard = 0;
    Tensor flat_param;  // [S] a leaf: the optimizer's parameter
    bool gathered = false;
    // During backward:
    size_t pending = 0;
    Tensor staging, incoming;
    distributed::WorkPtr work;
  };
  bool sharded() const { return options_.sharding_strategy != ShardingStrategy::NO_SHARD; }
  void gather(Unit& u);
  void release(Unit& u);
  void on_gradient(size_t unit, size_t slot, const Tensor& grad);
  void launch_ready();
  void finish_unit(Unit& u);
  void finish_backward();

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<distributed::ProcessGroup> group_;
  FullyShardedDataParallelOptions options_;
  std::vector<Unit> units_;
  std::vector<int> unit_of_child_;  // per child of a Sequential root: its unit or -1
  bool sequential_ = false;
  std::vector<std::pair<Tensor, int>> hooks_;  // (parameter, hook id)
  std::vector<std::vector<char>> ready_;
  bool in_backward_ = false;
  size_t next_launch_ = 0, next_finish_ = 0;  // in launch order: units from last to first
};

}  // namespace tandem::parallel::sharded
