#pragma once
// Optimizer state between a plain optimizer's layout and the shards of ZeRO's buckets and FSDP's
// units, shared by ZeroRedundancyOptimizer and the FSDP state dicts (fsdp_state_dict.h).
//
// Note [sharded optimizer state]: a *flat group* (a ZeRO bucket, an FSDP unit) is some of the
// model's parameters laid out one after another and padded to N * S, S = ceil(n / N) (Note [zero
// layout] in zero_optimizer.cpp); rank r's optimizer steps elements [r S, (r + 1) S) as one flat
// parameter, so its state_dict() names "state.<g>.<name>" for group g: tensors [S] like the
// shard, and one "step" count per group (every element steps together). The plain layout is a
// plain optimizer's over the parameters ("state.<i>.<name>", i the parameter's position, each
// tensor shaped like it; Note [optimizer state names] in nn/optim/optimizer.h).
//   gather_optimizer_state   shards -> plain, on one rank: for each group and state kind, each
//                            rank's shard in turn is broadcast and copied into the per-parameter
//                            tensors there, so the gathering rank holds the plain state plus one
//                            shard [S], never a second whole copy, and the others one shard.
//   shard_optimizer_state    plain -> this rank's shard, from the whole state on every rank;
//                            no communication.
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/module.h"
#include "parallel/distributed/process_group.h"

namespace tandem::parallel::sharded {

struct FlatGroup {
  std::vector<size_t> params;   // positions in the plain optimizer's parameter list, in flat order
  std::vector<int64_t> offset;  // offset[k]: params[k]'s first element in the group
  int64_t numel = 0, shard = 0;
};

// local: this rank's optimizer state over one flat parameter per group (state.<g>.<name>);
// group: the ranks that hold the shards, or null when every rank holds every group whole
// (FSDP's NO_SHARD: shard == numel). Every rank calls it; returns the plain layout over `params`
// on rank `to` and an empty dict elsewhere.
nn::StateDict gather_optimizer_state(const nn::StateDict& local, const std::vector<Tensor>& params,
                                     const std::vector<FlatGroup>& groups,
                                     distributed::ProcessGroup* group, int rank, int to);

// full: the plain layout over `params` (a gathered state, or a plain optimizer's); returns
// rank's shard of it (state.<g>.<name>) for a world of `world` ranks. Within a group every
// parameter must have state, or none, and one step count; ValueError naming the entry and
// starting with `who` otherwise ("... of the same <word>", word "bucket" or "unit").
nn::StateDict shard_optimizer_state(const nn::StateDict& full, const std::vector<Tensor>& params,
                                    const std::vector<FlatGroup>& groups, int rank, int world,
                                    const std::string& who, const std::string& word);

}  // namespace tandem::parallel::sharded
