// What every backend shares: argument checks, sequence numbers, fingerprints, the monitor
// thread, and the one failure message a rank prints when the job cannot go on.
#include "parallel/distributed/process_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/stream.h"
#include "parallel/distributed/process_group_backends.h"

namespace tandem::parallel::distributed {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

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

std::string progress_key(int rank) { return "pg/progress/" + std::to_string(rank); }
const char* kAbortKey = "pg/abort";

}  // namespace

std::string ProcessGroup::Call::str() const {
  std::ostringstream os;
  os << op << " #" << seq << " (" << dtype_name(t.dtype()) << " x " << t.numel();
  if (other.defined()) os << " / " << other.numel();
  if (std::string(op) == "allreduce" || std::string(op) == "reduce_scatter") os << ", " << reduce_op_name(reduce);
  if (peer >= 0) os << ", " << (std::string(op) == "broadcast" ? "root " : "peer ") << peer;
  os << ")";
  return os.str();
}

// ---- the monitor ------------------------------------------------------------------------

struct ProcessGroup::Monitor {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  std::atomic<uint64_t> started{0};  // collectives issued (published as progress)
  uint64_t published = ~0ull;
  // The group's first error; once set, every call throws it.
  mutable std::mutex error_mu;
  std::string error;
  bool error_is_timeout = false;
  bool engine_aborted = false;
};

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : store_(std::move(store)), rank_(rank), size_(size), options_(options), monitor_(std::make_unique<Monitor>()) {
  TANDEM_CHECK(store_ != nullptr, Value, "ProcessGroup: no store");
  TANDEM_CHECK(size >= 1, Value, "ProcessGroup: world size must be >= 1, got ", size);
  TANDEM_CHECK(rank >= 0 && rank < size, Value, "ProcessGroup: rank ", rank, " is not in [0, ", size, ")");
  TANDEM_CHECK(options.timeout.count() > 0, Value, "ProcessGroup: timeout must be positive");
}

ProcessGroup::~ProcessGroup() {
  stop_monitor();
  if (size_ == 1) return;
  bool healthy = true;
  {
    std::lock_guard<std::mutex> g(monitor_->error_mu);
    healthy = monitor_->error.empty();
  }
  try {
    if (std::uncaught_exceptions() > 0) {
      // A rank that unwinds because of an error tells the others at once, so they do not wait
      // for the timeout in their next collective (Note [collective failures]).
      store_->set(kAbortKey, "rank " + std::to_string(rank_) + " exited with an error");
    } else if (healthy) {
      // Note [leaving together]: rank 0's process hosts the store, so it leaves last — the
      // others may still be using the store (their monitor, a last key) a moment after their
      // final collective. Bounded: a rank that never comes costs at most 30 s here.
      store_->add("pg/exited", 1);
      if (rank_ == 0) {
        const auto deadline = std::chrono::steady_clock::now() + std::min<Milliseconds>(options_.timeout, std::chrono::seconds(30));
        while (store_->add("pg/exited", 0) < size_ && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    }
  } catch (...) {  // the store may be gone already: nothing left to coordinate
  }
}

void ProcessGroup::start_monitor() {
  if (size_ == 1) return;  // nobody to wait for
  monitor_->thread = std::thread([this] { monitor_loop(); });
}

void ProcessGroup::stop_monitor() {
  if (!monitor_ || !monitor_->thread.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(monitor_->mu);
    monitor_->stop = true;
  }
  monitor_->cv.notify_all();
  monitor_->thread.join();
}

// Note [collective failures]
// A collective can fail in three ways, and each must end every rank within the timeout with
// a message a person can act on:
//   1. the engine reports it (Gloo: a peer closed its connection, Gloo's own timeout; NCCL:
//      ncclCommGetAsyncError) — the backend calls fail() with failure_message();
//   2. it runs past its deadline — the backend's poll_in_flight() (NCCL) or the waiting
//      host (Gloo) calls fail();
//   3. another rank failed or died first — the monitor sees the abort key (set by fail() on
//      that rank, or by a rank unwinding with an exception) or the store's disconnect key of a
//      rank killed without saying goodbye, and fails this group without waiting.
// fail() keeps the first error, publishes it as the abort key and stops the engine; every
// later call on the group rethrows it (check_healthy), so the program unwinds to main and
// exits non-zero, and the launcher stops the rest.
void ProcessGroup::monitor_loop() {
  std::unique_lock<std::mutex> lock(monitor_->mu);
  while (!monitor_->stop) {
    monitor_->cv.wait_for(lock, options_.monitor_interval);
    if (monitor_->stop) break;
    lock.unlock();
    try {
      const uint64_t started = monitor_->started.load();
      if (started != monitor_->published) {
        store_->set(progress_key(rank_), std::to_string(started));
        monitor_->published = started;
      }
      bool healthy;
      {
        std::lock_guard<std::mutex> g(monitor_->error_mu);
        healthy = monitor_->error.empty();
      }
      if (healthy && store_->check({kAbortKey})) {
        fail("rank " + std::to_string(rank_) + " stops because another rank failed: " +
                 store_->get_string(kAbortKey),
             false);
      }
      // One request for every rank that left without a goodbye (store.h), not one per rank.
      for (int r : healthy ? store_->disconnected_ranks() : std::vector<int>{}) {
        if (r != rank_ && r < size_) {
          fail("rank " + std::to_string(r) + " died (it left the store without saying goodbye); rank " +
                   std::to_string(rank_) + " stops",
               false);
          break;
        }
      }
      poll_in_flight();
    } catch (const std::exception& e) {
      fail("rank " + std::to_string(rank_) + " lost the store: " + e.what(), false);
    }
    lock.lock();
  }
}

void ProcessGroup::fail(const std::string& message, bool timeout) {
  {
    std::lock_guard<std::mutex> g(monitor_->error_mu);
    if (!monitor_->error.empty()) return;
    monitor_->error = message;
    monitor_->error_is_timeout = timeout;
  }
  try {
    if (size_ > 1 && !store_->check({kAbortKey})) store_->set(kAbortKey, message);
  } catch (...) {  // the store may be what failed
  }
  bool abort = false;
  {
    std::lock_guard<std::mutex> g(monitor_->error_mu);
    abort = !monitor_->engine_aborted;
    monitor_->engine_aborted = true;
  }
  if (abort) abort_engine();
}

void ProcessGroup::check_healthy() const {
  std::lock_guard<std::mutex> g(monitor_->error_mu);
  if (monitor_->error.empty()) return;
  if (monitor_->error_is_timeout) throw TimeoutError(monitor_->error);
  throw DistError(monitor_->error);
}

std::string ProcessGroup::failure_message(const Call& c, const std::string& reason) {
  std::ostringstream os;
  os << c.str() << " on rank " << rank_ << " of " << size_ << ": " << reason;
  try {
    // Dead ranks first (the store saw their connection drop without a goodbye); then live ranks
    // whose published progress shows they never started this collective. A rank that has not
    // published yet (progress goes out about once per monitor interval) is not accused.
    std::vector<std::string> dead, behind;
    // A peer's death can reach this rank through the engine (a closed connection) a moment
    // before the store's server notices it: look again for a short while before giving up.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    do {
      dead.clear();
      behind.clear();
      const std::vector<int> gone = store_->disconnected_ranks();
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        if (std::find(gone.begin(), gone.end(), r) != gone.end()) {
          dead.push_back(std::to_string(r));
        } else if (store_->check({progress_key(r)})) {
          const int64_t seen = std::stoll(store_->get_string(progress_key(r)));
          if (seen <= static_cast<int64_t>(c.seq)) {
            behind.push_back(std::to_string(r) + " (last seen at #" + std::to_string(seen - 1) + ")");
          }
        }
      }
      if (!dead.empty() || !behind.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (std::chrono::steady_clock::now() < give_up);
    auto join = [](const std::vector<std::string>& xs) {
      std::string out;
      for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + xs[i];
      return out;
    };
    if (!dead.empty()) os << "; rank " << join(dead) << (dead.size() > 1 ? " are" : " is") << " gone (left the store without a goodbye)";
    if (!behind.empty()) os << "; did not arrive: rank " << join(behind);
  } catch (const std::exception& e) {
    os << " (the store could not say which ranks are missing: " << e.what() << ")";
  }
  return os.str();
}

// ---- the collectives ----------------------------------------------------------------------

ProcessGroup::Call ProcessGroup::begin(const char* op, const Tensor& t, const Tensor& other, int peer,
                                       ReduceOp reduce) {
  check_healthy();
  TANDEM_CHECK(t.defined(), Value, op, " on rank ", rank_, ": undefined tensor");
  TANDEM_CHECK(t.is_contiguous(), Value, op, " on rank ", rank_, ": the tensor must be contiguous, got ", t.str());
  check_tensor(op, t);
  if (other.defined()) {
    TANDEM_CHECK(other.is_contiguous(), Value, op, " on rank ", rank_, ": the tensor must be contiguous");
    TANDEM_CHECK(other.dtype() == t.dtype() && other.device() == t.device(), Value, op, " on rank ", rank_,
                 ": ", t.str(), " and ", other.str(), " differ in dtype or device");
  }
  const bool p2p = std::string(op) == "send" || std::string(op) == "recv";
  if (peer >= 0 || p2p) {
    TANDEM_CHECK(peer >= 0 && peer < size_, Value, op, " on rank ", rank_, ": rank ", peer, " is not in [0, ",
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
    fail("collective #" + std::to_string(c.seq) + " differs between ranks: rank 0 called " + theirs + ", rank " +
             std::to_string(rank_) + " called " + mine +
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

WorkPtr ProcessGroup::allreduce(const Tensor& t, ReduceOp op) {
  return do_allreduce(begin("allreduce", t, Tensor(), -1, op));
}

WorkPtr ProcessGroup::broadcast(const Tensor& t, int root) {
  TANDEM_CHECK(root >= 0 && root < size_, Value, "broadcast on rank ", rank_, ": root ", root, " is not in [0, ",
               size_, ")");
  return do_broadcast(begin("broadcast", t, Tensor(), root));
}

WorkPtr ProcessGroup::allgather(const Tensor& out, const Tensor& in) {
  TANDEM_CHECK(out.defined() && in.defined() && out.numel() == in.numel() * size_, Shape, "allgather on rank ",
               rank_, ": output must have ", size_, " x ", in.defined() ? in.numel() : 0, " elements, got ",
               out.defined() ? out.numel() : 0);
  return do_allgather(begin("allgather", in, out));
}

WorkPtr ProcessGroup::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) {
  TANDEM_CHECK(out.defined() && in.defined() && in.numel() == out.numel() * size_, Shape, "reduce_scatter on rank ",
               rank_, ": input must have ", size_, " x ", out.defined() ? out.numel() : 0, " elements, got ",
               in.defined() ? in.numel() : 0);
  return do_reduce_scatter(begin("reduce_scatter", in, out, -1, op));
}

WorkPtr ProcessGroup::send(const Tensor& t, int dst) {
  TANDEM_CHECK(dst != rank_, Value, "send on rank ", rank_, ": cannot send to itself");
  return do_send(begin("send", t, Tensor(), dst));
}

WorkPtr ProcessGroup::recv(const Tensor& t, int src) {
  TANDEM_CHECK(src != rank_, Value, "recv on rank ", rank_, ": cannot receive from itself");
  return do_recv(begin("recv", t, Tensor(), src));
}

void ProcessGroup::barrier() {
  // A one-element allreduce on the group's own engine: it also orders after every collective
  // issued before, which a store-only barrier would not.
  Tensor t = zeros({1}, kFloat32, device());
  allreduce(t)->synchronize();
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
  so.is_master = ctx.env.rank == 0;
  so.rank = ctx.env.rank;
  so.timeout = options.timeout;
  so.job_id = ctx.env.job_id;
  ctx.store = std::make_shared<TCPStore>(ctx.env.master_addr, ctx.env.master_port, so);
  ctx.group = make_group(b, std::make_shared<PrefixStore>("default_pg", ctx.store), ctx.env.rank,
                         ctx.env.world_size, options, ctx.env.master_addr);
  return ctx;
}

}  // namespace tandem::parallel::distributed
