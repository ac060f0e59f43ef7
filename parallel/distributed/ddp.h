#pragma once
// DistributedDataParallel: one process per device, PyTorch's torch.nn.parallel.DDP.
//
//   auto ctx = parallel::distributed::init_process_group("auto", device);        // RANK, WORLD_SIZE, ... from the launcher
//   auto model = nn::models::lenet();
//   parallel::distributed::DistributedDataParallel ddp(model, ctx.group);      // rank 0's weights everywhere
//   nn::optim::SGD opt(ddp.parameters(), 0.1);
//   for (...) {
//     opt.zero_grad();
//     Tensor loss = cross_entropy(ddp(x), y);                 // x: this rank's shard
//     loss.backward();                                        // buckets reduced while backward runs
//     opt.step();                                             // after the last bucket, no host sync
//   }
//
// What each piece does (the d2l stages, across processes):
//   construction  moves the module to the group's device, checks that every rank has the same
//                 parameter names, shapes and dtypes (DistError naming the first difference and
//                 the ranks), broadcasts rank 0's parameters and buffers, and builds the Reducer
//                 (parallel/reducer.h): buckets in reverse order, .grad = bucket views, hooks;
//   forward       broadcasts rank 0's buffers (BatchNorm running statistics; broadcast_buffers)
//                 in one collective per dtype when training, readies the buckets and, under
//                 grad mode outside no_sync, arms the Reducer for the next backward; runs the
//                 module;
//   backward      each bucket's allreduce (average) starts the moment its last gradient is
//                 final, overlapping the rest of backward; at the end every reduction is
//                 waited for on the compute stream (GPU) or by the host (CPU);
//   step          the optimizer sees averaged gradients: every rank applies the same update,
//                 so the replicas stay identical without copying parameters.
//
// The gradient is the average over ranks of each rank's gradient, as in PyTorch. With shards
// of equal size that is the gradient of the global batch's mean loss; with uneven shards scale
// each rank's loss by world_size * b_rank / B (Note [loss scaling for uneven shards] in
// parallel/trainer.cpp; the example driver does).
//
// Which backward is reduced is decided by the forward, as in PyTorch (its
// require_backward_grad_sync and Reducer::prepare_for_backward; Note [the forward arms the
// reducer] in parallel/reducer.h): a forward of this wrapper under grad mode and outside
// no_sync() -- in training or in eval mode -- arms the next backward, which reduces every
// bucket; any other backward accumulates into .grad locally and starts no collective:
//   - a backward through module() directly (its forward did not go through this wrapper), or
//     a second backward of the same graph (retain_graph), on any rank: local gradients;
//   - no_sync() is read by the forward: a forward inside the guard gives a local backward even
//     if the backward runs after the guard is gone, and a forward outside it is reduced even if
//     its backward runs inside a guard;
//   - two forwards before one backward: the second arms again (arming does not stack); the one
//     backward that follows, of either output or of their sum, is reduced once, each
//     parameter's gradient summed over both graphs; a backward after it is local. As in
//     PyTorch, every rank must do the same (a rank whose armed backward reaches no parameter
//     stays armed for the next one).
//
// no_sync(): inside the guard, forward + backward accumulate into the buckets and reduce
// nothing; the first armed backward after it reduces the accumulated sum (gradient
// accumulation over k micro-batches: the same sum of gradients as one batch k times larger,
// up to float rounding).
//
// A parameter that gets no gradient in a backward pass is an error naming it, because the
// other ranks would wait for its bucket forever; with find_unused_parameters it counts as
// zero (found at the end of backward, so its bucket is reduced last).
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "parallel/distributed/process_group.h"
#include "parallel/reducer.h"

namespace tandem::parallel::distributed {

struct DistributedDataParallelOptions {
  bool broadcast_buffers = true;
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool find_unused_parameters = false;
  // false: every bucket is reduced after backward instead of during it (to measure the overlap).
  // A group of one never overlaps (Note [one rank does not overlap] in ddp.cpp).
  bool overlap = true;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> group,
                          DistributedDataParallelOptions options = {});
  ~DistributedDataParallel();

  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // RAII: forwards while it is alive do not arm the Reducer (see the header comment); PyTorch's
  // `with ddp.no_sync():`.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  NoSync no_sync() { return NoSync(*this); }

  std::vector<Tensor> parameters() const { return module_->parameters(); }
  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }
  ProcessGroup& process_group() { return *group_; }
  Reducer& reducer() { return *reducer_; }
  // False inside no_sync(): what the next forward reads (PyTorch's attribute of that name).
  bool require_backward_grad_sync() const { return require_backward_grad_sync_; }
  const DistributedDataParallelOptions& options() const { return options_; }
  void train(bool on = true) { module_->train(on); }
  void eval() { train(false); }

 private:
  void check_same_model_everywhere();
  void broadcast_buffers();

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  std::unique_ptr<Reducer> reducer_;
  std::vector<Tensor> buffer_flats_;  // buffers coalesced per dtype (Note [coalesced replica state])
  std::vector<std::vector<Tensor>> buffer_groups_;
  int instance_ = 0;
  bool require_backward_grad_sync_ = true;
};

// Broadcasts `tensors` (all on the group's device) from `root` as one collective per dtype:
// packed into a flat buffer, broadcast, unpacked. Waits (stream-ordered on GPUs).
void broadcast_coalesced(ProcessGroup& group, const std::vector<Tensor>& tensors, int root = 0);

}  // namespace tandem::parallel::distributed
