#include "parallel/tensor_parallel_comm.h"

#include <numeric>

#include "core/error.h"
#include "parallel/comm.h"
#include "parallel/distributed/process_group.h"
#include "parallel/scatter.h"

namespace tandem::parallel {

namespace {

// Every shard on the devices of one process.
class DeviceShards final : public TensorParallelComm {
 public:
  explicit DeviceShards(Communicator& comm) : comm_(&comm), ranks_(comm.size()) {
    std::iota(ranks_.begin(), ranks_.end(), 0);
  }
  int world_size() const override { return static_cast<int>(comm_->size()); }
  const std::vector<int>& ranks() const override { return ranks_; }
  const std::vector<Device>& devices() const override { return comm_->devices(); }
  void allreduce_sum(const std::vector<Tensor>& ts) const override { comm_->allreduce_sum(ts); }
  const char* unit() const override { return "device"; }

 private:
  Communicator* comm_;
  std::vector<int> ranks_;
};

// One shard per process: this rank's.
class RankShard final : public TensorParallelComm {
 public:
  explicit RankShard(std::shared_ptr<distributed::ProcessGroup> group)
      : group_(std::move(group)), ranks_{group_->rank()}, devices_{group_->device()} {}
  int world_size() const override { return group_->size(); }
  const std::vector<int>& ranks() const override { return ranks_; }
  const std::vector<Device>& devices() const override { return devices_; }
  void allreduce_sum(const std::vector<Tensor>& ts) const override {
    TANDEM_CHECK(ts.size() == 1, Value, "tensor-parallel allreduce on rank ", group_->rank(), ": ",
                 ts.size(), " tensors for the one shard of this rank");
    // On a GPU the current stream waits for the collective (no host sync); on the CPU the host.
    group_->allreduce(ts[0], ReduceOp::Sum)->wait();
  }
  const char* unit() const override { return "rank"; }

 private:
  std::shared_ptr<distributed::ProcessGroup> group_;
  std::vector<int> ranks_;
  std::vector<Device> devices_;
};

}  // namespace

std::shared_ptr<TensorParallelComm> tensor_parallel_comm(Communicator& comm) {
  return std::make_shared<DeviceShards>(comm);
}

std::shared_ptr<TensorParallelComm> tensor_parallel_comm(
    std::shared_ptr<distributed::ProcessGroup> group) {
  TANDEM_CHECK(group != nullptr, Value, "tensor_parallel_comm: no process group");
  return std::make_shared<RankShard>(std::move(group));
}

std::pair<int64_t, int64_t> tensor_parallel_range(int64_t features, int world_size, int rank) {
  TANDEM_CHECK(world_size >= 1 && features >= world_size, Value, "tensor_parallel_range: ",
               features, " features over ", world_size, " shards; every shard needs one");
  TANDEM_CHECK(rank >= 0 && rank < world_size, Value, "tensor_parallel_range: shard ", rank,
               " of ", world_size);
  const auto sizes = split_sizes(features, static_cast<size_t>(world_size));
  int64_t begin = 0;
  for (int r = 0; r < rank; ++r) begin += sizes[static_cast<size_t>(r)];
  return {begin, begin + sizes[static_cast<size_t>(rank)]};
}

}  // namespace tandem::parallel
