#include "parallel/reducer.h"

#include <algorithm>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "core/error.h"

namespace tandem::parallel {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<Tensor>& params, int64_t cap_bytes,
                                                int64_t first_cap_bytes) {
  TANDEM_CHECK(cap_bytes >= 1 && first_cap_bytes >= 1, Value, "assign_buckets: bucket caps must be >= 1 byte, got ",
               cap_bytes, " and ", first_cap_bytes);
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const Tensor& p = params[k];
    TANDEM_CHECK(p.defined(), Value, "assign_buckets: parameter ", k, " is undefined");
    const int64_t n = static_cast<int64_t>(p.nbytes());
    bool fresh = buckets.empty();
    if (!fresh) {
      const Tensor& last = params[buckets.back().back()];
      const int64_t cap = buckets.size() == 1 ? first_cap_bytes : cap_bytes;
      fresh = last.dtype() != p.dtype() || last.device() != p.device() || bytes + n > cap;
    }
    if (fresh) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(k);
    bytes += n;
  }
  return buckets;
}

// Note [gradients in parameter order]
// The optimizer updates a whole model with one kernel when the parameters are back to back in
// one storage and so are their gradients, in the same order (Note [flat optimizer step] in
// nn/optim/optimizer.h); a step of ResNet-18 otherwise launches 62 small updates. Buckets fill
// last parameter first, so a bucket per allocation leaves the gradients in reverse order, in
// pieces. But assign_buckets' buckets are runs of consecutive parameters (bucket 0 the last
// ones), so one buffer in parameter order holds every bucket as a slice: bucket b starts where
// the parameters of the buckets after it end. That is the layout whenever the buckets are such
// runs, of one dtype and device; otherwise each bucket has its own allocation.
// Returns each bucket's offset in that buffer, or nothing when the layout does not apply.
std::vector<int64_t> Reducer::parameter_order_offsets(const std::vector<Tensor>& params,
                                                      const std::vector<std::vector<size_t>>& buckets) {
  size_t next = params.size();  // walking the buckets, each must end just below the last
  for (const auto& bucket : buckets) {
    for (size_t i : bucket) {
      if (next == 0 || i != next - 1) return {};
      --next;
      if (!params[i].defined() || params[i].dtype() != params[0].dtype() ||
          params[i].device() != params[0].device())
        return {};
    }
  }
  if (next != 0) return {};
  std::vector<int64_t> offsets(buckets.size());
  int64_t offset = 0;
  for (size_t b = buckets.size(); b-- > 0;) {
    offsets[b] = offset;
    for (size_t i : buckets[b]) offset += params[i].numel();
  }
  return offsets;
}

Reducer::Reducer(std::vector<Tensor> params, std::vector<std::string> names, std::vector<std::vector<size_t>> buckets,
                 Launch launch, Options options)
    : params_(std::move(params)), names_(std::move(names)), launch_(std::move(launch)), options_(options) {
  TANDEM_CHECK(names_.size() == params_.size(), Value, "Reducer: ", params_.size(), " parameters but ",
               names_.size(), " names");
  TANDEM_CHECK(launch_ != nullptr, Value, "Reducer: no launch function");
  bucket_of_.assign(params_.size(), SIZE_MAX);
  slot_of_.assign(params_.size(), SIZE_MAX);
  ready_.assign(params_.size(), 0);
  const std::vector<int64_t> offsets = parameter_order_offsets(params_, buckets);
  if (!offsets.empty()) {
    int64_t total = 0;
    for (const Tensor& p : params_) total += p.numel();
    flat_ = zeros({total}, params_[0].dtype(), params_[0].device());
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    Bucket bucket;
    bucket.params = std::move(buckets[b]);
    TANDEM_CHECK(!bucket.params.empty(), Value, "Reducer: bucket ", b, " is empty");
    std::vector<Tensor> members;
    int64_t total = 0;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const size_t i = bucket.params[k];
      TANDEM_CHECK(i < params_.size() && bucket_of_[i] == SIZE_MAX, Value, "Reducer: parameter index ", i,
                   " is out of range or in two buckets");
      const Tensor& p = params_[i];
      TANDEM_CHECK(p.dtype() == params_[bucket.params[0]].dtype() && p.device() == params_[bucket.params[0]].device(),
                   Value, "Reducer: bucket ", b, " mixes dtypes or devices ('", names_[i], "')");
      bucket_of_[i] = b;
      slot_of_[i] = k;
      members.push_back(p);
      total += p.numel();
    }
    if (flat_.defined()) {
      // Note [gradients in parameter order]: the bucket is a slice of flat_, its members at
      // their place in parameter order (the bucket lists them last first).
      bucket.flat = flat_.slice(0, offsets[b], offsets[b] + total);
      std::vector<Tensor> ascending(members.rbegin(), members.rend());
      std::vector<Tensor> views = split_views(bucket.flat, ascending);
      bucket.views.assign(views.rbegin(), views.rend());
    } else {
      bucket.flat = zeros({total}, members[0].dtype(), members[0].device());
      bucket.views = split_views(bucket.flat, members);
    }
    buckets_.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    TANDEM_CHECK(bucket_of_[i] != SIZE_MAX, Value, "Reducer: parameter '", names_[i], "' is in no bucket");
    Bucket& bucket = buckets_[bucket_of_[i]];
    const Tensor& view = bucket.views[slot_of_[i]];
    if (params_[i].grad().defined()) view.copy_(params_[i].grad());  // keep what is there
    params_[i].set_grad(view);
    hook_ids_.push_back(params_[i].register_grad_hook([this, i](const Tensor& g) { on_gradient(i, g); }));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < params_.size() && i < hook_ids_.size(); ++i) params_[i].remove_grad_hook(hook_ids_[i]);
}

void Reducer::prepare_for_backward() {
  attach_grads();
  in_backward_ = false;
  armed_ = true;
}

// A gradient attached here as a zeroed bucket view is marked zero for autograd, so the next
// backward may write it straight into the bucket rather than into a tensor of its own that is
// then added (Note [gradients written in place] in autograd/node.h) -- and, being lent, may be
// computed on the side stream beside the input gradients (Note [weight gradients on a second
// stream] in autograd/grad_stream.h). The bucket's hook still sees the finished gradient: the
// engine joins the side stream before a leaf's hooks run.
void Reducer::attach_grads() {
  if (flat_.defined() && std::none_of(params_.begin(), params_.end(),
                                      [](const Tensor& p) { return p.grad().defined(); })) {
    flat_.zero_();  // after zero_grad(): one fill for every gradient
    for (Bucket& bucket : buckets_) {
      for (size_t k = 0; k < bucket.params.size(); ++k) {
        const Tensor& p = params_[bucket.params[k]];
        p.set_grad(bucket.views[k]);
        autograd::mark_grad_zero(p);
      }
    }
    return;
  }
  for (Bucket& bucket : buckets_) {
    bool none_attached = true;
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      if (params_[bucket.params[k]].grad().same(bucket.views[k])) none_attached = false;
    }
    if (none_attached) bucket.flat.zero_();  // after zero_grad(): one fill for the bucket
    for (size_t k = 0; k < bucket.params.size(); ++k) {
      const Tensor& p = params_[bucket.params[k]];
      const Tensor g = p.grad();
      if (g.same(bucket.views[k])) continue;  // attached already: the backward adds to it
      if (g.defined()) bucket.views[k].copy_(g);  // something set its own .grad: keep its values
      else if (!none_attached) bucket.views[k].zero_();
      p.set_grad(bucket.views[k]);
      if (!g.defined()) autograd::mark_grad_zero(p);  // zeroed with the bucket, or on its own
    }
  }
}

void Reducer::on_gradient(size_t i, const Tensor& grad) {
  Bucket& bucket = buckets_[bucket_of_[i]];
  const Tensor& view = bucket.views[slot_of_[i]];
  if (!grad.same(view)) {  // something replaced .grad: bring the gradient back into the bucket
    view.copy_(grad);
    params_[i].set_grad(view);
  }
  if (!armed_) return;  // Note [the forward arms the reducer]: a local backward
  if (!in_backward_) {
    // The first gradient of this backward: reset the countdown and ask autograd to call us
    // once the whole pass is done.
    in_backward_ = true;
    next_bucket_ = 0;
    std::fill(ready_.begin(), ready_.end(), 0);
    for (Bucket& b : buckets_) {
      b.pending = b.params.size();
      b.wait = nullptr;
    }
    autograd::queue_callback([this] { finish_backward(); });
  }
  mark_ready(i);
  if (options_.overlap) launch_ready();
}

void Reducer::mark_ready(size_t i) {
  if (ready_[i]) return;  // a second gradient for it in one pass (retain_graph): counted once
  ready_[i] = 1;
  --buckets_[bucket_of_[i]].pending;
}

// Note [buckets in order]: a bucket whose gradients are all final is launched only once every
// bucket before it has been, so every rank issues the same collectives in the same order even
// when its autograd happens to finish the gradients in a different order.
void Reducer::launch_ready() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    if (observer_) observer_(next_bucket_, true);
    b.wait = launch_(next_bucket_, b.flat);
    ++next_bucket_;
  }
}

void Reducer::finish_backward() {
  in_backward_ = false;
  armed_ = false;  // the next backward is reduced only if a forward arms it again
  std::vector<size_t> unused;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) unused.push_back(i);
  }
  if (!unused.empty()) {
    if (!options_.find_unused_parameters) {
      std::string list;
      for (size_t k = 0; k < unused.size() && k < 5; ++k) list += (k ? ", '" : "'") + names_[unused[k]] + "'";
      if (unused.size() > 5) list += " and " + std::to_string(unused.size() - 5) + " more";
      TANDEM_THROW(Value, "DistributedDataParallel: parameter ", list,
                   " received no gradient in this backward pass; every rank must reduce every bucket, so "
                   "either use every parameter in the loss or construct DistributedDataParallel with "
                   "find_unused_parameters = true");
    }
    for (size_t i : unused) mark_ready(i);  // their bucket slots keep zeros (or what was accumulated)
  }
  launch_ready();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].wait) buckets_[b].wait();
    if (observer_) observer_(b, false);
  }
  ++reductions_;
}

}  // namespace tandem::parallel
