// What every backend shares: argument checks, sequence numbers, fingerprints, subgroups and the
// making of groups. The monitor thread, leaving a group and the one failure message a rank
// prints when the job cannot go on are in process_group_monitor.cpp.
#include "parallel/distributed/process_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/stream.h"
#include "parallel/distributed/process_group_backends.h"
#include "parallel/distributed/process_group_monitor.h"

namespace tandem::parallel::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

Milliseconds default_collective_timeout() {
  const char* v = std::getenv("TANDEM_DIST_TIMEOUT");
  if (v == nullptr || *v == '\0') return std::chrono::minutes(10);
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  TANDEM_CHECK(end != v && *end == '\0' && s > 0, Value, "TANDEM_DIST_TIMEOUT='", v,
               "' is not a positive number of seconds");
  return Milliseconds(static_cast<int64_t>(s * 1000.0 + 0.5));
}

bool default_high_priority_stream() {
  const char* v = std::getenv("TANDEM_NCCL_HIGH_PRIORITY");
  return v != nullptr && std::string(v) == "1";
}

namespace {

std::string seconds_str(Milliseconds t) {
  std::ostringstream os;
  os << static_cast<double>(t.count()) / 1000.0 << " s";
  return os.str();
}


// "pg<k>": the k-th group this process made on `store` (ProcessGroupOptions::group_name). Counted
// per Store object, so ranks that are threads of one process (each with its own store client)
// count alike; an entry whose store is gone is dropped.
std::string default_group_name(const std::shared_ptr<Store>& store) {
  static std::mutex mu;
  static std::map<const Store*, std::pair<std::weak_ptr<Store>, int>> made;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = made.begin(); it != made.end();) it = it->second.first.expired() ? made.erase(it) : std::next(it);
  auto& entry = made[store.get()];
  if (entry.first.expired()) entry = {store, 0};
  return "pg" + std::to_string(entry.second++);
}

std::string join_ints(const std::vector<int>& xs) {
  std::string out;
  for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + std::to_string(xs[i]);
  return out;
}

}  // namespace

SettleResult settle_unlocked(std::mutex& mu, const std::function<bool()>& aborted,
                             const std::function<bool()>& in_progress, Milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (aborted()) return SettleResult::kAborted;
      if (!in_progress()) return SettleResult::kDone;
    }
    if (std::chrono::steady_clock::now() > deadline) return SettleResult::kTimedOut;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

std::string ProcessGroup::Call::str() const {
  std::ostringstream os;
  if (graph_collectives > 0) {
    os << "the " << graph_collectives << " collective" << (graph_collectives > 1 ? "s #" : " #")
       << seq + 1 - graph_collectives;
    if (graph_collectives > 1) os << "..#" << seq;
    os << " replayed from a CUDA graph";
    return os.str();
  }
  os << op << " #" << seq << " (" << dtype_name(t.dtype()) << " x " << t.numel();
  if (other.defined()) os << " / " << other.numel();
  if (std::string(op) == "allreduce" || std::string(op) == "reduce_scatter") os << ", " << reduce_op_name(reduce);
  if (peer >= 0) os << ", " << (std::string(op) == "broadcast" ? "root " : "peer ") << peer;
  os << ")";
  return os.str();
}

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options,
                           std::vector<int> global_ranks)
    : base_store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(options),
      global_ranks_(std::move(global_ranks)),
      monitor_(std::make_unique<Monitor>()) {
  TANDEM_CHECK(base_store_ != nullptr, Value, "ProcessGroup: no store");
  TANDEM_CHECK(size >= 1, Value, "ProcessGroup: world size must be >= 1, got ", size);
  TANDEM_CHECK(rank >= 0 && rank < size, Value, "ProcessGroup: rank ", rank, " is not in [0, ", size, ")");
  TANDEM_CHECK(options.timeout.count() > 0, Value, "ProcessGroup: timeout must be positive");
  if (global_ranks_.empty()) {
    for (int r = 0; r < size; ++r) global_ranks_.push_back(r);
  }
  TANDEM_CHECK(static_cast<int>(global_ranks_.size()) == size, Value, "ProcessGroup: ", global_ranks_.size(),
               " global ranks for a group of ", size);
  name_ = options_.group_name.empty() ? default_group_name(base_store_) : options_.group_name;
  options_.group_name = name_;
  store_ = std::make_shared<PrefixStore>(name_, base_store_);
}

int ProcessGroup::global_rank(int group_rank) const {
  TANDEM_CHECK(group_rank >= 0 && group_rank < size_, Value, "group ", name_, ": rank ", group_rank,
               " is not in [0, ", size_, ")");
  return global_ranks_[static_cast<size_t>(group_rank)];
}

int ProcessGroup::group_rank(int global_rank) const {
  for (int r = 0; r < size_; ++r) {
    if (global_ranks_[static_cast<size_t>(r)] == global_rank) return r;
  }
  TANDEM_THROW(Value, "group ", name_, ": global rank ", global_rank, " is not in the group (global ranks ",
               join_ints(global_ranks_), ")");
}

std::vector<int> ProcessGroup::dead_ranks() const {
  // The store names global ranks; this group's members among them, as group ranks.
  std::vector<int> dead;
  for (int g : store_->disconnected_ranks()) {
    for (int r = 0; r < size_; ++r) {
      if (global_ranks_[static_cast<size_t>(r)] == g) dead.push_back(r);
    }
  }
  return dead;
}

std::string ProcessGroup::rank_str(int group_rank) const {
  std::string s = "rank " + std::to_string(group_rank);
  if (group_rank >= 0 && group_rank < size_ && global_ranks_[static_cast<size_t>(group_rank)] != group_rank) {
    s += " (global " + std::to_string(global_ranks_[static_cast<size_t>(group_rank)]) + ")";
  }
  return s;
}

std::string ProcessGroup::where() const {
  bool identity = true;
  for (int r = 0; r < size_; ++r) identity = identity && global_ranks_[static_cast<size_t>(r)] == r;
  if (identity) return "rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  return rank_str(rank_) + " of group [" + join_ints(global_ranks_) + "]";
}

// ---- the collectives ----------------------------------------------------------------------

ProcessGroup::Call ProcessGroup::begin(const char* op, const Tensor& t, const Tensor& other, int peer,
                                       ReduceOp reduce) {
  check_healthy();
  TANDEM_CHECK(t.defined(), Value, op, " on ", where(), ": undefined tensor");
  TANDEM_CHECK(t.is_contiguous(), Value, op, " on ", where(), ": the tensor must be contiguous, got ", t.str());
  check_tensor(op, t);
  if (other.defined()) {
    TANDEM_CHECK(other.is_contiguous(), Value, op, " on ", where(), ": the tensor must be contiguous");
    TANDEM_CHECK(other.dtype() == t.dtype() && other.device() == t.device(), Value, op, " on ", where(),
                 ": ", t.str(), " and ", other.str(), " differ in dtype or device");
  }
  const bool p2p = std::string(op) == "send" || std::string(op) == "recv";
  if (peer >= 0 || p2p) {
    TANDEM_CHECK(peer >= 0 && peer < size_, Value, op, " on ", where(), ": rank ", peer, " is not in [0, ",
                 size_, ")");
  }
  // Point-to-point calls are numbered per peer and direction, so the k-th send from a to b
  // pairs with the k-th recv of b from a whatever else either does in between.
  uint64_t number = seq_;
  if (p2p) {
    auto& counts = std::string(op) == "send" ? sends_to_ : recvs_from_;
    if (counts.empty()) counts.assign(static_cast<size_t>(size_), 0);
    number = counts[static_cast<size_t>(peer)]++;
  } else {
    ++seq_;
  }
  Call c{op, number, t, other, reduce, peer};
  if (!p2p) {
    monitor_->started.store(seq_);
    if (size_ > 1 && c.seq < static_cast<uint64_t>(options_.fingerprint_collectives)) fingerprint(c);
  }
  return c;
}

void ProcessGroup::graph_launched(uint64_t count, bool numbered) {
  check_healthy();
  if (count == 0) return;
  if (!numbered) {
    seq_ += count;
    monitor_->started.store(seq_);
  }
  Call c{"graph", seq_ - 1, Tensor(), Tensor()};
  c.graph_collectives = count;
  watch_graph(c);
}

// Note [collective fingerprints]
// NCCL and Gloo trust every rank to issue the same collectives in the same order with the same
// sizes; when one rank does not (a model built differently, a bucket layout that differs), the
// result is a hang or silently mixed bytes. For its first few collectives a group therefore
// writes a description of each ("allreduce #3 (float32 x 1000, sum)") to the store and compares
// it with rank 0's before starting it. The cost (a store round trip per rank and collective)
// is paid only in the first steps, when layouts are decided; a mismatch becomes an error on the
// differing rank, and through the abort key on every other.
void ProcessGroup::fingerprint(const Call& c) {
  const std::string mine = c.str();
  const std::string key = "pg/fp/" + std::to_string(c.seq) + "/";
  store_->set(key + std::to_string(rank_), mine);
  if (rank_ == 0) return;
  const std::string root_key = key + "0";
  if (!wait_for_key(root_key)) {
    fail(failure_message(c, "timed out after " + seconds_str(options_.timeout) + " comparing collectives"), true);
    check_healthy();
  }
  const std::string theirs = store_->get_string(root_key);
  if (theirs != mine) {
    const std::string group = where().find(" of group ") == std::string::npos
                                  ? std::string()
                                  : " of group [" + join_ints(global_ranks_) + "]";
    fail("collective #" + std::to_string(c.seq) + " differs between ranks" + group + ": " + rank_str(0) +
             " called " + theirs + ", " + rank_str(rank_) + " called " + mine +
             " (every rank must issue the same collectives in the same order)",
         false);
    check_healthy();
  }
}

bool ProcessGroup::wait_for_key(const std::string& key) {
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  while (!store_->check({key})) {
    check_healthy();
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Every collective call goes through here: an error it throws is remembered, so that a rank
// which catches it and leaves does not say a clean goodbye (Note [leaving a group]). The Work
// it returns reports its own errors through the group (fail), which is remembered as well.
template <typename F>
WorkPtr ProcessGroup::noting_errors(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(monitor_->error_mu);
    if (monitor_->call_error.empty()) monitor_->call_error = e.what();
    throw;
  }
}

WorkPtr ProcessGroup::allreduce(const Tensor& t, ReduceOp op) {
  return noting_errors([&] {
    TANDEM_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Max, Value, "allreduce on ",
                 where(), ": reduce op ", static_cast<int>(op), " is not sum, avg or max");
    return do_allreduce(begin("allreduce", t, Tensor(), -1, op));
  });
}

WorkPtr ProcessGroup::broadcast(const Tensor& t, int root) {
  return noting_errors([&] {
    TANDEM_CHECK(root >= 0 && root < size_, Value, "broadcast on ", where(), ": root ", root, " is not in [0, ",
                 size_, ")");
    return do_broadcast(begin("broadcast", t, Tensor(), root));
  });
}

WorkPtr ProcessGroup::allgather(const Tensor& out, const Tensor& in) {
  return noting_errors([&] {
    TANDEM_CHECK(out.defined() && in.defined() && out.numel() == in.numel() * size_, Shape, "allgather on ",
                 where(), ": output must have ", size_, " x ", in.defined() ? in.numel() : 0, " elements, got ",
                 out.defined() ? out.numel() : 0);
    return do_allgather(begin("allgather", in, out));
  });
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) {
  return noting_errors([&] {
    TANDEM_CHECK(op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Max, Value, "reduce_scatter on ",
                 where(), ": reduce op ", static_cast<int>(op), " is not sum, avg or max");
    TANDEM_CHECK(out.defined() && in.defined() && in.numel() == out.numel() * size_, Shape, "reduce_scatter on ",
                 where(), ": input must have ", size_, " x ", out.defined() ? out.numel() : 0, " elements, got ",
                 in.defined() ? in.numel() : 0);
    return do_reduce_scatter(begin("reduce_scatter", in, out, -1, op));
  });
}

WorkPtr ProcessGroup::send(const Tensor& t, int dst) {
  return noting_errors([&] {
    TANDEM_CHECK(dst != rank_, Value, "send on ", where(), ": cannot send to itself");
    return do_send(begin("send", t, Tensor(), dst));
  });
}

WorkPtr ProcessGroup::recv(const Tensor& t, int src) {
  return noting_errors([&] {
    TANDEM_CHECK(src != rank_, Value, "recv on ", where(), ": cannot receive from itself");
    return do_recv(begin("recv", t, Tensor(), src));
  });
}

void ProcessGroup::barrier() {
  // A one-element allreduce on the group's own engine: it also orders after every collective
  // issued before, which a store-only barrier would not.
  Tensor t = zeros({1}, kFloat32, device());
  WorkPtr w = allreduce(t);
  noting_errors([&] {
    w->synchronize();
    return w;
  });
}

// ---- subgroups ---------------------------------------------------------------------------

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks) {
  return new_group(std::move(ranks), options_);
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks, ProcessGroupOptions options) {
  // Counted before any check, on members and non-members alike, so that the names stay in step
  // on every rank even when a call fails on all of them.
  const uint64_t k = subgroups_made_++;
  check_healthy();
  TANDEM_CHECK(!ranks.empty(), Value, "new_group on ", where(), ": the list of ranks is empty");
  for (int r : ranks) {
    TANDEM_CHECK(r >= 0 && r < size_, Value, "new_group on ", where(), ": rank ", r, " is not in [0, ", size_,
                 ") (ranks [", join_ints(ranks), "])");
  }
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 1; i < ranks.size(); ++i) {
    TANDEM_CHECK(ranks[i] != ranks[i - 1], Value, "new_group on ", where(), ": rank ", ranks[i],
                 " appears more than once in [", join_ints(ranks), "]");
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) return nullptr;
  std::vector<int> global;
  for (int r : ranks) global.push_back(global_ranks_[static_cast<size_t>(r)]);
  options.group_name = name_ + "/sub" + std::to_string(k);
  return make_subgroup(base_store_, static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()), options,
                       std::move(global));
}

std::shared_ptr<ProcessGroup> new_group(const std::shared_ptr<ProcessGroup>& group, std::vector<int> ranks) {
  TANDEM_CHECK(group != nullptr, Value, "new_group: no parent group (nullptr: this rank is not in it)");
  return group->new_group(std::move(ranks));
}

std::shared_ptr<ProcessGroup> new_group(const std::shared_ptr<ProcessGroup>& group, std::vector<int> ranks,
                                        ProcessGroupOptions options) {
  TANDEM_CHECK(group != nullptr, Value, "new_group: no parent group (nullptr: this rank is not in it)");
  return group->new_group(std::move(ranks), options);
}

// ---- making groups ---------------------------------------------------------------------

std::vector<std::string> process_group_backends() {
  std::vector<std::string> names;
#ifdef TANDEM_WITH_GLOO
  names.push_back("gloo");
#endif
#ifdef TANDEM_WITH_NCCL
  names.push_back("nccl");
#endif
  return names;
}

namespace {
std::shared_ptr<ProcessGroup> make_group(const std::string& backend, std::shared_ptr<Store> store, int rank, int size,
                                         ProcessGroupOptions options, const std::string& master_addr) {
  if (backend == "gloo") return make_gloo_group(std::move(store), rank, size, options, master_addr);
  if (backend == "nccl") return make_nccl_group(std::move(store), rank, size, options);
  TANDEM_THROW(Value, "process group backend \"", backend, "\" is not one of gloo, nccl, auto");
}
}  // namespace

std::shared_ptr<ProcessGroup> new_process_group(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                                int size, ProcessGroupOptions options) {
  const std::string b = backend == "auto" ? (current_device().is_cuda() ? "nccl" : "gloo") : backend;
  return make_group(b, std::move(store), rank, size, options, "127.0.0.1");
}

DistributedContext init_process_group(const std::string& backend, Device device, ProcessGroupOptions options) {
  DistributedContext ctx;
  ctx.env = read_dist_env();
  const std::string b = backend == "auto" ? (device.is_cuda() ? "nccl" : "gloo") : backend;
  TANDEM_CHECK(b != "nccl" || device.is_cuda(), Device, "rank ", ctx.env.rank, ": the nccl backend needs a GPU, got ",
               device.str(), " (use gloo for the CPU)");
  if (device.is_cuda()) {
    check_device_exists(device);
    set_current_device(device);
  }
  TCPStoreOptions so;
  so.is_master = ctx.env.rank == 0 && !ctx.env.store_hosted;
  so.rank = ctx.env.rank;
  so.timeout = options.timeout;
  so.job_id = ctx.env.job_id;
  so.world_size = ctx.env.world_size;  // the connection cap and the loopback check (store.h)
  so.local_world_size = ctx.env.local_world_size;
  ctx.store = std::make_shared<TCPStore>(ctx.env.master_addr, ctx.env.master_port, so);
  if (options.group_name.empty()) options.group_name = "default_pg";
  ctx.group = make_group(b, ctx.store, ctx.env.rank, ctx.env.world_size, options, ctx.env.master_addr);
  return ctx;
}

}  // namespace tandem::parallel::distributed
