#pragma once
// The whole state of a FullyShardedDataParallel model and of the optimizer over its flat
// parameters, for checkpoints: PyTorch's FSDP full state dicts (StateDictType.FULL_STATE_DICT,
// rank0_only) by name and argument order.
//
//   full_state_dict(fsdp, to)                  the module's state_dict(), whole (copies), on rank
//                                              `to`; {} elsewhere. Every rank calls it (the
//                                              units are all-gathered for it, as for a forward).
//   load_full_state_dict(fsdp, state)          every rank passes the whole state and keeps its
//                                              shard of each unit (load()'s checks first).
//   full_optim_state_dict(fsdp, optim, to)     the optimizer's state in the layout of a plain
//                                              optimizer over module().parameters(), on `to`,
//                                              gathered one shard at a time (Note [sharded
//                                              optimizer state] in shard_state.h).
//   shard_full_optim_state_dict(full, fsdp)    the other way: this rank's state over the flat
//                                              parameters, for optim.load_state_dict().
// So a checkpoint of an FSDP run is the file a plain (or DDP, or ZeRO) run writes, and loads
// into any of them at any world size.
#include <string>

#include "nn/module.h"
#include "nn/optim/optimizer.h"
#include "parallel/sharded/fsdp.h"

namespace tandem::parallel::sharded {

nn::StateDict full_state_dict(FullyShardedDataParallel& fsdp, int to = 0);
// Messages start with `source` and name the tensor as prefix + its state-dict name
// (nn::load_checked); nothing changes when a tensor does not fit.
void load_full_state_dict(FullyShardedDataParallel& fsdp, const nn::StateDict& state,
                          const std::string& source = "state_dict", const std::string& prefix = "");

// optim: the optimizer over fsdp.parameters() (in that order).
nn::StateDict full_optim_state_dict(FullyShardedDataParallel& fsdp,
                                    const nn::optim::Optimizer& optim, int to = 0);
// ValueError naming the entry for a state that a unit's parameters hold only in part.
nn::StateDict shard_full_optim_state_dict(const nn::StateDict& full,
                                          FullyShardedDataParallel& fsdp);

}  // namespace tandem::parallel::sharded
