#include "parallel/sharded/zero_optimizer.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "core/error.h"
#include "kernels/ops.h"
#include "parallel/distributed/ddp.h"
#include "parallel/reducer.h"
#include "parallel/sharded/shard_state.h"

namespace tandem::parallel::sharded {

using distributed::ProcessGroup;
using distributed::ReduceOp;

// Note [zero layout]: why buckets of contiguous shards.
// A rank's shard must be the same elements in every collective of a step: the reduce-scatter
// gives rank r chunk r of its input, and the all-gather puts rank r's input at chunk r of its
// output. Padding a bucket of n elements to N * ceil(n / N) makes those chunks equal-sized for
// any n and N (no divisibility requirement); the padding holds zeros in the gradient, so the
// shard step leaves the padded parameters at zero (SGD, Adam, AdamW: an update of 0) and they
// are never copied back. The buckets follow DDP's (reverse registration order, so stage 2
// reduces the last layers' gradients while backward computes the first ones'). The shards of
// all buckets are views of one flat buffer, and so are their gradients, so the wrapped
// optimizer takes its flat path (Note [flat optimizer step]): one fused update per step.

namespace {

constexpr int64_t kStage2DefaultCapBytes = 25 * 1024 * 1024;

int64_t tensor_bytes(const Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
}

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b < 1024)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  else if (b < 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else if (b < 1024LL * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  return buf;
}

// FNV-1a over the parameters' dtypes and shapes: equal on every rank that built the same model.
int64_t layout_hash(const std::vector<Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (const Tensor& p : params) {
    mix(static_cast<uint64_t>(p.dtype()));
    mix(static_cast<uint64_t>(p.dim()));
    for (int64_t d : p.shape()) mix(static_cast<uint64_t>(d));
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

}  // namespace

std::string ShardedMemory::str() const {
  std::ostringstream o;
  o << "ZeRO-" << stage << " rank " << rank << "/" << world_size << ": params "
    << human_bytes(parameters) << " + shard " << human_bytes(shard_parameters) << ", grads "
    << human_bytes(gradients) << ", optimizer state " << human_bytes(optimizer_state)
    << " (DDP: params " << human_bytes(ddp_parameters) << ", grads " << human_bytes(ddp_gradients)
    << ", optimizer state " << human_bytes(ddp_optimizer_state) << ")";
  return o.str();
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> params,
                                                 OptimizerFactory optimizer_class,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 ZeroRedundancyOptimizerOptions options)
    : params_(std::move(params)), group_(std::move(group)), options_(options) {
  TANDEM_CHECK(group_ != nullptr, Value, "ZeroRedundancyOptimizer: no process group");
  TANDEM_CHECK(optimizer_class != nullptr, Value, "ZeroRedundancyOptimizer: no optimizer class");
  TANDEM_CHECK(options_.stage == 1 || options_.stage == 2, Value, "ZeroRedundancyOptimizer: stage ",
               options_.stage,
               " is not one of 1 (optimizer state) and 2 (+ gradients); stage 3, the parameters "
               "sharded too, is FullyShardedDataParallel with FULL_SHARD (parallel/sharded/fsdp.h)");
  TANDEM_CHECK(!(options_.stage == 2 && options_.gradients_reduced), Value,
               "ZeroRedundancyOptimizer: gradients_reduced needs stage 1 (stage 2 reduces the "
               "gradients itself)");
  TANDEM_CHECK(!options_.bucket_cap_mb || *options_.bucket_cap_mb > 0, Value,
               "ZeroRedundancyOptimizer: bucket_cap_mb must be positive, got ",
               options_.bucket_cap_mb.value_or(0));
  TANDEM_CHECK(!params_.empty(), Value, "ZeroRedundancyOptimizer: no parameters");
  std::set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    TANDEM_CHECK(p.defined(), Value, "ZeroRedundancyOptimizer: parameter ", i, " is undefined");
    TANDEM_CHECK(p.is_leaf(), Value, "ZeroRedundancyOptimizer: parameter ", i, " ", p.str(),
                 " is not a leaf");
    TANDEM_CHECK(is_floating(p.dtype()), DType, "ZeroRedundancyOptimizer: parameter ", i, " is ",
                 dtype_name(p.dtype()));
    TANDEM_CHECK(p.device() == group_->device(), Device, "ZeroRedundancyOptimizer: parameter ", i,
                 " is on ", p.device().str(), " but the process group's tensors live on ",
                 group_->device().str());
    TANDEM_CHECK(seen.insert(p.raw_data()).second || p.numel() == 0, Value,
                 "ZeroRedundancyOptimizer: parameter ", i, " is repeated");
  }

  const int rank = group_->rank(), world = group_->size();
  NoGradGuard no_grad;
  // Same parameters everywhere: otherwise the shards of different ranks would not line up and
  // the collectives would have different sizes (a hang or mixed bytes).
  if (world > 1) {
    int64_t total = 0;
    for (const Tensor& p : params_) total += p.numel();
    std::vector<int64_t> mine_v = {static_cast<int64_t>(params_.size()), total,
                                   layout_hash(params_)};
    Tensor mine = from_vector<int64_t>(mine_v, {3}, group_->device());
    Tensor all = zeros({3 * world}, kInt64, group_->device());
    group_->allgather(all, mine)->wait();
    const std::vector<int64_t> v = all.to_vector<int64_t>();
    for (int r = 0; r < world; ++r) {
      TANDEM_CHECK(
          v[size_t(3 * r)] == v[0] && v[size_t(3 * r + 1)] == v[1] && v[size_t(3 * r + 2)] == v[2],
          Dist, "ZeroRedundancyOptimizer: the parameters differ between ranks: rank 0 has ", v[0],
          " parameters of ", v[1], " elements, rank ", r, " has ", v[size_t(3 * r)], " of ",
          v[size_t(3 * r + 1)], (v[size_t(3 * r + 1)] == v[1] ? " (shapes or dtypes differ)" : ""),
          "; every rank must pass the same parameters in the same order");
    }
    std::vector<Tensor> state;
    for (const Tensor& p : params_) state.push_back(p.detach());
    distributed::broadcast_coalesced(*group_, state, 0);  // rank 0's values everywhere
  }

  // Buckets (Note [zero layout]).
  const int64_t cap =
      options_.bucket_cap_mb
          ? std::max<int64_t>(1, static_cast<int64_t>(*options_.bucket_cap_mb * 1024 * 1024))
          : (options_.stage == 2 ? kStage2DefaultCapBytes : std::numeric_limits<int64_t>::max());
  const auto assignment = assign_buckets(params_, cap, cap);
  bucket_of_.assign(params_.size(), 0);
  slot_of_.assign(params_.size(), 0);
  int64_t shard_total = 0;
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket bucket;
    bucket.params = assignment[b];
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      bucket_of_[bucket.params[k]] = b;
      slot_of_[bucket.params[k]] = k;
      bucket.offset.push_back(bucket.numel);
      bucket.numel += params_[bucket.params[k]].numel();
    }
    bucket.shard = (bucket.numel + world - 1) / world;
    shard_total += bucket.shard;
    buckets_.push_back(std::move(bucket));
  }
  // The shard parameters: one flat buffer (float of the parameters' dtype; mixed dtypes get
  // one buffer each would be needed, so they are refused here).
  for (const Tensor& p : params_) {
    TANDEM_CHECK(p.dtype() == params_[0].dtype(), DType,
                 "ZeroRedundancyOptimizer: parameters of different dtypes (",
                 dtype_name(params_[0].dtype()), " and ", dtype_name(p.dtype()),
                 ") are not supported");
  }
  shard_params_flat_ = zeros({shard_total}, params_[0].dtype(), group_->device());
  std::vector<Tensor> shard_params;
  int64_t at = 0;
  for (Bucket& b : buckets_) {
    b.shard_param = shard_params_flat_.slice(0, at, at + b.shard);
    at += b.shard;
    // This rank's elements [rank S, (rank + 1) S) of the bucket, from the parameters.
    const int64_t lo = rank * b.shard, hi = std::min(lo + b.shard, b.numel);
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Tensor& p = params_[b.params[k]];
      const int64_t s = std::max(lo, b.offset[k]), e = std::min(hi, b.offset[k] + p.numel());
      if (s >= e) continue;
      b.shard_param.slice(0, s - lo, e - lo)
          .copy_(p.contiguous().view({-1}).slice(0, s - b.offset[k], e - b.offset[k]));
    }
    shard_params.push_back(b.shard_param);
  }
  optim_ = optimizer_class(std::move(shard_params));
  TANDEM_CHECK(optim_ != nullptr, Value,
               "ZeroRedundancyOptimizer: the optimizer class made no optimizer");

  if (options_.stage == 2) {
    ready_.assign(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i) {
      hook_ids_.push_back(
          params_[i].register_grad_hook([this, i](const Tensor& g) { on_gradient(i, g); }));
    }
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() {
  for (size_t i = 0; i < hook_ids_.size(); ++i) params_[i].remove_grad_hook(hook_ids_[i]);
}

// ---- stage 1 ------------------------------------------------------------------------------

Tensor ZeroRedundancyOptimizer::packed_gradients(const Bucket& b) const {
  Tensor flat = zeros({b.shard * group_->size()}, params_[0].dtype(), group_->device());
  for (size_t k = 0; k < b.params.size(); ++k) {
    const Tensor& p = params_[b.params[k]];
    const Tensor g = p.grad();
    if (g.defined()) flat.slice(0, b.offset[k], b.offset[k] + p.numel()).view(p.shape()).copy_(g);
  }
  return flat;
}

void ZeroRedundancyOptimizer::attach_shard_grads() {
  for (Bucket& b : buckets_) b.shard_param.set_grad(b.shard_grad);
}

void ZeroRedundancyOptimizer::reduce_gradients() {
  if (options_.stage == 2) return;
  NoGradGuard no_grad;
  const int rank = group_->rank();
  // One flat gradient buffer for every shard, so the wrapped optimizer's flat path applies.
  int64_t total = 0;
  for (const Bucket& b : buckets_) total += b.shard;
  Tensor grads = empty({total}, params_[0].dtype(), group_->device());
  std::vector<Tensor> packed(buckets_.size());
  std::vector<distributed::WorkPtr> works(buckets_.size());
  int64_t at = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    b.shard_grad = grads.slice(0, at, at + b.shard);
    at += b.shard;
    packed[i] = packed_gradients(b);
    if (options_.gradients_reduced) {
      b.shard_grad.copy_(packed[i].slice(0, rank * b.shard, (rank + 1) * b.shard));
      packed[i] = Tensor();
    } else {
      works[i] = group_->reduce_scatter(b.shard_grad, packed[i], ReduceOp::Avg);
    }
  }
  for (auto& w : works) {
    if (w) w->wait();
  }
}

void ZeroRedundancyOptimizer::gather_parameters() {
  NoGradGuard no_grad;
  const int world = group_->size();
  std::vector<Tensor> gathered(buckets_.size());
  std::vector<distributed::WorkPtr> works(buckets_.size());
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    gathered[i] = empty({b.shard * world}, params_[0].dtype(), group_->device());
    works[i] = group_->allgather(gathered[i], b.shard_param);
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    works[i]->wait();
    const Bucket& b = buckets_[i];
    for (size_t k = 0; k < b.params.size(); ++k) {
      const Tensor& p = params_[b.params[k]];
      p.copy_(gathered[i].slice(0, b.offset[k], b.offset[k] + p.numel()).view(p.shape()));
    }
    gathered[i] = Tensor();  // one bucket's worth at a time once waited for
  }
}

void ZeroRedundancyOptimizer::step() {
  reduce_gradients();
  attach_shard_grads();
  optim_->step();
  if (options_.stage == 1) {
    // Stage 1 keeps the parameters' full gradients (the caller's); the shard copy is not needed
    // past the step.
    for (Bucket& b : buckets_) {
      b.shard_grad = Tensor();
      b.shard_param.set_grad(Tensor());
    }
  }
  gather_parameters();
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (const Tensor& p : params_) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none)
      p.set_grad(Tensor());
    else
      g.zero_();
  }
  for (Bucket& b : buckets_) {
    if (set_to_none || !b.shard_grad.defined()) {
      b.shard_grad = Tensor();
      b.shard_param.set_grad(Tensor());
    } else {
      b.shard_grad.zero_();
    }
  }
}

// ---- stage 2 ------------------------------------------------------------------------------

void ZeroRedundancyOptimizer::on_gradient(size_t i, const Tensor& grad) {
  Bucket& b = buckets_[bucket_of_[i]];
  const Tensor& p = params_[i];
  if (!in_backward_) {
    in_backward_ = true;
    next_launch_ = next_finish_ = 0;
    std::fill(ready_.begin(), ready_.end(), 0);
    for (Bucket& bk : buckets_) bk.pending = bk.params.size();
    autograd::queue_callback([this] { finish_backward(); });
  }
  if (!b.staging.defined()) b.staging = zeros({b.shard * group_->size()}, p.dtype(), p.device());
  const int64_t off = b.offset[slot_of_[i]];
  b.staging.slice(0, off, off + p.numel()).view(p.shape()).copy_(grad);
  p.set_grad(Tensor());  // the full gradient lives only until its bucket has it
  if (!ready_[i]) {
    ready_[i] = 1;
    --b.pending;
  }
  launch_ready();
}

// Note [zero-2 buckets in flight]: buckets are launched in bucket order only (every rank the
// same collectives in the same order, as the Reducer's Note [buckets in order]); a bucket that
// is two behind the newest launch is waited for and folded into the shard gradient, so the
// padded staging buffers alive at once stay at about two buckets, not the whole model.
void ZeroRedundancyOptimizer::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    if (!b.staging.defined())
      b.staging = zeros({b.shard * group_->size()}, params_[0].dtype(), group_->device());
    b.incoming = empty({b.shard}, params_[0].dtype(), group_->device());
    b.work = group_->reduce_scatter(b.incoming, b.staging, ReduceOp::Avg);
    ++next_launch_;
    while (next_finish_ + 2 < next_launch_) finish_bucket(buckets_[next_finish_++]);
  }
}

void ZeroRedundancyOptimizer::finish_bucket(Bucket& b) {
  b.work->wait();
  b.work = nullptr;
  b.staging = Tensor();
  if (!b.shard_grad.defined()) {
    // The first reduction since zero_grad: the shard gradients of all buckets share one flat
    // buffer, so the wrapped optimizer takes its flat path.
    int64_t total = 0;
    for (const Bucket& o : buckets_) total += o.shard;
    Tensor flat = zeros({total}, params_[0].dtype(), group_->device());
    int64_t at = 0;
    for (Bucket& o : buckets_) {
      if (o.shard_grad.defined()) {
        flat.slice(0, at, at + o.shard).copy_(o.shard_grad);
      }
      o.shard_grad = flat.slice(0, at, at + o.shard);
      at += o.shard;
    }
  }
  kernels::axpby_(1.0, b.incoming, 1.0, b.shard_grad);  // accumulates across backward passes
  b.incoming = Tensor();
}

void ZeroRedundancyOptimizer::finish_backward() {
  in_backward_ = false;
  // A parameter without a gradient counts as zero (its staging slot keeps zeros).
  for (Bucket& b : buckets_) b.pending = 0;
  launch_ready();
  while (next_finish_ < next_launch_) finish_bucket(buckets_[next_finish_++]);
}

// ---- state ------------------------------------------------------------------------------

std::vector<FlatGroup> ZeroRedundancyOptimizer::flat_groups() const {
  std::vector<FlatGroup> out;
  for (const Bucket& b : buckets_) out.push_back({b.params, b.offset, b.numel, b.shard});
  return out;
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  const int rank = group_->rank(), world = group_->size();
  TANDEM_CHECK(to >= 0 && to < world, Value,
               "ZeroRedundancyOptimizer::consolidate_state_dict: to=", to,
               " is not a rank of a group of ", world);
  // The previous consolidation goes first: `to` holds one whole copy at most (Note [sharded
  // optimizer state] in shard_state.h).
  consolidated_.clear();
  has_consolidated_ = false;
  consolidated_ =
      gather_optimizer_state(optim_->state_dict(), params_, flat_groups(), group_.get(), rank, to);
  has_consolidated_ = rank == to;
}

const nn::StateDict& ZeroRedundancyOptimizer::state_dict() const {
  TANDEM_CHECK(has_consolidated_, Value, "ZeroRedundancyOptimizer::state_dict on rank ",
               group_->rank(),
               ": no consolidated state here; call consolidate_state_dict(to) on every rank first "
               "and read it on "
               "rank `to`");
  return consolidated_;
}

void ZeroRedundancyOptimizer::load_state_dict(const nn::StateDict& state) {
  optim_->load_state_dict(shard_optimizer_state(state, params_, flat_groups(), group_->rank(),
                                                group_->size(),
                                                "ZeroRedundancyOptimizer::load_state_dict",
                                                "bucket"));
}

ShardedMemory ZeroRedundancyOptimizer::memory() const {
  ShardedMemory m;
  m.rank = group_->rank();
  m.world_size = group_->size();
  m.stage = options_.stage;
  std::set<const void*> seen;
  auto count = [&](const Tensor& t) -> int64_t {
    if (!t.defined() || t.numel() == 0 || !seen.insert(t.raw_data()).second) return 0;
    return tensor_bytes(t);
  };
  for (const Tensor& p : params_) {
    m.numel += p.numel();
    m.parameters += count(p);
  }
  for (const Bucket& b : buckets_) {
    m.shard_numel += b.shard;
    m.shard_parameters += count(b.shard_param);
  }
  for (const Tensor& p : params_) m.gradients += count(p.grad());
  for (const Bucket& b : buckets_) m.gradients += count(b.shard_grad);
  const nn::StateDict state = optim_->state_dict();
  int64_t like_shard = 0;  // bytes of state per shard element
  for (size_t i = 0; i < state.size(); ++i) {
    const Tensor& t = state.item(i).second;
    const int64_t bytes = count(t);
    m.optimizer_state += bytes;
    if (t.numel() > 1 || (t.dim() == 1 && t.numel() == shard_params_flat_.numel()))
      like_shard += bytes;
  }
  const int64_t elem = static_cast<int64_t>(params_[0].element_size());
  m.ddp_parameters = m.numel * elem;
  m.ddp_gradients = m.numel * elem;
  m.ddp_optimizer_state =
      m.shard_numel > 0 ? like_shard / m.shard_numel * m.numel + (m.optimizer_state - like_shard)
                        : 0;
  return m;
}

}  // namespace tandem::parallel::sharded
