#pragma once
// ProcessGroup: collectives between processes, one rank per process.
//
// The in-process Communicator (parallel/comm.h) reduces over the devices of one process; a
// ProcessGroup reduces over the ranks of a job, each rank a process with one device. The bytes
// move through an engine made for it (docs/00-design.md, invariant 10):
//   "nccl"  GPU tensors: ncclCommInitRank with the unique id passed through the store, every
//           collective on the group's own communication stream (process_group_nccl.cpp);
//   "gloo"  CPU tensors: Gloo's TCP transport, its rendezvous through our store, every
//           collective run by one background thread in issue order (process_group_gloo.cpp).
// A backend not compiled into this build is a DistError that says so.
//
// Every collective returns a Work at once. work->wait() is stream-ordered where that means
// something: on a GPU the current stream of the tensor's device waits for the collective (an
// event, no host sync); on the CPU the host waits, since the CPU "stream" is the host. The
// tensors must stay alive and untouched until the work is waited on.
//
// Failures end, they never hang (docs/00-design.md, invariant 13; Note [collective failures] in
// process_group_monitor.cpp): every collective has a deadline (options.timeout, default 10 minutes as
// in PyTorch, or TANDEM_DIST_TIMEOUT seconds from the environment). A monitor thread publishes
// this rank's progress to the store about once a second and watches for ranks that left the
// store without saying goodbye. A collective that times out or whose peer died fails with
// one message naming the collective, its sequence number, this rank and the ranks that did
// not arrive:
//   "allreduce #17 (float32 x 62006, avg) on rank 1 of 2: timed out after 600 s; did not
//    arrive: rank 0 (last seen at #16)"
//   "allreduce #4 (float32 x 2445, avg) on rank 0 of 3: ... Connection reset by peer; rank 1
//    is gone (left the store without a goodbye)"
// The first options.fingerprint_collectives collectives are checked across ranks through the
// store (Note [collective fingerprints]): ranks that issue different collectives (a different
// bucket layout, a missing call) get an error naming both sides instead of a hang or garbage.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/backend.h"
#include "parallel/distributed/env.h"
#include "parallel/distributed/store.h"

namespace tandem::parallel {
class Trace;
}

namespace tandem::parallel::distributed {

// The reduction of a collective: tandem's one ReduceOp (kernels/backend.h), so code that uses both
// namespaces names one enum. Collectives take Sum, Avg (= Mean: Sum divided by the group size,
// PyTorch's AVG; floating dtypes only) and Max.
using tandem::ReduceOp;
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max"

// The result of a collective that may still be running.
class Work {
 public:
  virtual ~Work() = default;
  // GPU: the calling thread's current stream of the tensor's device waits for the collective
  // (no host sync). CPU: the host waits. Rethrows the collective's error (DistError /
  // TimeoutError) when it failed.
  virtual void wait() = 0;
  // The host waits for completion (both kinds), rethrowing the error.
  virtual void synchronize() = 0;
  // True once finished (successfully or not); never blocks.
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// The timeout of collectives: TANDEM_DIST_TIMEOUT (seconds, may be fractional) when set, else
// 10 minutes. ValueError naming the variable for a value that does not parse or is <= 0.
Milliseconds default_collective_timeout();
bool default_high_priority_stream();  // TANDEM_NCCL_HIGH_PRIORITY=1

struct ProcessGroupOptions {
  Milliseconds timeout = default_collective_timeout();
  int fingerprint_collectives = 8;  // the first N collectives are compared across ranks
  Milliseconds monitor_interval{500};  // progress publication and dead-rank check
  // NCCL: run collectives on a high-priority stream (PyTorch's is_high_priority_stream; off by
  // default there and here). TANDEM_NCCL_HIGH_PRIORITY=1 turns it on from the environment.
  bool high_priority_stream = default_high_priority_stream();
  // The group's name, which is also its prefix in the store: every key the group uses (the NCCL
  // id, Gloo's rendezvous, fingerprints, progress, the abort key) lives under "<group_name>/",
  // so groups on one store never share a key. Empty: "pg<k>", k counting the groups this process
  // made on that Store object (so every rank must make its groups in the same order, as in
  // PyTorch). init_process_group names its group "default_pg"; subgroups are named by new_group.
  std::string group_name;
};

class ProcessGroup {
 public:
  // `store` is shared by every rank of the job (a PrefixStore of it is fine); the group works
  // under "<options.group_name>/" in it. `global_ranks[i]` is the job's rank (the store client's
  // rank) of this group's rank i; empty: the identity (a group of the whole job).
  ProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options,
               std::vector<int> global_ranks = {});
  virtual ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }  // this process's rank in the group
  int size() const { return size_; }
  // The group's name and store prefix (ProcessGroupOptions::group_name).
  const std::string& group_name() const { return name_; }
  // The job's ranks of the group's members, by group rank (torch.distributed's
  // get_process_group_ranks), and the two conversions (get_global_rank, get_group_rank).
  // ValueError for a rank outside the group.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  int global_rank(int group_rank) const;
  int group_rank(int global_rank) const;

  // Note [subgroups]: torch.distributed.new_group(ranks). A new group of some of this group's
  // ranks, with the same backend, made by a collective call: every rank of *this* group calls
  // new_group with the same `ranks`, and makes its new_group calls in the same order (members
  // and non-members alike: the calls are counted to name the subgroups). `ranks` are ranks of
  // this group (for the job's group, the global ranks), in any order; the subgroup's rank i is
  // the i-th smallest. A duplicate, a rank outside [0, size()) or an empty list is a ValueError
  // naming it, on every rank. Members get the subgroup (its creation waits, up to the timeout,
  // for the other members: Gloo's rendezvous or NCCL's communicator setup); the others get
  // nullptr at once (PyTorch returns GroupMember.NON_GROUP_MEMBER there).
  // The subgroup is a group like any other: its own store prefix "<group_name()>/sub<k>" (k: this
  // group's k-th new_group call), its own communicator or Gloo context, sequence numbers,
  // fingerprints, monitor and abort key, so the collectives of two groups are never mixed up
  // and any number of groups may run collectives at the same time. Its lifetime is its own (it
  // keeps the store alive, not this group). Every rank still issues the same collectives in the
  // same order *per group*. Errors name the subgroup's rank and the global rank:
  //   "allreduce #3 (float32 x 10, sum) on rank 1 (global 3) of group [2, 3]: ..."
  // A failure in a subgroup ends that subgroup on all its members; the job's other groups learn
  // of it when a member unwinds (its groups then publish their abort keys) or dies.
  // options: those of the subgroup (default: this group's; group_name is always the derived one).
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks);
  std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, ProcessGroupOptions options);
  virtual std::string backend() const = 0;
  // Where this group's tensors live: the CPU for Gloo, this rank's GPU for NCCL.
  virtual Device device() const = 0;
  // Collectives issued so far (the next one gets this number).
  uint64_t sequence_number() const { return seq_; }
  const ProcessGroupOptions& options() const { return options_; }
  Store& store() { return *store_; }
  const std::shared_ptr<Store>& store_ptr() const { return store_; }

  // The collectives (torch.distributed's names and argument order). Tensors must be
  // contiguous and on this backend's device kind; every rank passes the same shape and dtype.
  // In place: every rank's t holds the reduction of all ranks' t.
  WorkPtr allreduce(const Tensor& t, ReduceOp op = ReduceOp::Sum);
  // Every rank's t holds root's t.
  WorkPtr broadcast(const Tensor& t, int root = 0);
  // all_gather_into_tensor: out [size * n] holds every rank's in [n], in rank order.
  WorkPtr allgather(const Tensor& out, const Tensor& in);
  // reduce_scatter_tensor: out [n] holds the reduction of chunk `rank` of every rank's in
  // [size * n].
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::Sum);
  // Returns once every rank has called it (the host waits; GPU work queued before is not
  // waited for).
  void barrier();
  // Point to point, for the teaching ring over processes (allreduce_ring_p2p in ring_p2p.h).
  WorkPtr send(const Tensor& t, int dst);
  WorkPtr recv(const Tensor& t, int src);

  // From now on every collective adds a span ("allreduce #12") on the trace's "comm" track
  // when it really ran (on the NCCL stream, or on Gloo's thread); nullptr stops. The trace must
  // cover device() and outlive its use here.
  void set_trace(Trace* trace) { trace_.store(trace); }

  // Waits until `key` exists in the group's store: true then, false once options().timeout has
  // passed; rethrows the group's error if it fails meanwhile. Polled rather than a blocking
  // wait, so the monitor can keep using the store at the same time.
  bool wait_for_key(const std::string& key);

  // Throws the error that ended this group (a failed collective, a dead rank); no-op while
  // the group is healthy. Every collective calls it first.
  void check_healthy() const;

  // Note [collectives in a CUDA graph] (collective_graph.h): whether this backend's collectives
  // can be captured into a CUDA graph and replayed from it (NCCL: they are kernels on its
  // stream; Gloo runs them on a host thread, which a graph cannot hold).
  virtual bool supports_capture() const { return false; }
  // A CUDA graph holding `count` collectives of this group has just been launched on the
  // current stream of device(). `numbered`: they already have their sequence numbers (the
  // capture issued them, and this launch is that step's); otherwise they take the next `count`
  // numbers, as if issued one by one. The backend then watches the graph's end like a
  // collective's: past the timeout, or on the engine's error, the group fails and the engine's
  // abort ends the kernels still replaying. Throws the group's error if it has failed.
  void graph_launched(uint64_t count, bool numbered);

  // The device the monitor thread runs under (set as its first act, before any CUDA call, so a
  // rank never makes a CUDA context on a GPU that is not its own): device(). Waits for the
  // thread to start.
  Device monitor_device() const;

 protected:
  // What a collective is, for fingerprints and error messages: "allreduce #17 (float32 x 62006)".
  struct Call {
    const char* op;
    uint64_t seq;
    Tensor t, other;  // other: allgather/reduce_scatter's second tensor
    ReduceOp reduce = ReduceOp::Sum;
    int peer = -1;  // root, dst or src
    uint64_t graph_collectives = 0;  // > 0: the launch of a CUDA graph holding this many, #seq the last
    std::string str() const;
  };
  virtual WorkPtr do_allreduce(const Call& c) = 0;
  virtual WorkPtr do_broadcast(const Call& c) = 0;
  virtual WorkPtr do_allgather(const Call& c) = 0;
  virtual WorkPtr do_reduce_scatter(const Call& c) = 0;
  virtual WorkPtr do_send(const Call& c) = 0;
  virtual WorkPtr do_recv(const Call& c) = 0;
  // Called once the group has failed (after the error is recorded and published): stop the
  // engine so nothing waits on it any more (ncclCommAbort; Gloo's pairs close). Any thread.
  virtual void abort_engine() {}
  // True while a collective issued on this group has not finished (queued or running).
  virtual bool has_work_in_flight() { return false; }
  // Makes the subgroup for new_group (same backend).
  virtual std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                                      ProcessGroupOptions options,
                                                      std::vector<int> global_ranks) = 0;
  // Backends check the device kind of the tensors here.
  virtual void check_tensor(const char* op, const Tensor& t) const = 0;

  // The failure message for `c` after `reason` ("timed out after 10 s", "peer closed the
  // connection"), with what the store knows about the other ranks.
  std::string failure_message(const Call& c, const std::string& reason);
  // Records the first error of the group (later ones are dropped), tells the other ranks
  // through the store's abort key, and calls abort_engine(). Thread-safe.
  void fail(const std::string& message, bool timeout);
  // Starts the monitor thread; backends call it at the end of their constructor.
  void start_monitor();
  void stop_monitor();
  // Note [leaving a group]: backends call it first in their destructor, before the engine is
  // torn down (which may wait). Stops the monitor and decides how this rank leaves: a clean
  // goodbye only when the group is healthy, no collective call of it threw, none is in flight
  // and no exception is unwinding; otherwise the group fails (its abort key is published at once
  // and the engine aborted), so the other ranks learn of it within a monitor interval.
  void leave();
  // "rank 1 of 2", or for a subgroup "rank 1 (global 3) of group [2, 3]".
  std::string where() const;
  // "rank 1", or "rank 1 (global 3)" where the two differ.
  std::string rank_str(int group_rank) const;
  // Called by the monitor about every monitor_interval: a backend checks its in-flight work
  // against the deadlines and the engine's own error state.
  virtual void poll_in_flight() {}
  // Watches the end of a launched CUDA graph's collectives (graph_launched): `c` describes them.
  virtual void watch_graph(const Call& c) { (void)c; }

  std::shared_ptr<Store> base_store_;  // the store as given
  std::string name_;
  std::shared_ptr<Store> store_;       // base_store_ under "<name_>/"
  int rank_, size_;
  ProcessGroupOptions options_;
  std::vector<int> global_ranks_;
  std::atomic<Trace*> trace_{nullptr};

 private:
  template <typename F>
  WorkPtr noting_errors(F&& f);
  std::vector<int> dead_ranks() const;  // members whose store connection ended without a goodbye
  Call begin(const char* op, const Tensor& t, const Tensor& other = Tensor(), int peer = -1,
             ReduceOp reduce = ReduceOp::Sum);
  void fingerprint(const Call& c);
  void monitor_loop();

  uint64_t seq_ = 0;
  std::vector<uint64_t> sends_to_, recvs_from_;  // per peer: point-to-point calls so far
  uint64_t subgroups_made_ = 0;                  // new_group calls so far
  bool left_ = false, clean_ = false;
  struct Monitor;
  std::unique_ptr<Monitor> monitor_;
};

// A group from explicit pieces: backend "nccl" (the current CUDA device is this rank's GPU),
// "gloo", or "auto" (nccl when a GPU is the current device... see init_process_group). Groups
// made on one store get distinct names (ProcessGroupOptions::group_name).
std::shared_ptr<ProcessGroup> new_process_group(const std::string& backend,
                                                std::shared_ptr<Store> store, int rank, int size,
                                                ProcessGroupOptions options = {});

// torch.distributed.init_process_group: reads the environment contract (env.h), connects to
// the TCP store (rank 0 hosts it; the store's timeout is options.timeout), and builds the
// group. backend "auto": "nccl" when `device` is a GPU, else "gloo". The rank's device is
// made current for NCCL. Errors name the variable, address or rank at fault.
struct DistributedContext {
  DistEnv env;
  std::shared_ptr<TCPStore> store;
  std::shared_ptr<ProcessGroup> group;  // named "default_pg"; its subgroups come from group->new_group
};
DistributedContext init_process_group(const std::string& backend, Device device,
                                      ProcessGroupOptions options = {});

// The names new_process_group accepts in this build ("gloo" only with Gloo, "nccl" only with
// NCCL).
std::vector<std::string> process_group_backends();

// torch.distributed.new_group(ranks) in its free-function shape: group->new_group(ranks).
std::shared_ptr<ProcessGroup> new_group(const std::shared_ptr<ProcessGroup>& group, std::vector<int> ranks);
std::shared_ptr<ProcessGroup> new_group(const std::shared_ptr<ProcessGroup>& group, std::vector<int> ranks,
                                        ProcessGroupOptions options);

}  // namespace tandem::parallel::distributed
