#include "parallel/data_parallel.h"

#include <algorithm>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/device_api.h"
#include "parallel/flat_buffer.h"
#include "parallel/scatter.h"

namespace tandem::parallel {

namespace {

// Note [DataParallel backward]
// Replica r's forward ran on worker r. Its output reached the caller as a detached alias, and
// all n aliases were recorded as the outputs of one ReplicasBackward node whose inputs are the
// main module's trainable parameters and the input shards that need a gradient. So the
// caller's backward reaches this node once, holding the gradients of all n outputs, and:
//   1. runs the n replica backwards at once, one per worker, each into a fresh FlatBuffer
//      attached to its replica's parameters (the device-0 replica's parameters are leaves of
//      their own sharing the main module's storage, so nothing touches the main .grad yet);
//   2. sums the n buffers onto devices[0] with the communicator's reduce_sum (stream-ordered:
//      NCCL's ncclReduce, or copies and adds); after a batch smaller than the device count the
//      devices without rows (and without an output) add a zero buffer;
//   3. returns per-parameter views of that sum as the gradients of the main module's
//      parameters (the engine's AccumulateGrad adds them into .grad and fires the hooks once,
//      with the final gradient) and the replicas' input-leaf gradients for the shards.
// Replica graphs run with retain_graph and are dropped in release(), so the caller's
// retain_graph decides their lifetime as for any other node.
struct ReplicasBackward : autograd::Node {
  std::shared_ptr<DataParallel::State> state;
  Device root;
  size_t num_params = 0;                          // the first next_edges
  std::vector<Tensor> outputs;                    // per replica, with its graph
  std::vector<std::vector<Tensor>> input_leaves;  // per replica: stand-ins for its shards

  std::string name() const override { return "DataParallelBackward"; }
  void release() override {
    outputs.clear();
    input_leaves.clear();
  }

  autograd::TensorList apply(autograd::TensorList&& grads) override {
    TANDEM_CHECK(!outputs.empty(), Error, name(), ": backward through a graph that was already "
                 "freed; pass retain_graph=true to the first backward to run it twice");
    const size_t active = outputs.size();  // replicas that got rows (Note [batches smaller than the device count])
    std::vector<FlatBuffer> bufs(state->replicas.size());
    state->workers.run([&](size_t r) {
      if (num_params > 0) bufs[r] = FlatBuffer(trainable_parameters(*state->replicas[r]));  // zeros
      if (r >= active) return;  // no rows: adds zeros to the sum
      if (num_params > 0) bufs[r].attach();
      for (const Tensor& leaf : input_leaves[r]) leaf.set_grad(Tensor());
      if (grads[r].defined() && outputs[r].requires_grad()) {
        autograd::run_backward({outputs[r]}, {grads[r]}, /*retain_graph=*/true);
      }
      if (num_params > 0) {
        bufs[r].collect();
        bufs[r].detach();
      }
    });
    autograd::TensorList result;
    if (num_params > 0) {
      DeviceGuard device(root);
      std::vector<Tensor> flats;
      for (const FlatBuffer& b : bufs) flats.push_back(b.flat());
      state->comm->reduce_sum(flats, 0);
      result = bufs[0].views();
    }
    for (const auto& leaves : input_leaves) {
      for (const Tensor& leaf : leaves) {
        result.push_back(leaf.grad());
        leaf.set_grad(Tensor());
      }
    }
    return result;
  }
};

// dst = src group by group: one copy per group whose tensors are both still their flat
// tensors, else one per tensor. Runs on the current device's stream.
void copy_state(const CoalescedGroups& src, const CoalescedGroups& dst) {
  for (size_t g = 0; g < dst.groups.size(); ++g) {
    if (is_coalesced(src.groups[g], src.flats[g]) && is_coalesced(dst.groups[g], dst.flats[g])) {
      dst.flats[g].copy_(src.flats[g]);
      continue;
    }
    for (size_t k = 0; k < dst.groups[g].size(); ++k) dst.groups[g][k].copy_(src.groups[g][k]);
  }
}

}  // namespace

DataParallel::DataParallel(std::shared_ptr<nn::Module> module, std::vector<Device> devices,
                           std::optional<Device> output_device, const std::string& comm)
    : module_(std::move(module)), devices_(std::move(devices)) {
  TANDEM_CHECK(module_ != nullptr, Value, "DataParallel: null module");
  check_device_list(devices_, "DataParallel");
  output_device_ = output_device.value_or(devices_[0]);
  check_device_exists(output_device_);
  enable_peer_access(devices_);
  state_ = std::make_shared<State>(devices_);
  const std::string comm_name =
      !comm.empty() ? comm
                    : (devices_[0].is_cuda() && nccl_available() && !shares_a_gpu(devices_) ? "nccl" : "naive");
  state_->comm = make_communicator(comm_name, devices_);
  state_->replicas = replicate(module_, devices_);
  State& s = *state_;
  s.params = coalesce_by_dtype(module_->parameters());
  s.buffers = coalesce_by_dtype(module_->buffers());
  s.replica_params.resize(devices_.size());
  s.replica_buffers.resize(devices_.size());
  for (size_t r = 1; r < devices_.size(); ++r) {
    s.replica_params[r] = coalesce_by_dtype(s.replicas[r]->parameters());
    s.replica_buffers[r] = coalesce_by_dtype(s.replicas[r]->buffers());
  }
  s.replicas[0] = shallow_replica(*module_);  // after coalescing: it shares the flat storage
}

void DataParallel::sync_replicas() {
  TANDEM_CHECK(module_->device() == devices_[0], Device, "DataParallel: the module is on ",
               module_->device().str(), " but must stay on ", devices_[0].str(),
               " (devices[0]) after wrapping");
  NoGradGuard no_grad;
  reshare_storage(*module_, *state_->replicas[0]);
  const std::vector<Tensor> params = module_->parameters(), buffers = module_->buffers();
  for (size_t r = 0; r < devices_.size(); ++r) {
    nn::Module& replica = *state_->replicas[r];
    replica.train(module_->is_training());
    std::vector<Tensor> ps = replica.parameters(), bs = replica.buffers();
    TANDEM_CHECK(ps.size() == params.size() && bs.size() == buffers.size(), Value,
                 "DataParallel: replica ", r, " has ", ps.size(), " parameters and ", bs.size(),
                 " buffers, the module ", params.size(), " and ", buffers.size());
    for (size_t k = 0; k < ps.size(); ++k) {
      if (ps[k].requires_grad() != params[k].requires_grad()) {
        ps[k].set_requires_grad(params[k].requires_grad());
      }
    }
    if (r == 0) continue;  // shares the module's storage
    DeviceGuard device(devices_[r]);
    copy_state(state_->params, state_->replica_params[r]);
    copy_state(state_->buffers, state_->replica_buffers[r]);
  }
}

std::vector<Tensor> DataParallel::parallel_apply(const std::vector<Tensor>& inputs,
                                                 const ReplicaFn& fn) {
  TANDEM_CHECK(!inputs.empty(), Value, "DataParallel: no inputs");
  for (size_t a = 0; a < inputs.size(); ++a) {
    TANDEM_CHECK(inputs[a].defined() && inputs[a].dim() >= 1, Shape, "DataParallel: input ", a,
                 " needs a batch dim, got ", inputs[a].defined() ? inputs[a].str() : "undefined");
    TANDEM_CHECK(inputs[a].size(0) == inputs[0].size(0), Shape, "DataParallel: input ", a,
                 " has ", inputs[a].size(0), " rows but input 0 has ", inputs[0].size(0));
  }
  TANDEM_CHECK(inputs[0].size(0) > 0, Value, "DataParallel: empty batch");
  // A batch of B < n rows runs on the first B devices, one row each, as in PyTorch (Note
  // [batches smaller than the device count] in trainer.cpp).
  const size_t n = std::min(devices_.size(), static_cast<size_t>(inputs[0].size(0)));
  const std::vector<Device> active(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(n));
  last_sizes_ = split_sizes(inputs[0].size(0), n);
  sync_replicas();

  // Each replica gets its shards; a shard that needs a gradient is replaced by a leaf of its
  // own, which the backward node fills (Note [DataParallel backward]). Edge order: the main
  // module's trainable parameters, then the replaced shards replica by replica.
  const bool recording = grad_enabled();
  std::vector<Tensor> edges = recording ? trainable_parameters(*module_) : std::vector<Tensor>();
  const size_t num_params = edges.size();
  std::vector<std::vector<Tensor>> shards_of(n), leaves_of(n), sources_of(n);
  for (const Tensor& input : inputs) {
    const std::vector<Tensor> shards = scatter(input, last_sizes_, active);
    for (size_t r = 0; r < n; ++r) {
      if (recording && shards[r].requires_grad()) {
        Tensor leaf = shards[r].detach();
        leaf.set_requires_grad(true);
        leaves_of[r].push_back(leaf);
        sources_of[r].push_back(shards[r]);
        shards_of[r].push_back(leaf);
      } else {
        shards_of[r].push_back(shards[r]);
      }
    }
  }
  for (const auto& sources : sources_of) edges.insert(edges.end(), sources.begin(), sources.end());

  std::vector<Tensor> outputs(n);
  state_->workers.run([&](size_t r) {
    if (r >= n) return;
    outputs[r] = fn(*state_->replicas[r], shards_of[r]);
    TANDEM_CHECK(outputs[r].defined(), Value, "DataParallel: replica ", r, " returned an "
                 "undefined tensor");
  });

  bool any_grad = false;
  for (const Tensor& o : outputs) any_grad = any_grad || o.requires_grad();
  if (!recording || !any_grad) return outputs;

  auto node = std::make_shared<ReplicasBackward>();
  node->state = state_;
  node->root = devices_[0];
  node->num_params = num_params;
  node->outputs = outputs;
  node->input_leaves = leaves_of;
  std::vector<Tensor> results;
  for (const Tensor& o : outputs) results.push_back(o.detach());
  autograd::record(node, edges, results);
  return results;
}

std::vector<Tensor> DataParallel::replica_losses(const Tensor& x, const Tensor& y,
                                                 const LossFn& fn) {
  return parallel_apply({x, y}, [&](nn::Module& replica, const std::vector<Tensor>& shards) {
    Tensor loss = fn(replica, shards[0], shards[1]);
    TANDEM_CHECK(loss.defined() && loss.numel() == 1, Value, "DataParallel: the loss function "
                 "must return a one-element tensor, got ", loss.defined() ? loss.str() : "undefined");
    return loss;
  });
}

namespace {
double share(const std::vector<int64_t>& sizes, size_t r) {
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  return double(sizes[r]) / double(total);
}
}  // namespace

void DataParallel::backward(const std::vector<Tensor>& losses, double scale) {
  TANDEM_CHECK(!last_sizes_.empty() && losses.size() == last_sizes_.size(), Value,
               "DataParallel::backward: ", losses.size(), " losses for ", last_sizes_.size(),
               " shards (pass the losses of the latest replica_losses call)");
  std::vector<Tensor> grads;
  for (size_t r = 0; r < losses.size(); ++r) {
    const Tensor& l = losses[r];
    TANDEM_CHECK(l.defined() && l.numel() == 1, Value, "DataParallel::backward: loss ", r,
                 " must be a one-element tensor, got ", l.defined() ? l.str() : "undefined");
    grads.push_back(full(l.shape(), scale * share(last_sizes_, r), l.dtype(), l.device()));
  }
  autograd::run_backward(losses, grads);
}

Tensor DataParallel::mean_loss(const std::vector<Tensor>& losses) const {
  TANDEM_CHECK(!last_sizes_.empty() && losses.size() == last_sizes_.size(), Value,
               "DataParallel::mean_loss: ", losses.size(), " losses for ", last_sizes_.size(),
               " shards");
  Tensor total;
  for (size_t r = 0; r < losses.size(); ++r) {
    Tensor l = losses[r].device() == output_device_ ? losses[r] : to_device(losses[r], output_device_);
    l = mul(l, share(last_sizes_, r));
    total = total.defined() ? add(total, l) : l;
  }
  return total;
}

Tensor DataParallel::forward(const Tensor& x) {
  std::vector<Tensor> outputs =
      parallel_apply({x}, [](nn::Module& replica, const std::vector<Tensor>& shards) {
        return replica.forward(shards[0]);
      });
  return gather(outputs, output_device_);
}

}  // namespace tandem::parallel
