// The NCCL backend: this rank's GPU, one NCCL communicator per group.
//
// Rank 0 makes the unique id and puts it in the store; every rank builds its communicator with
// ncclCommInitRankConfig in non-blocking mode, so a rank that never arrives is a timeout with
// a message, not a hang inside NCCL. Every collective runs on the group's own communication
// stream: an event orders it after the work already queued on the caller's stream, and
// Work::wait() makes the caller's stream wait for its end — no host synchronization anywhere
// (STYLE.md, "Multi-GPU"). The monitor thread (process_group_monitor.cpp) polls the collectives in
// flight: past its deadline, or when ncclCommGetAsyncError reports an error, the group fails
// and ncclCommAbort ends the kernels, so nothing waits on them any more.
#include "parallel/distributed/process_group_backends.h"

#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

#include "core/cuda_graph.h"
#include "core/error.h"
#include "core/stream.h"
#include "parallel/trace.h"

#ifdef TANDEM_WITH_NCCL
#include <nccl.h>

#include "core/cuda_check.h"
#include "parallel/nccl_types.h"
#endif

namespace tandem::parallel::distributed {

#ifndef TANDEM_WITH_NCCL

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions, std::vector<int>) {
  TANDEM_THROW(Dist, "process group backend \"nccl\" is not in this build of tandem (it needs CUDA and NCCL "
                     "found when it was built); use \"gloo\" for CPU tensors");
}

#else

namespace {

// A collective enqueued on the communication stream.
class NcclWork : public Work {
 public:
  NcclWork(ProcessGroup* group, std::shared_ptr<Event> done, Tensor keep)
      : group_(group), done_(std::move(done)), keep_(std::move(keep)) {}
  void wait() override {
    group_->check_healthy();
    done_->wait(current_stream(done_->device()));
  }
  void synchronize() override {
    // Polled, not cudaEventSynchronize: a failed group ends the wait (its abort ends the
    // kernels too, but the error is what the caller needs).
    while (!done_->query()) {
      group_->check_healthy();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    group_->check_healthy();
  }
  bool is_completed() override { return done_->query(); }

 private:
  ProcessGroup* group_;
  std::shared_ptr<Event> done_;
  Tensor keep_;  // the buffer stays alive while NCCL may still use it
};

class ProcessGroupNccl final : public ProcessGroup {
 public:
  ProcessGroupNccl(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options,
                   std::vector<int> global_ranks)
      : ProcessGroup(std::move(store), rank, size, options, std::move(global_ranks)), device_(current_device()) {
    TANDEM_CHECK(device_.is_cuda(), Device, "nccl process group on rank ", rank, ": the current device is ",
                 device_.str(), "; make this rank's GPU current first (or use the gloo backend for CPU tensors)");
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off
    comm_stream_ = Stream::create(device_, options.high_priority_stream);

    ncclUniqueId id;
    if (rank == 0) {
      TANDEM_NCCL_CHECK(ncclGetUniqueId(&id));
      const auto* p = reinterpret_cast<const uint8_t*>(&id);
      store_->set("nccl/id", Bytes(p, p + sizeof id));
    }
    Bytes b = store_->get("nccl/id");  // TimeoutError naming the key when rank 0 never comes
    TANDEM_CHECK(b.size() == sizeof id, Dist, "nccl process group on rank ", rank, ": the unique id in the store has ",
                 b.size(), " bytes, expected ", sizeof id);
    std::copy(b.begin(), b.end(), reinterpret_cast<uint8_t*>(&id));

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // (collectives ran as fast with a blocking communicator, measured)
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    comm_ = comm;
    if (r == ncclInProgress || r == ncclSuccess) r = settle(options.timeout);
    if (r != ncclSuccess) {
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      TANDEM_THROW(Nccl, "nccl process group on ", where(), " (group ", group_name(),
                   "): communicator setup failed: ", ncclGetErrorString(r),
                   r == ncclInProgress ? " (timed out: a rank did not join)" : "");
    }
    start_monitor();
  }

  // Note [leaving a group] first: a failed group, or one left with collectives in flight or
  // while an exception unwinds, publishes its abort and aborts the communicator there, before
  // anything here may wait (a finalize waits for the peers, up to 30 s).
  ~ProcessGroupNccl() override {
    leave();
    try {
      DeviceGuard guard(device_);
      if (comm_ && !aborted_) {
        ncclResult_t r = ncclCommFinalize(comm_);
        if (r == ncclInProgress) r = settle(std::chrono::seconds(30));
        if (r != ncclSuccess) TANDEM_LOG_ERROR("ncclCommFinalize failed: ", ncclGetErrorString(r));
        std::lock_guard<std::mutex> lock(comm_mu_);
        if (!aborted_) ncclCommDestroy(comm_);
      }
    } catch (const std::exception& e) {
      TANDEM_LOG_ERROR("nccl process group on ", where(), ": ", e.what());
    }
  }

  std::string backend() const override { return "nccl"; }
  Device device() const override { return device_; }
  bool supports_capture() const override { return true; }

 protected:
  void check_tensor(const char* op, const Tensor& t) const override {
    TANDEM_CHECK(t.device() == device_, Device, op, " on rank ", rank_, ": the nccl group of this rank runs on ",
                 device_.str(), ", got ", t.str());
  }

  // Note [one-rank averages]
  // NCCL before 2.29.7 runs an average over a one-rank communicator with its oneRankReduce
  // kernel, which splits the elements over its blocks with a floor division and leaves the last
  // (count mod blocks) elements unwritten: an out-of-place reduce-scatter then hands back whatever
  // the output held before (a ZeRO-2 rank with one bucket trained on last step's gradient tail).
  // Over one rank an average is the input itself, as a sum is, and NCCL runs a one-rank sum as a
  // plain copy; so a one-rank group asks for the sum, whatever NCCL's version.
  ncclRedOp_t nccl_op(ReduceOp op) const {
    if (op == ReduceOp::Avg) return size() == 1 ? ncclSum : ncclAvg;
    return op == ReduceOp::Max ? ncclMax : ncclSum;
  }

  WorkPtr do_allreduce(const Call& c) override {
    const ncclRedOp_t op = nccl_op(c.reduce);
    return launch(c, [&](cudaStream_t s) {
      return ncclAllReduce(c.t.raw_data(), c.t.raw_data(), static_cast<size_t>(c.t.numel()), nccl_type(c.t.dtype()),
                           op, comm_, s);
    });
  }
  WorkPtr do_broadcast(const Call& c) override {
    return launch(c, [&](cudaStream_t s) {
      return ncclBroadcast(c.t.raw_data(), c.t.raw_data(), static_cast<size_t>(c.t.numel()), nccl_type(c.t.dtype()),
                           c.peer, comm_, s);
    });
  }
  WorkPtr do_allgather(const Call& c) override {
    return launch(c, [&](cudaStream_t s) {
      return ncclAllGather(c.t.raw_data(), c.other.raw_data(), static_cast<size_t>(c.t.numel()),
                           nccl_type(c.t.dtype()), comm_, s);
    });
  }
  WorkPtr do_reduce_scatter(const Call& c) override {
    const ncclRedOp_t op = nccl_op(c.reduce);
    return launch(c, [&](cudaStream_t s) {
      return ncclReduceScatter(c.t.raw_data(), c.other.raw_data(), static_cast<size_t>(c.other.numel()),
                               nccl_type(c.t.dtype()), op, comm_, s);
    });
  }
  WorkPtr do_send(const Call& c) override {
    return launch(c, [&](cudaStream_t s) {
      return ncclSend(c.t.raw_data(), static_cast<size_t>(c.t.numel()), nccl_type(c.t.dtype()), c.peer, comm_, s);
    });
  }
  WorkPtr do_recv(const Call& c) override {
    return launch(c, [&](cudaStream_t s) {
      return ncclRecv(c.t.raw_data(), static_cast<size_t>(c.t.numel()), nccl_type(c.t.dtype()), c.peer, comm_, s);
    });
  }

  void abort_engine() override {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (comm_ && !aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);  // ends this communicator's kernels; its streams can drain
    }
  }

  bool has_work_in_flight() override {
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_) return false;
    DeviceGuard guard(device_);
    for (const InFlight& f : in_flight_) {
      if (!f.done->query()) return true;
    }
    return false;
  }

  std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, std::vector<int> global_ranks) override {
    DeviceGuard guard(device_);  // the subgroup's GPU is this group's
    return std::make_shared<ProcessGroupNccl>(std::move(store), rank, size, options, std::move(global_ranks));
  }

  // Note [collectives in a CUDA graph]: the graph was launched on the current stream; an event
  // after it ends when its last node (a collective on comm_stream_, joined back) has, and it
  // joins the list in launch order, so poll_in_flight checks its deadline like any
  // collective's and an abort reaches the kernels the replay is running.
  void watch_graph(const Call& c) override {
    DeviceGuard guard(device_);
    auto done = std::make_shared<Event>();
    std::lock_guard<std::mutex> lock(comm_mu_);
    if (aborted_) return;  // graph_launched checked the group; the failure is on its way
    done->record(current_stream(device_));
    in_flight_.push_back({c, std::move(done), std::chrono::steady_clock::now() + options_.timeout});
  }

  void poll_in_flight() override {
    std::string failed;
    bool timeout = false;
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      // A CUDA error here (the event query) is the device's, and is reported as one, naming the
      // collective it was checking.
      std::string cuda_error;
      try {
        while (!in_flight_.empty() && in_flight_.front().done->query()) in_flight_.pop_front();
      } catch (const std::exception& e) {
        cuda_error = e.what();
      }
      ncclResult_t async = ncclSuccess;
      if (comm_ && !aborted_) ncclCommGetAsyncError(comm_, &async);
      if (!cuda_error.empty()) {
        failed = "a CUDA error while checking whether it finished: " + cuda_error;
      } else if (async != ncclSuccess && async != ncclInProgress) {
        failed = std::string("NCCL reported ") + ncclGetErrorString(async);
      } else if (!in_flight_.empty() && std::chrono::steady_clock::now() > in_flight_.front().deadline) {
        failed = "timed out after " + std::to_string(options_.timeout.count() / 1000.0) + " s";
        timeout = true;
      }
      if (!failed.empty() && !in_flight_.empty()) failed_call_ = in_flight_.front().call;
    }
    if (!failed.empty()) fail(failure_message(failed_call_, failed), timeout);
  }

 private:
  // Waits, with a deadline, until a non-blocking communicator is no longer "in progress": its
  // state, ncclInProgress past the deadline, or ncclInvalidUsage once the communicator was
  // aborted. comm_mu_ is taken for each poll only (Note [settling without the lock]); the
  // caller must not hold it.
  ncclResult_t settle(Milliseconds timeout) {
    ncclResult_t state = ncclInProgress;
    const SettleResult r = settle_unlocked(
        comm_mu_, [&] { return aborted_ || comm_ == nullptr; },
        [&] {
          if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
          return state == ncclInProgress;
        },
        timeout);
    if (r == SettleResult::kAborted) return ncclInvalidUsage;
    if (r == SettleResult::kTimedOut) return ncclInProgress;
    return state;
  }

  template <typename Enqueue>
  WorkPtr launch(const Call& c, Enqueue enqueue) {
    DeviceGuard guard(device_);
    const bool capturing = is_current_stream_capturing(device_);
    // Ordered after what the caller queued (the gradients the bucket holds, say).
    Event ready;
    ready.record(current_stream(device_));
    ready.wait(comm_stream_);
    auto done = std::make_shared<Event>();
    Trace* trace = capturing ? nullptr : trace_.load();  // a captured span would time the capture
    Event start(true), end(true);
    if (trace) start.record(comm_stream_);
    ncclResult_t r = ncclSuccess;
    // One launch at a time (a non-blocking communicator takes its next call only once the last
    // has settled), but the communicator's own lock only while NCCL is called: the monitor must
    // be able to abort while a call settles (Note [settling without the lock]).
    std::lock_guard<std::mutex> one_at_a_time(launch_mu_);
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      r = aborted_ ? ncclInvalidUsage : enqueue(static_cast<cudaStream_t>(comm_stream_.handle()));
    }
    if (r == ncclInProgress) r = settle(options_.timeout);
    {
      std::lock_guard<std::mutex> lock(comm_mu_);
      if (r == ncclSuccess && aborted_) r = ncclInvalidUsage;
      if (r == ncclSuccess) {
        // Finished collectives leave the list here too, not only when the monitor runs; not
        // while this thread captures a graph: querying an event there is an unsupported call
        // that ends the capture (the monitor, another thread, still prunes the list).
        if (!capturing) {
          while (!in_flight_.empty() && in_flight_.front().done->query()) in_flight_.pop_front();
        }
        done->record(comm_stream_);
        if (trace) {
          end.record(comm_stream_);
          trace->add(device_, std::string(c.op) + " #" + std::to_string(c.seq), "comm", std::move(start), std::move(end));
        }
        // A collective captured into a CUDA graph runs at each replay, not now: its event is a
        // node of the graph, not one to watch (and the call's tensors must not outlive the
        // capture), so it stays off the list, as PyTorch keeps captured work from its watchdog.
        if (!capturing) in_flight_.push_back({c, done, std::chrono::steady_clock::now() + options_.timeout});
      }
    }
    if (r != ncclSuccess) {
      check_healthy();  // aborted: the group's error says why
      fail(failure_message(c, std::string("NCCL call failed: ") + ncclGetErrorString(r)), false);
      check_healthy();
    }
    return std::make_shared<NcclWork>(this, done, c.other.defined() ? c.other : c.t);
  }

  struct InFlight {
    Call call;
    std::shared_ptr<Event> done;
    std::chrono::steady_clock::time_point deadline;
  };

  Device device_;
  Stream comm_stream_;
  std::mutex launch_mu_;  // one launch at a time (held while a call settles)
  std::mutex comm_mu_;    // the communicator and in_flight_ (the monitor and the caller use them)
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  std::deque<InFlight> in_flight_;
  Call failed_call_{"?", 0, Tensor(), Tensor()};
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, std::vector<int> global_ranks) {
  return std::make_shared<ProcessGroupNccl>(std::move(store), rank, size, options, std::move(global_ranks));
}

#endif

}  // namespace tandem::parallel::distributed
