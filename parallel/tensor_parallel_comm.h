#pragma once
// What tensor-parallel layers communicate through, apart from their math (rule 11: transport
// and policy apart). A tensor-parallel group has world_size() shards, numbered 0..n-1 (the
// Megatron "tensor-model-parallel ranks"); a process holds some of them, each on its device:
//   - over the devices of one process (an in-process Communicator): every shard, shard i on
//     the communicator's device i;
//   - over a process group: one shard, the group's rank, on the group's device.
// The layers (tensor_parallel.h) take one tensor per shard held here, in ranks() order, and
// need one operation: the sum over all shards. So f, g, ColumnParallelLinear and
// RowParallelLinear are written once, and the same code is the one-process teaching version
// and the one-rank-per-shard version Megatron runs.
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::parallel {

class Communicator;
namespace distributed {
class ProcessGroup;
}

class TensorParallelComm {
 public:
  virtual ~TensorParallelComm() = default;
  // Shards in all (the tensor-parallel world size).
  virtual int world_size() const = 0;
  // The shards held by this process, and each one's device (ranks()[i] on devices()[i]).
  virtual const std::vector<int>& ranks() const = 0;
  virtual const std::vector<Device>& devices() const = 0;
  // ts[i] belongs to shard ranks()[i] (on devices()[i]; contiguous, one shape and dtype):
  // afterwards every one holds the elementwise sum over all world_size() shards. In place and
  // stream-ordered (the calling thread's current stream of each device).
  virtual void allreduce_sum(const std::vector<Tensor>& ts) const = 0;
  // What one shard sits on, for error messages: "device" or "rank".
  virtual const char* unit() const = 0;

  // True when this process holds every shard.
  bool holds_all() const { return static_cast<int>(ranks().size()) == world_size(); }
};

// Every shard in this process, over `comm` (which must outlive the result and the graphs
// recorded with it).
std::shared_ptr<TensorParallelComm> tensor_parallel_comm(Communicator& comm);
// This rank's shard of group->size(), over the group's allreduce (kept alive by the result).
std::shared_ptr<TensorParallelComm> tensor_parallel_comm(
    std::shared_ptr<distributed::ProcessGroup> group);

// Shard `rank` of `features` split over world_size shards: [begin, end), the sizes of
// split_sizes (torch.tensor_split's rule: the first features % n shards one larger).
// ValueError when there are fewer features than shards or rank is not one of them.
std::pair<int64_t, int64_t> tensor_parallel_range(int64_t features, int world_size, int rank);

}  // namespace tandem::parallel
