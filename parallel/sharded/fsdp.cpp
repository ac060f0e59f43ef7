#include "parallel/sharded/fsdp.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "nn/container.h"
#include "parallel/distributed/ddp.h"
#include "parallel/trace.h"

namespace tandem::parallel::sharded {

using distributed::ProcessGroup;
using distributed::ReduceOp;

const char* sharding_strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD:
      return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD:
      return "NO_SHARD";
  }
  return "?";
}

std::string FsdpMemory::str() const {
  std::ostringstream o;
  o << "FSDP rank " << rank << "/" << world_size << ": params " << parameters << " B + flat "
    << flat_parameters << " B, grads " << gradients << " B (DDP: params " << numel * element_size
    << " B, grads " << numel * element_size << " B)";
  return o.str();
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<nn::Module> module,
                                                   std::shared_ptr<ProcessGroup> group,
                                                   FullyShardedDataParallelOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  TANDEM_CHECK(module_ != nullptr, Value, "FullyShardedDataParallel: no module");
  TANDEM_CHECK(group_ != nullptr, Value, "FullyShardedDataParallel: no process group");
  reshard_ = options_.reshard_after_forward.value_or(options_.sharding_strategy ==
                                                     ShardingStrategy::FULL_SHARD);
  TANDEM_CHECK(sharded() || !reshard_, Value,
               "FullyShardedDataParallel: NO_SHARD with reshard_after_forward: a unit that is "
               "never sharded cannot be resharded (use FULL_SHARD)");
  const int rank = group_->rank(), world = group_->size();
  NoGradGuard no_grad;
  {
    std::vector<Tensor> state;
    for (const Tensor& p : module_->parameters()) state.push_back(p.detach());
    for (const Tensor& b : module_->buffers()) state.push_back(b);
    for (const Tensor& t : state) {
      TANDEM_CHECK(t.device() == group_->device(), Device, "FullyShardedDataParallel: ", t.str(),
                   " is not on the process group's device ", group_->device().str());
    }
    if (world > 1 && !state.empty()) distributed::broadcast_coalesced(*group_, state, 0);
  }
  auto trainable = [](const nn::Module& m) {
    std::vector<Tensor> out;
    for (const Tensor& p : m.parameters()) {
      if (p.requires_grad()) out.push_back(p);
    }
    return out;
  };
  auto add_unit = [&](nn::Module* m) {
    Unit& u = units_.emplace_back();
    u.module = m;
    u.params = trainable(*m);
  };
  sequential_ = dynamic_cast<nn::SequentialImpl*>(module_.get()) != nullptr;
  if (sequential_) {
    for (const auto& [name, child] : module_->named_children()) {
      if (trainable(*child).empty()) {
        unit_of_child_.push_back(-1);
        continue;
      }
      unit_of_child_.push_back(static_cast<int>(units_.size()));
      add_unit(child.get());
    }
  } else {
    add_unit(module_.get());
  }
  TANDEM_CHECK(!units_.empty() && !units_[0].params.empty(), Value,
               "FullyShardedDataParallel: the module has no trainable parameters");
  const DType dtype = units_[0].params[0].dtype();
  const int eff = sharded() ? world : 1;  // NO_SHARD: every rank holds the whole unit
  ready_.resize(units_.size());
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = units_[ui];
    for (const Tensor& p : u.params) {
      TANDEM_CHECK(p.dtype() == dtype, DType, "FullyShardedDataParallel: parameters of ",
                   dtype_name(dtype), " and ", dtype_name(p.dtype()),
                   " are not supported together");
      TANDEM_CHECK(p.is_contiguous(), Value, "FullyShardedDataParallel: parameter ", p.str(),
                   " is not contiguous");
      u.offset.push_back(u.numel);
      u.numel += p.numel();
    }
    u.shard = (u.numel + eff - 1) / eff;
    u.flat_param = zeros({u.shard}, dtype, group_->device());
    const int64_t lo = sharded() ? rank * u.shard : 0, hi = std::min(lo + u.shard, u.numel);
    for (size_t k = 0; k < u.params.size(); ++k) {
      const Tensor& p = u.params[k];
      const int64_t s = std::max(lo, u.offset[k]), e = std::min(hi, u.offset[k] + p.numel());
      if (s < e) {
        u.flat_param.slice(0, s - lo, e - lo)
            .copy_(p.view({-1}).slice(0, s - u.offset[k], e - u.offset[k]));
      }
    }
    if (sharded()) {
      // The parameters become views of one Storage per unit, for good; it holds bytes only
      // while the unit is gathered (Note [fsdp parameter views]).
      auto storage = std::make_shared<Storage>(group_->device(), 0);
      storage->release();
      auto impl = std::make_shared<TensorImpl>();
      impl->storage = storage;
      impl->shape = {u.shard * world};
      impl->strides = {1};
      impl->dtype = dtype;
      u.full = Tensor(std::move(impl));
      for (size_t k = 0; k < u.params.size(); ++k) {
        TensorImpl* p = u.params[k].impl();
        p->storage = storage;
        p->offset = u.offset[k];
        p->strides = strides_for(p->shape, MemoryFormat::Contiguous);
      }
    } else {
      // NO_SHARD: the parameters live in the flat parameter for good.
      std::vector<Tensor> views = split_views(u.flat_param, u.params);
      for (size_t k = 0; k < u.params.size(); ++k) {
        TensorImpl* impl = u.params[k].impl();
        impl->storage = views[k].storage();
        impl->offset = views[k].offset();
        impl->strides = views[k].strides();
      }
      u.current = true;
    }
    ready_[ui].assign(u.params.size(), 0);
    for (size_t k = 0; k < u.params.size(); ++k) {
      const int id =
          u.params[k].register_grad_hook([this, ui, k](const Tensor& g) { on_gradient(ui, k, g); });
      hooks_.emplace_back(u.params[k], id);
    }
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  for (auto& [p, id] : hooks_) p.remove_grad_hook(id);
}

std::vector<Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<Tensor> out;
  for (const Unit& u : units_) out.push_back(u.flat_param);
  return out;
}

// Note [fsdp parameter views]: a sharded unit's parameters are views of one Storage of N * S
// elements, made once; the parameter's TensorImpl keeps its identity (the module, the hooks and
// autograd's leaves see the same tensor). Gathering gives the Storage bytes (reallocate) and
// all-gathers the shards into them; releasing gives them back (Storage::release). Autograd's
// saved tensors are aliases of the same Storage, so a release after forward really frees the
// bytes (FULL_SHARD), and the gather before backward puts the values back under those aliases.
Event FullyShardedDataParallel::now() const {
  Event e(true);
  e.record(current_stream(group_->device()));
  return e;
}

void FullyShardedDataParallel::issue_gather(size_t ui) {
  Unit& u = units_[ui];
  if (!sharded() || u.current || u.gathering) return;
  NoGradGuard no_grad;
  Storage& storage = *u.full.storage();
  if (storage.released()) storage.reallocate(u.full.nbytes());
  if (trace_) u.gather_start = now();
  u.gathering = group_->allgather(u.full, u.flat_param);
}

void FullyShardedDataParallel::wait_gather(size_t ui) {
  Unit& u = units_[ui];
  if (!sharded() || u.current) return;
  issue_gather(ui);
  distributed::WorkPtr work = std::move(u.gathering);
  work->wait();
  u.current = true;
  if (trace_) {
    trace_->add(group_->device(), "gather " + std::to_string(ui), "comm", std::move(u.gather_start),
                now());
  }
}

void FullyShardedDataParallel::release(size_t ui) {
  Unit& u = units_[ui];
  if (!sharded()) return;
  // An all-gather still in flight writes into the bytes: it ends first.
  if (u.gathering) wait_gather(ui);
  if (u.full.storage()->released()) return;
  Event start = trace_ ? now() : Event(true);
  u.full.storage()->release();
  u.current = false;
  if (trace_)
    trace_->add(group_->device(), "free " + std::to_string(ui), "compute", std::move(start), now());
}

Tensor FullyShardedDataParallel::run_unit(size_t ui, nn::Module& m, const Tensor& x,
                                          bool backward_follows) {
  wait_gather(ui);
  if (options_.forward_prefetch && ui + 1 < units_.size()) issue_gather(ui + 1);
  Tensor y;
  {
    auto span = Trace::scoped(trace_, group_->device(), "forward " + std::to_string(ui));
    y = m.forward(x);
  }
  // The last unit stays whole after its forward: its backward is the next thing to run (as
  // PyTorch keeps the root unsharded), which saves one all-gather per step.
  const bool last = ui + 1 == units_.size();
  if (!backward_follows || (reshard_ && !last)) release(ui);
  if (backward_follows && reshard_ && y.requires_grad()) {
    // The pre-backward hook: it runs on the unit's output gradient, before any node of the
    // unit's backward (they all wait for that gradient).
    y.register_hook([this, ui](const Tensor&) { pre_backward(ui); });
  }
  return y;
}

Tensor FullyShardedDataParallel::forward(const Tensor& x) {
  const bool backward_follows = grad_enabled();
  for (Unit& u : units_) {
    if (sharded()) u.current = false;  // the shards may have been stepped since
  }
  if (!sequential_) return run_unit(0, *module_, x, backward_follows);
  Tensor y = x;
  size_t c = 0;
  for (const auto& [name, child] : module_->named_children()) {
    const int ui = unit_of_child_[c++];
    y = ui >= 0 ? run_unit(size_t(ui), *child, y, backward_follows) : child->forward(y);
  }
  return y;
}

void FullyShardedDataParallel::begin_backward() {
  if (in_backward_) return;
  in_backward_ = true;
  next_launch_ = next_finish_ = 0;
  for (size_t i = 0; i < units_.size(); ++i) {
    std::fill(ready_[i].begin(), ready_[i].end(), 0);
    units_[i].pending = units_[i].params.size();
  }
  autograd::queue_callback([this] { finish_backward(); });
}

void FullyShardedDataParallel::pre_backward(size_t ui) {
  begin_backward();
  issue_gather(ui);  // nothing when a prefetch issued it already
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE && ui > 0) issue_gather(ui - 1);
  wait_gather(ui);
  if (trace_) {
    units_[ui].backward_start = now();
    units_[ui].backward_open = true;
  }
}

void FullyShardedDataParallel::on_gradient(size_t ui, size_t k, const Tensor& grad) {
  Unit& u = units_[ui];
  begin_backward();
  const int eff = sharded() ? group_->size() : 1;
  if (!u.staging.defined()) u.staging = zeros({u.shard * eff}, grad.dtype(), grad.device());
  const Tensor& p = u.params[k];
  u.staging.slice(0, u.offset[k], u.offset[k] + p.numel()).view(p.shape()).copy_(grad);
  p.set_grad(Tensor());
  if (!ready_[ui][k]) {
    ready_[ui][k] = 1;
    --u.pending;
  }
  launch_ready(true);
}

// Units are reduced from the last to the first (the order backward finishes them), each only
// after the ones behind it, so every rank issues the same collectives in the same order. A
// unit's parameters are released as its reduction is launched: its gradients are final, so no
// node of its backward is left to read them.
void FullyShardedDataParallel::launch_ready(bool prefetch) {
  while (next_launch_ < units_.size()) {
    const size_t ui = units_.size() - 1 - next_launch_;
    Unit& u = units_[ui];
    if (u.pending != 0) break;
    const int eff = sharded() ? group_->size() : 1;
    if (!u.staging.defined()) {
      u.staging = zeros({u.shard * eff}, u.flat_param.dtype(), group_->device());
    }
    if (trace_ && u.backward_open) {
      trace_->add(group_->device(), "backward " + std::to_string(ui), "compute",
                  std::move(u.backward_start), now());
      u.backward_open = false;
    }
    release(ui);
    if (trace_) u.reduce_start = now();
    if (sharded()) {
      u.incoming = empty({u.shard}, u.flat_param.dtype(), group_->device());
      u.work = group_->reduce_scatter(u.incoming, u.staging, ReduceOp::Avg);
    } else {
      u.incoming = u.staging;
      u.work = group_->allreduce(u.incoming, ReduceOp::Avg);
    }
    ++next_launch_;
    if (prefetch && reshard_ && ui > 0 &&
        options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST) {
      issue_gather(ui - 1);
    }
    while (next_finish_ + 2 < next_launch_) finish_unit(units_.size() - 1 - next_finish_++);
  }
}

void FullyShardedDataParallel::finish_unit(size_t ui) {
  Unit& u = units_[ui];
  u.work->wait();
  u.work = nullptr;
  if (trace_) {
    trace_->add(group_->device(),
                (sharded() ? "reduce-scatter " : "allreduce ") + std::to_string(ui), "comm",
                std::move(u.reduce_start), now());
  }
  u.staging = Tensor();
  Tensor g = u.flat_param.grad();
  if (g.defined()) {
    kernels::axpby_(1.0, u.incoming, 1.0, g);  // accumulates until the optimizer's zero_grad
  } else {
    u.flat_param.set_grad(u.incoming);
  }
  u.incoming = Tensor();
}

void FullyShardedDataParallel::finish_backward() {
  in_backward_ = false;
  for (Unit& u : units_) u.pending = 0;  // a parameter without a gradient counts as zero
  launch_ready(false);
  while (next_finish_ < next_launch_) finish_unit(units_.size() - 1 - next_finish_++);
}

FullyShardedDataParallel::FullParams::FullParams(FullyShardedDataParallel& fsdp) : fsdp_(fsdp) {
  const size_t n = fsdp_.units_.size();
  for (size_t ui = 0; ui < n; ++ui) {
    if (fsdp_.sharded()) fsdp_.units_[ui].current = false;  // the shards may have been stepped
  }
  for (size_t ui = 0; ui < n; ++ui) fsdp_.issue_gather(ui);  // all in flight, then waited for
  for (size_t ui = 0; ui < n; ++ui) fsdp_.wait_gather(ui);
}

FullyShardedDataParallel::FullParams::~FullParams() {
  for (size_t ui = 0; ui < fsdp_.units_.size(); ++ui) fsdp_.release(ui);
}

FsdpMemory FullyShardedDataParallel::memory() const {
  FsdpMemory m;
  m.rank = group_->rank();
  m.world_size = group_->size();
  m.element_size = static_cast<int64_t>(units_[0].flat_param.element_size());
  std::set<const Storage*> seen;
  auto storage_bytes = [&](const Tensor& t) -> int64_t {
    if (!t.defined() || !seen.insert(t.storage().get()).second) return 0;
    return static_cast<int64_t>(t.storage()->nbytes());
  };
  for (const Unit& u : units_) {
    m.numel += u.numel;
    m.shard_numel += u.shard;
    m.flat_parameters += storage_bytes(u.flat_param);
  }
  for (const Unit& u : units_) {
    for (const Tensor& p : u.params) m.parameters += storage_bytes(p);
  }
  for (const Unit& u : units_) {
    for (const Tensor& p : u.params) m.gradients += storage_bytes(p.grad());
    m.gradients += storage_bytes(u.flat_param.grad());
  }
  return m;
}

}  // namespace tandem::parallel::sharded
