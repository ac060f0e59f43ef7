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
  const bool reshard = options_.reshard_after_forward.value_or(options_.sharding_strategy ==
                                                               ShardingStrategy::FULL_SHARD);
  TANDEM_CHECK(options_.sharding_strategy != ShardingStrategy::FULL_SHARD && !reshard, Value,
               "FullyShardedDataParallel: ", sharding_strategy_name(options_.sharding_strategy),
               options_.sharding_strategy != ShardingStrategy::FULL_SHARD
                   ? " with reshard_after_forward"
                   : "",
               " is not built (autograd's saved tensors share the parameters' storage, which "
               "cannot be released under them); use SHARD_GRAD_OP or NO_SHARD");
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
  sequential_ = dynamic_cast<nn::SequentialImpl*>(module_.get()) != nullptr;
  if (sequential_) {
    for (const auto& [name, child] : module_->named_children()) {
      if (trainable(*child).empty()) {
        unit_of_child_.push_back(-1);
        continue;
      }
      unit_of_child_.push_back(static_cast<int>(units_.size()));
      units_.push_back(Unit{child.get(), trainable(*child)});
    }
  } else {
    units_.push_back(Unit{module_.get(), trainable(*module_)});
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
      release(u);
    } else {
      // NO_SHARD: the parameters live in the flat parameter for good.
      std::vector<Tensor> views = split_views(u.flat_param, u.params);
      for (size_t k = 0; k < u.params.size(); ++k) {
        TensorImpl* impl = u.params[k].impl();
        impl->storage = views[k].storage();
        impl->offset = views[k].offset();
        impl->strides = views[k].strides();
      }
      u.gathered = true;
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

// Note [fsdp parameter views]: a gathered unit's parameters are views of one fresh buffer
// [N * S]; the parameter's TensorImpl keeps its identity (the module, the hooks and autograd's
// leaves see the same tensor), only its storage and offset change. Releasing gives it an empty
// storage: the buffer's bytes go once nothing else (autograd's saved aliases) holds them.
void FullyShardedDataParallel::gather(Unit& u) {
  if (!sharded()) return;
  NoGradGuard no_grad;
  Tensor full = empty({u.shard * group_->size()}, u.flat_param.dtype(), group_->device());
  group_->allgather(full, u.flat_param)->wait();
  for (size_t k = 0; k < u.params.size(); ++k) {
    TensorImpl* impl = u.params[k].impl();
    impl->storage = full.storage();
    impl->offset = full.offset() + u.offset[k];
    impl->strides = strides_for(impl->shape, MemoryFormat::Contiguous);
  }
  u.gathered = true;
}

void FullyShardedDataParallel::release(Unit& u) {
  if (!sharded()) return;
  auto none = std::make_shared<Storage>(group_->device(), 0);
  for (const Tensor& p : u.params) {
    p.impl()->storage = none;
    p.impl()->offset = 0;
  }
  u.gathered = false;
}

Tensor FullyShardedDataParallel::forward(const Tensor& x) {
  const bool backward_follows = grad_enabled();
  if (!sequential_) {
    gather(units_[0]);
    Tensor y = module_->forward(x);
    if (!backward_follows) release(units_[0]);
    return y;
  }
  Tensor y = x;
  size_t c = 0;
  for (const auto& [name, child] : module_->named_children()) {
    const int ui = unit_of_child_[c++];
    if (ui >= 0) gather(units_[size_t(ui)]);
    y = child->forward(y);
    if (ui >= 0 && !backward_follows) release(units_[size_t(ui)]);
  }
  return y;
}

void FullyShardedDataParallel::on_gradient(size_t ui, size_t k, const Tensor& grad) {
  Unit& u = units_[ui];
  if (!in_backward_) {
    in_backward_ = true;
    next_launch_ = next_finish_ = 0;
    for (size_t i = 0; i < units_.size(); ++i) {
      std::fill(ready_[i].begin(), ready_[i].end(), 0);
      units_[i].pending = units_[i].params.size();
    }
    autograd::queue_callback([this] { finish_backward(); });
  }
  const int eff = sharded() ? group_->size() : 1;
  if (!u.staging.defined()) u.staging = zeros({u.shard * eff}, grad.dtype(), grad.device());
  const Tensor& p = u.params[k];
  u.staging.slice(0, u.offset[k], u.offset[k] + p.numel()).view(p.shape()).copy_(grad);
  p.set_grad(Tensor());
  if (!ready_[ui][k]) {
    ready_[ui][k] = 1;
    --u.pending;
  }
  launch_ready();
}

// Units are reduced from the last to the first (the order backward finishes them), each only
// after the ones behind it, so every rank issues the same collectives in the same order.
void FullyShardedDataParallel::launch_ready() {
  while (next_launch_ < units_.size()) {
    Unit& u = units_[units_.size() - 1 - next_launch_];
    if (u.pending != 0) break;
    const int eff = sharded() ? group_->size() : 1;
    if (!u.staging.defined()) {
      u.staging = zeros({u.shard * eff}, u.flat_param.dtype(), group_->device());
    }
    if (sharded()) {
      u.incoming = empty({u.shard}, u.flat_param.dtype(), group_->device());
      u.work = group_->reduce_scatter(u.incoming, u.staging, ReduceOp::Avg);
    } else {
      u.incoming = u.staging;
      u.work = group_->allreduce(u.incoming, ReduceOp::Avg);
    }
    ++next_launch_;
    while (next_finish_ + 2 < next_launch_) finish_unit(units_[units_.size() - 1 - next_finish_++]);
  }
}

void FullyShardedDataParallel::finish_unit(Unit& u) {
  u.work->wait();
  u.work = nullptr;
  u.staging = Tensor();
  Tensor g = u.flat_param.grad();
  if (g.defined()) {
    kernels::axpby_(1.0, u.incoming, 1.0, g);  // accumulates until the optimizer's zero_grad
  } else {
    u.flat_param.set_grad(u.incoming);
  }
  u.incoming = Tensor();
  release(u);  // its backward has run: nothing reads the whole parameters any more
}

void FullyShardedDataParallel::finish_backward() {
  in_backward_ = false;
  for (Unit& u : units_) u.pending = 0;  // a parameter without a gradient counts as zero
  launch_ready();
  while (next_finish_ < next_launch_) finish_unit(units_[units_.size() - 1 - next_finish_++]);
}

FullyShardedDataParallel::FullParams::FullParams(FullyShardedDataParallel& fsdp) : fsdp_(fsdp) {
  for (Unit& u : fsdp_.units_) fsdp_.gather(u);
}

FullyShardedDataParallel::FullParams::~FullParams() {
  for (Unit& u : fsdp_.units_) fsdp_.release(u);
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
