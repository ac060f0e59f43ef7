#include "parallel/distributed/ddp.h"

#include <atomic>
#include <map>
#include <sstream>

#include "autograd/grad_mode.h"
#include "core/error.h"
#include "parallel/replicate.h"

namespace tandem::parallel::distributed {

namespace {

// Distinguishes the DDP instances of one process in the store (every rank builds them in the
// same order, so the counters agree).
int next_instance() {
  static std::atomic<int> counter{0};
  return counter++;
}

int64_t mb_to_bytes(double mb) { return static_cast<int64_t>(mb * 1024.0 * 1024.0); }

std::string describe(const std::string& name, const Tensor& t) {
  return name + " " + dtype_name(t.dtype()) + " " + shape_str(t.shape());
}

}  // namespace

void broadcast_coalesced(ProcessGroup& group, const std::vector<Tensor>& tensors, int root) {
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (const Tensor& t : tensors) by_dtype[t.dtype()].push_back(t);
  for (auto& [dtype, ts] : by_dtype) {
    int64_t total = 0;
    for (const Tensor& t : ts) total += t.numel();
    Tensor flat = empty({total}, dtype, group.device());
    std::vector<Tensor> views = split_views(flat, ts);
    for (size_t k = 0; k < ts.size(); ++k) views[k].copy_(ts[k]);
    group.broadcast(flat, root)->wait();
    for (size_t k = 0; k < ts.size(); ++k) ts[k].copy_(views[k]);
  }
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 DistributedDataParallelOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(options), instance_(next_instance()) {
  TANDEM_CHECK(module_ != nullptr, Value, "DistributedDataParallel: no module");
  TANDEM_CHECK(group_ != nullptr, Value, "DistributedDataParallel: no process group");
  TANDEM_CHECK(options.bucket_cap_mb > 0 && options.first_bucket_cap_mb > 0, Value,
               "DistributedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be positive, got ",
               options.bucket_cap_mb, " and ", options.first_bucket_cap_mb);
  module_->to(group_->device());
  check_same_model_everywhere();

  // Rank 0's state everywhere (each rank may have initialized its model differently).
  if (group_->size() > 1) {
    std::vector<Tensor> state;
    for (const Tensor& p : module_->parameters()) state.push_back(p.detach());
    for (const Tensor& b : module_->buffers()) state.push_back(b);
    NoGradGuard no_grad;
    broadcast_coalesced(*group_, state, 0);
  }

  // Buffers live in one flat tensor per dtype, so the per-forward broadcast is one collective
  // per dtype (coalesce keeps each buffer's identity: the module still sees its tensors).
  CoalescedGroups buffers = coalesce_by_dtype(module_->buffers());
  buffer_groups_ = std::move(buffers.groups);
  buffer_flats_ = std::move(buffers.flats);

  std::vector<Tensor> params;
  std::vector<std::string> names;
  for (const auto& [name, p] : module_->named_parameters()) {
    if (!p.requires_grad()) continue;
    params.push_back(p);
    names.push_back(name);
  }
  // The parameters back to back in one buffer and (the Reducer's layout) their gradients in
  // another, in the same order: the optimizer then updates the whole model with one kernel
  // (Note [gradients in parameter order] in parallel/reducer.cpp). Each parameter keeps its
  // TensorImpl, so an optimizer built before this still holds the right tensors.
  {
    NoGradGuard no_grad;
    try_coalesce(params);
  }
  auto buckets = assign_buckets(params, mb_to_bytes(options.bucket_cap_mb), mb_to_bytes(options.first_bucket_cap_mb));
  ProcessGroup* pg = group_.get();
  Reducer::Launch launch = [pg](size_t, const Tensor& flat) -> Reducer::Wait {
    WorkPtr work = pg->allreduce(flat, ReduceOp::Avg);
    return [work] { work->wait(); };
  };
  // Note [one rank does not overlap]: with one rank every reduction is the identity and there is
  // no peer to overlap with; launching the buckets during backward then only costs (7% of a
  // ResNet-18 step on one H200, measured against 1.7% when they go after backward), so a group
  // of one reduces after backward.
  const bool overlap = options.overlap && group_->size() > 1;
  reducer_ = std::make_unique<Reducer>(std::move(params), std::move(names), std::move(buckets), std::move(launch),
                                       Reducer::Options{options.find_unused_parameters, overlap});
}

DistributedDataParallel::~DistributedDataParallel() = default;

// Every rank writes its model's description (names, dtypes, shapes, bucket caps) to the store
// and compares it with rank 0's; rank 0 compares with everyone's. A difference is an error on
// both sides naming the first parameter that differs — instead of collectives of different
// sizes later, which hang or mix bytes.
void DistributedDataParallel::check_same_model_everywhere() {
  const int rank = group_->rank(), size = group_->size();
  if (size == 1) return;
  std::vector<std::string> lines;
  for (const auto& [name, p] : module_->named_parameters()) lines.push_back(describe(name, p));
  for (const auto& [name, b] : module_->named_buffers()) lines.push_back("buffer " + describe(name, b));
  std::ostringstream caps;
  caps << "buckets " << options_.bucket_cap_mb << " MB, first " << options_.first_bucket_cap_mb << " MB";
  lines.push_back(caps.str());
  std::string mine;
  for (const std::string& l : lines) mine += l + "\n";

  Store& store = group_->store();
  const std::string key = "ddp/" + std::to_string(instance_) + "/model/";
  store.set(key + std::to_string(rank), mine);

  auto compare = [&](int other) {
    const std::string k = key + std::to_string(other);
    TANDEM_CHECK(group_->wait_for_key(k), Timeout, "DistributedDataParallel on rank ", rank,
                 ": timed out waiting for rank ", other, "'s model description");
    const std::string theirs = store.get_string(k);
    if (theirs == mine) return;
    std::istringstream a(theirs), b(mine);
    std::string la, lb;
    size_t line = 0;
    while (true) {
      const bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
      if (!ga && !gb) break;
      if (!ga) la = "(nothing)";
      if (!gb) lb = "(nothing)";
      if (la != lb) break;
      ++line;
    }
    TANDEM_THROW(Dist, "DistributedDataParallel: the model differs between ranks: entry ", line, " is '", la,
                 "' on rank ", other, " but '", lb, "' on rank ", rank,
                 " (every rank must build the same model with the same options)");
  };
  if (rank == 0) {
    for (int r = 1; r < size; ++r) compare(r);
  } else {
    compare(0);
  }
}

void DistributedDataParallel::broadcast_buffers() {
  for (size_t g = 0; g < buffer_groups_.size(); ++g) {
    if (buffer_flats_[g].defined() && is_coalesced(buffer_groups_[g], buffer_flats_[g])) {
      group_->broadcast(buffer_flats_[g], 0)->wait();
    } else {
      broadcast_coalesced(*group_, buffer_groups_[g], 0);  // something moved them: pack each time
    }
  }
}

Tensor DistributedDataParallel::forward(const Tensor& x) {
  if (grad_enabled()) {
    if (module_->is_training() && options_.broadcast_buffers && group_->size() > 1 && !buffer_groups_.empty()) {
      NoGradGuard no_grad;
      broadcast_buffers();
    }
    // Note [the forward arms the reducer] (parallel/reducer.h): decided here, not at backward.
    if (require_backward_grad_sync_) reducer_->prepare_for_backward();
    else reducer_->attach_grads();
  }
  return (*module_)(x);
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp)
    : ddp_(ddp), prev_(ddp.require_backward_grad_sync_) {
  ddp_.require_backward_grad_sync_ = false;
}

DistributedDataParallel::NoSync::~NoSync() { ddp_.require_backward_grad_sync_ = prev_; }

}  // namespace tandem::parallel::distributed
