#include "parallel/sharded/fsdp_state_dict.h"

#include <algorithm>
#include <map>

#include "autograd/grad_mode.h"
#include "core/error.h"
#include "nn/serialize.h"
#include "parallel/sharded/shard_state.h"

namespace tandem::parallel::sharded {

namespace {

bool sharded(const FullyShardedDataParallel& fsdp) {
  return fsdp.options().sharding_strategy != ShardingStrategy::NO_SHARD;
}

// The units as flat groups over the module's parameters (positions in module().parameters()):
// each unit's parameters one after another, in its order (fsdp.h).
std::vector<FlatGroup> unit_groups(FullyShardedDataParallel& fsdp, std::vector<Tensor>& params) {
  params = fsdp.module().parameters();
  std::map<const TensorImpl*, size_t> position;
  for (size_t i = 0; i < params.size(); ++i) position[params[i].impl()] = i;
  std::vector<FlatGroup> groups;
  for (size_t u = 0; u < fsdp.num_units(); ++u) {
    FlatGroup g;
    for (const Tensor& p : fsdp.unit_parameters(u)) {
      g.params.push_back(position.at(p.impl()));
      g.offset.push_back(g.numel);
      g.numel += p.numel();
    }
    g.shard = fsdp.unit_shard_numel(u);
    groups.push_back(std::move(g));
  }
  return groups;
}

}  // namespace

nn::StateDict full_state_dict(FullyShardedDataParallel& fsdp, int to) {
  const auto full = fsdp.summon_full_params();
  nn::StateDict out;
  if (fsdp.process_group().rank() != to) return out;
  // Copies: the parameters are released again when `full` goes.
  for (const auto& [name, t] : fsdp.module().state_dict()) out.insert(name, t.clone());
  return out;
}

void load_full_state_dict(FullyShardedDataParallel& fsdp, const nn::StateDict& state,
                          const std::string& source, const std::string& prefix) {
  const auto full = fsdp.summon_full_params();
  nn::load_checked(fsdp.module(), state, source, prefix);  // into the gathered parameters
  if (!sharded(fsdp)) return;  // NO_SHARD: the parameters are views of the flat ones
  // This rank's elements of each unit back into its flat parameter (the gathered buffers go).
  NoGradGuard no_grad;
  const int rank = fsdp.process_group().rank();
  const std::vector<Tensor> flat = fsdp.parameters();
  for (size_t u = 0; u < fsdp.num_units(); ++u) {
    const int64_t shard = fsdp.unit_shard_numel(u), lo = rank * shard;
    const int64_t hi = std::min(lo + shard, fsdp.unit_numel(u));
    int64_t offset = 0;
    for (const Tensor& p : fsdp.unit_parameters(u)) {
      const int64_t s = std::max(lo, offset), e = std::min(hi, offset + p.numel());
      if (s < e)
        flat[u].slice(0, s - lo, e - lo).copy_(p.reshape({-1}).slice(0, s - offset, e - offset));
      offset += p.numel();
    }
  }
}

nn::StateDict full_optim_state_dict(FullyShardedDataParallel& fsdp,
                                    const nn::optim::Optimizer& optim, int to) {
  std::vector<Tensor> params;
  const std::vector<FlatGroup> groups = unit_groups(fsdp, params);
  distributed::ProcessGroup& pg = fsdp.process_group();
  return gather_optimizer_state(optim.state_dict(), params, groups, sharded(fsdp) ? &pg : nullptr,
                                pg.rank(), to);
}

nn::StateDict shard_full_optim_state_dict(const nn::StateDict& full,
                                          FullyShardedDataParallel& fsdp) {
  std::vector<Tensor> params;
  const std::vector<FlatGroup> groups = unit_groups(fsdp, params);
  const bool s = sharded(fsdp);
  return shard_optimizer_state(full, params, groups, s ? fsdp.process_group().rank() : 0,
                               s ? fsdp.process_group().size() : 1, "shard_full_optim_state_dict",
                               "unit");
}

}  // namespace tandem::parallel::sharded
