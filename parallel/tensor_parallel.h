#pragma once
// Tensor parallelism: one Linear's weight split across shards, Megatron-LM's way (Shoeybi et
// al. 2019, section 3), over the devices of one process (an in-process Communicator) or one
// rank per shard (a process group). The math here is written once; what it communicates goes
// through TensorParallelComm (tensor_parallel_comm.h), whose only operation is the sum over
// the shards.
//
// Two autograd functions carry it, each the other's mirror (Megatron's f and g):
//   copy_to_tensor_parallel_region      (f)  forward: identity     backward: allreduce
//   reduce_from_tensor_parallel_region  (g)  forward: allreduce    backward: identity
// An MLP then splits with one allreduce each way:
//   x (same on every shard) -> f -> ColumnParallelLinear (rows of W1 per shard) -> ReLU
//     -> RowParallelLinear (columns of W2 per shard) -> g -> y (same on every shard)
// ColumnParallelLinear's output stays split (Megatron's gather_output=false) and is exactly
// the input RowParallelLinear wants (input_is_parallel=true): the ReLU between them runs on
// each shard, no communication.
//
// Note [tensor-parallel ranks in one graph]
// f and g are written for *ranks*: every rank holds the same input, computes the same loss,
// and backpropagates its own copy of it with gradient 1; g's identity backward is right only
// under that rule. Over a process group that is what each rank does (Megatron's semantics). In
// one process the devices play the ranks, and their losses L_r, equal in value, are seeded
// with 1 each by one backward of sum_r L_r (the value is n times the loss; report L_0). Every
// replicated layer (those outside the split) then receives the whole gradient on every shard,
// so its replicas stay equal under the same optimizer step with no communication of their own,
// and each shard receives its own part of the unsplit layer's gradient.
//
// In one process the shards compute one after another on the calling thread (the backward
// engine runs there too); one process per shard computes them at the same time. The
// Communicator or process group must outlive the graphs these functions record.
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "nn/linear.h"
#include "parallel/comm.h"
#include "parallel/tensor_parallel_comm.h"

namespace tandem::parallel {

namespace distributed {
class ProcessGroup;
}

// f: xs[i] for shard comm->ranks()[i], on its device (the same values on every shard); returns
// them as they are, and in backward replaces every shard's gradient by the sum over all shards.
// ValueError unless there is one tensor per shard held here, on its device.
std::vector<Tensor> copy_to_tensor_parallel_region(const std::shared_ptr<TensorParallelComm>& comm,
                                                   const std::vector<Tensor>& xs);
// g: partials[i] for shard comm->ranks()[i]; returns their sum over all shards on every shard,
// and in backward hands each shard's gradient to its own partial unchanged.
std::vector<Tensor> reduce_from_tensor_parallel_region(
    const std::shared_ptr<TensorParallelComm>& comm, const std::vector<Tensor>& partials);

// The same in one process: xs[i] on comm.devices()[i].
std::vector<Tensor> copy_to_tensor_parallel_region(Communicator& comm,
                                                   const std::vector<Tensor>& xs);
std::vector<Tensor> reduce_from_tensor_parallel_region(Communicator& comm,
                                                       const std::vector<Tensor>& partials);
// The same with one rank per shard: x on the group's device.
Tensor copy_to_tensor_parallel_region(const std::shared_ptr<distributed::ProcessGroup>& group,
                                      const Tensor& x);
Tensor reduce_from_tensor_parallel_region(const std::shared_ptr<distributed::ProcessGroup>& group,
                                          const Tensor& partial);

// What ColumnParallelLinear and RowParallelLinear share: the shards of one unsplit Linear held
// by this process (one nn::Linear each, on its shard's device), and their communication.
class TensorParallelLinear {
 public:
  virtual ~TensorParallelLinear() = default;
  // xs[i]: the input of shard comm().ranks()[i], on its device.
  virtual std::vector<Tensor> forward(const std::vector<Tensor>& xs) = 0;
  // The one shard of this process (a process group's rank): ValueError when it holds several.
  Tensor forward(const Tensor& x);
  std::vector<Tensor> operator()(const std::vector<Tensor>& xs) { return forward(xs); }
  Tensor operator()(const Tensor& x) { return forward(x); }

  // shards()[i] is shard comm().ranks()[i].
  const std::vector<std::shared_ptr<nn::Linear>>& shards() const { return shards_; }
  std::vector<Tensor> parameters() const;
  const TensorParallelComm& comm() const { return *comm_; }
  // The shards put back together, on the CPU: [out, in]. ValueError unless this process holds
  // every shard (over a process group, compare a rank's shard with tensor_parallel_range).
  Tensor full_weight() const;

 protected:
  // split_dim 0: W's rows (output features) are split; 1: its columns (input features).
  TensorParallelLinear(const char* name, const nn::Linear& full,
                       std::shared_ptr<TensorParallelComm> comm, int split_dim);
  void check_all_held(const char* what) const;

  const char* name_;
  std::shared_ptr<TensorParallelComm> comm_;
  std::vector<std::shared_ptr<nn::Linear>> shards_;
  int split_dim_;
};

// Y = X W^T + b with W's rows (the output features) split over the shards: shard r holds rows
// tensor_parallel_range(out_features, n, r) of `full`'s weight and bias.
class ColumnParallelLinear final : public TensorParallelLinear {
 public:
  // Copies full's values into the shards held here, each on its device. ValueError when there
  // are fewer output features than shards.
  ColumnParallelLinear(const nn::Linear& full, std::shared_ptr<TensorParallelComm> comm);
  // Every shard, on the devices of comm (one process).
  ColumnParallelLinear(const nn::Linear& full, Communicator& comm)
      : ColumnParallelLinear(full, tensor_parallel_comm(comm)) {}
  // Shard group->rank() of group->size(), on the group's device.
  ColumnParallelLinear(const nn::Linear& full, std::shared_ptr<distributed::ProcessGroup> group)
      : ColumnParallelLinear(full, tensor_parallel_comm(std::move(group))) {}

  using TensorParallelLinear::forward;
  // xs[i]: [N, in], the same on every shard. Returns [N, n_r] per shard (not gathered).
  std::vector<Tensor> forward(const std::vector<Tensor>& xs) override;
  Tensor full_bias() const;  // [out] on the CPU, undefined without bias; as full_weight
};

// Y = X W^T + b with W's columns (the input features) split over the shards: shard r holds
// columns tensor_parallel_range(in_features, n, r) of `full`'s weight. The bias is kept once,
// in shard 0, and so added once before the sum (Megatron adds it after the allreduce on every
// rank: the same numbers, rounded in another order).
class RowParallelLinear final : public TensorParallelLinear {
 public:
  // Copies full's values into the shards held here. ValueError when there are fewer input
  // features than shards.
  RowParallelLinear(const nn::Linear& full, std::shared_ptr<TensorParallelComm> comm);
  RowParallelLinear(const nn::Linear& full, Communicator& comm)
      : RowParallelLinear(full, tensor_parallel_comm(comm)) {}
  RowParallelLinear(const nn::Linear& full, std::shared_ptr<distributed::ProcessGroup> group)
      : RowParallelLinear(full, tensor_parallel_comm(std::move(group))) {}

  using TensorParallelLinear::forward;
  // xs[i]: [N, n_r] for shard r (a ColumnParallelLinear's output). Returns [N, out] on every
  // shard, the same values on each.
  std::vector<Tensor> forward(const std::vector<Tensor>& xs) override;
  // [out] on the CPU (shard 0's), undefined without bias; needs shard 0 held here.
  Tensor full_bias() const;
};

}  // namespace tandem::parallel
