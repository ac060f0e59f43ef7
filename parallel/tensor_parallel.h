#pragma once
// Tensor parallelism in one process: one Linear's weight split across devices, Megatron-LM's
// way (Shoeybi et al. 2019, section 3), over an in-process Communicator.
//
// Two autograd functions carry it, each the other's mirror (Megatron's f and g):
//   copy_to_tensor_parallel_region      (f)  forward: identity     backward: allreduce
//   reduce_from_tensor_parallel_region  (g)  forward: allreduce    backward: identity
// An MLP then splits with one allreduce each way:
//   x (same on every device) -> f -> ColumnParallelLinear (rows of W1 per device) -> ReLU
//     -> RowParallelLinear (columns of W2 per device) -> g -> y (same on every device)
// ColumnParallelLinear's output stays split (Megatron's gather_output=false) and is exactly
// the input RowParallelLinear wants (input_is_parallel=true): the ReLU between them runs on
// each shard, no communication.
//
// Note [tensor-parallel ranks in one graph]
// f and g are written for *ranks*: every rank holds the same input, computes the same loss,
// and backpropagates its own copy of it with gradient 1; g's identity backward is right only
// under that rule. In one process the devices play the ranks, and their losses L_r, equal in
// value, are seeded with 1 each by one backward of sum_r L_r (the value is n times the loss;
// report L_0). Every replicated layer (those outside the split) then receives the whole
// gradient on every device, so its replicas stay equal under the same optimizer step, and
// each shard receives its own part of the unsplit layer's gradient.
//
// The shards compute one after another on the calling thread here (the backward engine runs
// there too); one process per GPU computes them at the same time with the same two functions
// over a process group. The Communicator must outlive the graphs these functions record.
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "nn/linear.h"
#include "parallel/comm.h"

namespace tandem::parallel {

// f: xs[i] on comm.devices()[i] (the same values on each); returns them as they are, and in
// backward replaces every device's gradient by the sum over devices. ValueError unless there
// is one tensor per device, on it.
std::vector<Tensor> copy_to_tensor_parallel_region(Communicator& comm,
                                                   const std::vector<Tensor>& xs);
// g: partials[i] on comm.devices()[i]; returns their sum on every device, and in backward
// hands each device's gradient to its own partial unchanged.
std::vector<Tensor> reduce_from_tensor_parallel_region(Communicator& comm,
                                                       const std::vector<Tensor>& partials);

// Y = X W^T + b with W's rows (the output features) split over the devices: shard i holds
// rows [o_i, o_i + n_i) of `full`'s weight and bias, n_i = split_sizes(out_features, n).
class ColumnParallelLinear {
 public:
  // Copies full's values into the shards, each on its device. ValueError when there are
  // fewer output features than devices.
  ColumnParallelLinear(const nn::Linear& full, Communicator& comm);
  // xs[i]: [N, in] on device i, the same on each. Returns [N, n_i] per device (not gathered).
  std::vector<Tensor> forward(const std::vector<Tensor>& xs);
  std::vector<Tensor> operator()(const std::vector<Tensor>& xs) { return forward(xs); }

  const std::vector<std::shared_ptr<nn::Linear>>& shards() const { return shards_; }
  std::vector<Tensor> parameters() const;
  // The shards put back together, on the CPU: [out, in] and [out] (undefined without bias).
  Tensor full_weight() const;
  Tensor full_bias() const;

 private:
  Communicator* comm_;
  std::vector<std::shared_ptr<nn::Linear>> shards_;
};

// Y = X W^T + b with W's columns (the input features) split over the devices: shard i holds
// columns [c_i, c_i + n_i) of `full`'s weight, n_i = split_sizes(in_features, n). The bias is
// kept once, in shard 0, and so added once before the sum (Megatron adds it after the
// allreduce on every rank: the same numbers, rounded in another order).
class RowParallelLinear {
 public:
  // Copies full's values into the shards. ValueError when there are fewer input features than
  // devices.
  RowParallelLinear(const nn::Linear& full, Communicator& comm);
  // xs[i]: [N, n_i] on device i (a ColumnParallelLinear's output). Returns [N, out] on every
  // device, the same values on each.
  std::vector<Tensor> forward(const std::vector<Tensor>& xs);
  std::vector<Tensor> operator()(const std::vector<Tensor>& xs) { return forward(xs); }

  const std::vector<std::shared_ptr<nn::Linear>>& shards() const { return shards_; }
  std::vector<Tensor> parameters() const;
  Tensor full_weight() const;  // [out, in] on the CPU
  Tensor full_bias() const;    // [out] on the CPU, undefined without bias

 private:
  Communicator* comm_;
  std::vector<std::shared_ptr<nn::Linear>> shards_;
};

}  // namespace tandem::parallel
