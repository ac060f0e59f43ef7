#pragma once
// DataParallel: a module's forward spread over several devices, PyTorch's nn.DataParallel.
//
//   auto dp = DataParallel(model, {Device::cuda(0), Device::cuda(1)});
//   nn::optim::SGD opt(dp.parameters(), 0.1);        // the main module's parameters
//   Tensor logits = dp(x);                            // on the output device
//   Tensor loss = cross_entropy(logits, y);
//   opt.zero_grad();
//   loss.backward();                                  // gradients summed into model's .grad
//   opt.step();                                       // updates the main module only
//
// forward(x): copies the main module's parameters and buffers into the other replicas
// (device-to-device copies into their existing storage: no cloning, no allocation, no host
// sync; one model-sized broadcast per step, which is why ScratchTrainer avoids it, see Note
// [why replicas are not re-copied]). Wrapping a module moves its parameters, and separately its
// buffers, into one flat tensor each (values and tensor identities kept), so that broadcast is
// one copy per replica (Note [coalesced replica state]). Then it scatters x along dim 0 (uneven shards allowed), runs
// every replica's forward at once on the device workers, and gathers the outputs onto the
// output device. The result is differentiable: backward runs every replica's backward at
// once, again one worker per device (Note [DataParallel backward] in data_parallel.cpp), and
// sums the replicas' parameter gradients into the main module's .grad, where the optimizer
// expects them; the main module's gradient hooks fire once, with the summed gradient.
// Gradient accumulation over several backward calls works as on one device.
//
// Models that compute their own loss use replica_losses(x, y, fn) + backward(losses): each
// replica's loss is the *mean over its own shard*, and backward weights replica r's loss by
// its shard share b_r / B (times `scale`) before summing, so the gradient equals that of one
// device's mean loss over the global batch of B rows — exactly, also for uneven shards. (A
// plain sum would scale the gradient by the device count; a plain average would overweight
// the rows of smaller shards.) mean_loss(losses) is the same weighted sum as a value.
//
// BatchNorm: each replica normalizes with its own shard's batch statistics (not synchronized
// across devices, as in PyTorch). The device-0 replica shares the main module's storage, so
// the main module's running statistics are updated from shard 0 only; the others' updates are
// overwritten by the next forward's copy.
//
// The device-0 replica is shallow_replica(module): the module's own parameter storage with
// separate autograd leaves. Do not move the module to another device after wrapping it.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"
#include "parallel/comm.h"
#include "parallel/replicate.h"
#include "parallel/workers.h"

namespace tandem::parallel {

class DataParallel {
 public:
  // module is moved to devices[0]; output_device (any existing device) defaults to
  // devices[0]. Backward sums the replicas' gradients onto devices[0] with comm's reduce_sum
  // ("naive", "ring" or "nccl"; empty: nccl on GPUs where tandem has it, else naive). Throws
  // for an invalid device list, a null module or a communicator that cannot run there.
  DataParallel(std::shared_ptr<nn::Module> module, std::vector<Device> devices,
               std::optional<Device> output_device = std::nullopt, const std::string& comm = "");

  // x [B, ...] on any device, B >= 1. A batch of B < devices().size() rows runs on the first
  // B devices, one row each (as PyTorch's DataParallel), so every row is used.
  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // The general form: scatters every tensor of `inputs` the same way along dim 0 and runs
  // fn(replica, shards) on each device's worker; returns the per-replica results (on their
  // devices), differentiable w.r.t. the main module's parameters and the inputs: one per
  // device, or B of them for a batch of B < devices().size() rows.
  using ReplicaFn = std::function<Tensor(nn::Module& replica, const std::vector<Tensor>& shards)>;
  std::vector<Tensor> parallel_apply(const std::vector<Tensor>& inputs, const ReplicaFn& fn);

  // For models that compute their own loss: fn(replica, x_shard, y_shard) returns the mean
  // loss over the shard (a one-element tensor). Returns one loss per shard (as parallel_apply).
  using LossFn = std::function<Tensor(nn::Module& replica, const Tensor& x, const Tensor& y)>;
  std::vector<Tensor> replica_losses(const Tensor& x, const Tensor& y, const LossFn& fn);
  // Backward of every replica loss, weighted by scale * b_r / B (see the header comment),
  // with the shard sizes of the latest forward / replica_losses call.
  void backward(const std::vector<Tensor>& losses, double scale = 1.0);
  // sum_r (b_r / B) * losses[r], on the output device (differentiable).
  Tensor mean_loss(const std::vector<Tensor>& losses) const;

  std::vector<Tensor> parameters() const { return module_->parameters(); }
  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }
  void train(bool on = true) { module_->train(on); }
  void eval() { train(false); }

  const std::vector<Device>& devices() const { return devices_; }
  Device output_device() const { return output_device_; }
  const Replicas& replicas() const { return state_->replicas; }
  DeviceWorkers& workers() { return state_->workers; }
  Communicator& communicator() { return *state_->comm; }
  // Shard sizes of the latest forward / replica_losses call.
  const std::vector<int64_t>& last_sizes() const { return last_sizes_; }

  // Shared with the backward nodes, which may outlive a forward call.
  struct State {
    explicit State(const std::vector<Device>& devices) : workers(devices) {}
    DeviceWorkers workers;
    std::unique_ptr<Communicator> comm;  // sums the replicas' gradients in backward
    Replicas replicas;  // [shallow_replica(module) on devices[0], clones on the others]
    // Note [coalesced replica state]: the module's parameters, and separately its buffers, live
    // in one flat tensor per dtype (coalesce_by_dtype() in replicate.h), and so do every other
    // replica's: the copy before each forward is one device-to-device copy per dtype and
    // replica instead of one per tensor (per-tensor copies only if something moved them since).
    CoalescedGroups params, buffers;
    std::vector<CoalescedGroups> replica_params, replica_buffers;  // per replica; [0] unused
  };

 private:
  void sync_replicas();

  std::shared_ptr<nn::Module> module_;
  std::vector<Device> devices_;
  Device output_device_;
  std::shared_ptr<State> state_;
  std::vector<int64_t> last_sizes_;
};

}  // namespace tandem::parallel
