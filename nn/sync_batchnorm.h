#pragma once
// SyncBatchNorm: batch norm whose statistics are those of the global batch, over every rank of
// a process group (PyTorch's torch.nn.SyncBatchNorm).
//
// Note [sync batch norm]
// Forward, training: each rank forms, per channel, its shard's mean, its sum of squared
// deviations M2 and its count n (a [2C + 1] tensor: the count is data, never read on the
// host), and one allgather gives every rank every rank's triple. The triples combine into the
// global mean and biased variance by the parallel-variance rule (Chan et al.):
//   N = sum n_r,  mean = sum n_r mean_r / N,  M2 = sum (M2_r + n_r (mean_r - mean)^2),
// which is stable where sum-of-squares minus square-of-sum is not, and in which a rank with
// an empty shard (n_r = 0) adds exactly nothing. The running statistics take the global mean
// and the unbiased global variance M2 / (N - 1), as BatchNorm2d's do for one batch.
// Backward: one allreduce (sum) of [sum dy, sum dy (x - mean)] gives the input gradient of the
// global batch norm:
//   dx = (dy - sum dy / N - (x - mean) invstd^2 sum dy (x - mean) / N) invstd gamma.
// The weight and bias gradients are this rank's own sums, as in PyTorch: DDP's gradient
// allreduce averages them like every other parameter's.
// Everything is composed of the dispatched tensor ops (reductions, elementwise), so the CPU
// (Gloo) and GPU (NCCL) paths are the same code, and nothing reads a device value on the host:
// the collectives are waited on stream-ordered (Work::wait), so a step with SyncBatchNorm can
// be captured in a CUDA graph (PyTorch's version reads the counts on the host and cannot).
//
// Every rank must call forward (and backward) the same number of times, in the same order, even
// with an empty shard: each call is one collective that all ranks of the group join (a rank
// that skips one leaves the others waiting until the group's timeout, which then names it).
// A global batch of at most one value per channel gives a non-finite variance: it cannot be
// refused without reading the counts on the host.
#include <memory>

#include "nn/batchnorm.h"

namespace tandem::parallel::distributed {
class ProcessGroup;
}

namespace tandem::nn {

using parallel::distributed::ProcessGroup;

// The op behind SyncBatchNorm in training mode, always through the group (also for a group of
// one, which gradient checks use): x [N, C, H, W] or [N, C] (N may be 0 on some ranks; float32,
// float64 or bfloat16, whose statistics are float32 as BatchNorm2d's), weight and bias [C]
// (may be undefined), running_mean and running_var [C] updated in place. Differentiable in x,
// weight and bias. The output has x's dtype and memory format.
Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                       const Tensor& running_var, double momentum, double eps,
                       const std::shared_ptr<ProcessGroup>& process_group);

// BatchNorm2d with the statistics of the global batch in training (Note [sync batch norm]).
// A group of one runs BatchNorm2d itself (bit for bit, as PyTorch falls back to batch_norm);
// eval mode uses the running statistics and no collective. Training without a group is a
// ValueError. A SyncBatchNorm is a BatchNorm2d, so Residual and Sequential, which look for
// BatchNorm2d children, run it (and its fused ReLU / conv-bias forms) where they ran one.
class SyncBatchNorm : public BatchNorm2d {
 public:
  explicit SyncBatchNorm(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                         std::shared_ptr<ProcessGroup> process_group = nullptr);
  // A copy of bn (its parameters, buffers, mode and device) that synchronizes over group.
  SyncBatchNorm(const BatchNorm2d& bn, std::shared_ptr<ProcessGroup> process_group);

  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }

  // PyTorch's SyncBatchNorm.convert_sync_batchnorm: every BatchNorm2d of the tree (not already
  // a SyncBatchNorm) replaced in place by a SyncBatchNorm over group, with the same values of
  // parameters and buffers (in new tensors: build the optimizer, and DDP, after converting).
  // Returns module, or the new SyncBatchNorm when module is itself a BatchNorm2d. A null group
  // is a ValueError.
  static std::shared_ptr<Module> convert_sync_batchnorm(std::shared_ptr<Module> module,
                                                        std::shared_ptr<ProcessGroup> process_group);

  std::shared_ptr<Module> clone() const override { return std::make_shared<SyncBatchNorm>(*this); }
  std::string name() const override { return "SyncBatchNorm"; }

 protected:
  Tensor run(const Tensor& x, bool relu, const Tensor& conv_bias, const Tensor& residual) override;

 private:
  std::shared_ptr<ProcessGroup> group_;
  Tensor one_;  // int64 [] 1: what each training forward adds to num_batches_tracked
};

// SyncBatchNorm::convert_sync_batchnorm.
inline std::shared_ptr<Module> convert_sync_batchnorm(std::shared_ptr<Module> module,
                                                      std::shared_ptr<ProcessGroup> process_group) {
  return SyncBatchNorm::convert_sync_batchnorm(std::move(module), std::move(process_group));
}

}  // namespace tandem::nn
