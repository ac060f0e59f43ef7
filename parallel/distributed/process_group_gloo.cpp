// The Gloo backend: CPU tensors between processes over Gloo's TCP transport.
//
// Gloo's collectives block the calling thread, so the group runs them on one background thread
// of its own, in issue order: allreduce() returns at once and the caller (DDP's backward) keeps
// computing while the bytes move — the overlap a bucketed allreduce exists for. One thread also
// keeps Gloo's requirement that concurrent collectives have distinct tags trivially true.
//
// Gloo's rendezvous (every pair of ranks exchanging addresses) goes through our store: the
// adapter below is all Gloo needs of it.
#include "parallel/distributed/process_group_backends.h"

#ifdef TANDEM_WITH_GLOO
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

// Note [aborting gloo]
// Gloo has no abort. What its own timeout does is the next best thing: it puts every pair in
// the error state (tcp::Pair::signalExceptionExternal), which wakes every wait on the pair with
// an exception and closes its socket, so the peers' waits end too. That function is public, but
// its header (gloo/transport/tcp/pair.h) cannot be included from Debian's libgloo-dev, which
// lacks the gloo/common/memory.h it includes. So it is declared here under its exported name,
// as a function taking the pair first (how the Itanium C++ ABI passes `this`), and weakly: a
// Gloo without it leaves the pointer null, and abort falls back to closing the pairs
// (gloo::Context::closeConnections), which wakes the peers' waits but not this rank's own.
extern std::exception_ptr tandem_gloo_tcp_pair_signal_exception(void* pair, const std::string& message) __asm__(
    "_ZN4gloo9transport3tcp4Pair23signalExceptionExternalERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE")
    __attribute__((weak));
#endif

#include "core/error.h"
#include "core/stream.h"
#include "parallel/trace.h"

namespace tandem::parallel::distributed {

#ifndef TANDEM_WITH_GLOO

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions,
                                              const std::string&, std::vector<int>) {
  TANDEM_THROW(Dist, "process group backend \"gloo\" is not in this build of tandem (Gloo was not found when "
                     "it was built; on Debian: apt-get install libgloo-dev, then rebuild)");
}

#else

namespace {

// Gloo's view of our store.
class GlooStore : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(distributed::Store& s) : s_(s) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_.set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = s_.get(key);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { s_.wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    s_.wait(keys, timeout);
  }

 private:
  distributed::Store& s_;
};

// A collective queued on (or run by) the group's thread.
class GlooWork : public Work {
 public:
  explicit GlooWork(ProcessGroup* group) : group_(group) {}

  void wait() override { synchronize(); }
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    // Wakes up now and then: a group that failed meanwhile (another rank died, seen by the
    // monitor) ends the wait without waiting for Gloo's own timeout.
    while (!done_) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (done_) break;
      lock.unlock();
      group_->check_healthy();
      lock.lock();
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  ProcessGroup* group_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A send or recv posted on an unbound buffer; wait() waits for it with the group's deadline.
class GlooP2PWork : public Work {
 public:
  using Fail = std::function<std::exception_ptr(const std::string& reason, bool timeout)>;
  GlooP2PWork(std::unique_ptr<gloo::transport::UnboundBuffer> buf, bool send, Milliseconds timeout, Fail fail)
      : buf_(std::move(buf)), send_(send), timeout_(timeout), fail_(std::move(fail)) {}
  void wait() override { synchronize(); }
  void synchronize() override {
    if (done_) {
      if (error_) std::rethrow_exception(error_);
      return;
    }
    done_ = true;
    try {
      const bool ok = send_ ? buf_->waitSend(timeout_) : buf_->waitRecv(timeout_);
      if (!ok) error_ = fail_("timed out", true);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      error_ = fail_(what, what.find("imed out") != std::string::npos);
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override { return done_; }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  bool send_;
  Milliseconds timeout_;
  Fail fail_;
  bool done_ = false;
  std::exception_ptr error_;
};

// The element-wise reduction Gloo calls, for our dtype: the sum (Avg divides it afterwards) or
// the maximum.
gloo::AllreduceOptions::Func max_function(DType t) {
  switch (t) {
    case DType::Float32: return [](void* c, const void* a, const void* b, size_t n) { gloo::max<float>(c, a, b, n); };
    case DType::Float64: return [](void* c, const void* a, const void* b, size_t n) { gloo::max<double>(c, a, b, n); };
    case DType::Int64: return [](void* c, const void* a, const void* b, size_t n) { gloo::max<int64_t>(c, a, b, n); };
    case DType::UInt8: return [](void* c, const void* a, const void* b, size_t n) { gloo::max<uint8_t>(c, a, b, n); };
    case DType::BFloat16:
      return [](void* c, const void* a, const void* b, size_t n) {
        auto* pc = static_cast<BFloat16*>(c);
        const auto* pa = static_cast<const BFloat16*>(a);
        const auto* pb = static_cast<const BFloat16*>(b);
        for (size_t i = 0; i < n; ++i) pc[i] = static_cast<float>(pa[i]) < static_cast<float>(pb[i]) ? pb[i] : pa[i];
      };
  }
  TANDEM_THROW(DType, "gloo: unsupported dtype ", dtype_name(t));
}

gloo::AllreduceOptions::Func sum_function(DType t) {
  switch (t) {
    case DType::Float32: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<float>(c, a, b, n); };
    case DType::Float64: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<double>(c, a, b, n); };
    case DType::Int64: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<int64_t>(c, a, b, n); };
    case DType::UInt8: return [](void* c, const void* a, const void* b, size_t n) { gloo::sum<uint8_t>(c, a, b, n); };
    // Gloo has no bfloat16 sum: each pairwise sum in float, rounded (core/bfloat16.h).
    case DType::BFloat16:
      return [](void* c, const void* a, const void* b, size_t n) {
        auto* pc = static_cast<BFloat16*>(c);
        const auto* pa = static_cast<const BFloat16*>(a);
        const auto* pb = static_cast<const BFloat16*>(b);
        for (size_t i = 0; i < n; ++i) pc[i] = pa[i] + pb[i];
      };
  }
  TANDEM_THROW(DType, "gloo: unsupported dtype ", dtype_name(t));
}

// Avg = Sum / size, for the floating dtypes.
void divide(const Tensor& t, int size) {
  if (t.dtype() == DType::Float32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] /= static_cast<float>(size);
  } else if (t.dtype() == DType::BFloat16) {
    BFloat16* p = t.data<BFloat16>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      p[i] = BFloat16(static_cast<float>(p[i]) / static_cast<float>(size));
    }
  } else {
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] /= static_cast<double>(size);
  }
}

// The address Gloo's pairs listen on: GLOO_SOCKET_IFNAME's interface (as in PyTorch), the
// loopback address for a job on loopback, else this host's name.
gloo::transport::tcp::attr transport_attr(const std::string& master_addr) {
  gloo::transport::tcp::attr attr;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    attr.iface = ifname;
  } else if (master_addr.empty() || master_addr == "localhost" || master_addr.rfind("127.", 0) == 0) {
    attr.hostname = "127.0.0.1";
  } else {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    attr.hostname = host;
  }
  return attr;
}

// Note [SIGPIPE and Gloo]: Gloo's TCP pairs write with writev, which has no MSG_NOSIGNAL, so
// writing to a peer that has just died raises SIGPIPE, whose default action ends this process
// silently (exit status 141) instead of letting the group report "rank 1 is gone". A Python
// program never sees this because Python ignores SIGPIPE at startup; a C++ program must do it
// itself. A Gloo group therefore ignores SIGPIPE when it still has its default action (a handler
// the program installed is left alone): the write then fails with EPIPE, which Gloo turns into
// the error the group reports.
void ignore_default_sigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

class ProcessGroupGloo final : public ProcessGroup {
 public:
  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options,
                   const std::string& master_addr, std::vector<int> global_ranks)
      : ProcessGroup(std::move(store), rank, size, options, std::move(global_ranks)), master_addr_(master_addr) {
    ignore_default_sigpipe();
    try {
      device_ = gloo::transport::tcp::CreateDevice(transport_attr(master_addr));
      context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context_->setTimeout(options.timeout);
      PrefixStore prefixed("gloo", store_);
      GlooStore adapter(prefixed);
      context_->connectFullMesh(adapter, device_);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      TANDEM_THROW(Dist, "gloo rendezvous on ", where(), " (group ", group_name(), ") failed: ", e.what());
    }
    thread_ = std::thread([this] {
      // Before anything else, as every thread tandem starts: this one never touches a GPU.
      set_current_device(kCPU);
      loop();
    });
    start_monitor();
  }

  // Note [leaving a group] first: a failed group (or one left with collectives in flight) is
  // aborted there, which ends a collective stuck in Gloo at once (abort_engine); then the thread
  // finishes what is queued (each item fails at once once the group has failed) and is joined.
  // It never outlives the group.
  ~ProcessGroupGloo() override {
    leave();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::string backend() const override { return "gloo"; }
  Device device() const override { return kCPU; }

 protected:
  void check_tensor(const char* op, const Tensor& t) const override {
    TANDEM_CHECK(t.device().is_cpu(), Device, op, " on rank ", rank_, ": the gloo backend takes CPU tensors, got ",
                 t.str(), " (use the nccl backend for GPU tensors)");
  }

  WorkPtr do_allreduce(const Call& c) override {
    TANDEM_CHECK(c.reduce != ReduceOp::Avg || is_floating(c.t.dtype()), DType, c.str(),
                 ": avg needs a floating dtype");
    return enqueue(c, [this, c](gloo::Context&) {
      gloo::AllreduceOptions o(context_);
      set_typed_output(o, c.t);
      o.setReduceFunction(c.reduce == ReduceOp::Max ? max_function(c.t.dtype()) : sum_function(c.t.dtype()));
      o.setTag(tag(c));
      o.setTimeout(options_.timeout);
      gloo::allreduce(o);
      if (c.reduce == ReduceOp::Avg) divide(c.t, size_);
    });
  }

  WorkPtr do_broadcast(const Call& c) override {
    return enqueue(c, [this, c](gloo::Context&) {
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<uint8_t*>(c.t.raw_data()), c.t.nbytes());
      o.setRoot(c.peer);
      o.setTag(tag(c));
      o.setTimeout(options_.timeout);
      gloo::broadcast(o);
    });
  }

  WorkPtr do_allgather(const Call& c) override {
    return enqueue(c, [this, c](gloo::Context&) {
      gloo::AllgatherOptions o(context_);
      o.setInput(static_cast<uint8_t*>(c.t.raw_data()), c.t.nbytes());
      o.setOutput(static_cast<uint8_t*>(c.other.raw_data()), c.other.nbytes());
      o.setTag(tag(c));
      o.setTimeout(options_.timeout);
      gloo::allgather(o);
    });
  }

  // Gloo has no reduce-scatter in its options API: allreduce a copy and keep this rank's chunk
  // (twice the bytes of a real reduce-scatter; DDP does not use it).
  WorkPtr do_reduce_scatter(const Call& c) override {
    TANDEM_CHECK(c.reduce != ReduceOp::Avg || is_floating(c.t.dtype()), DType, c.str(),
                 ": avg needs a floating dtype");
    return enqueue(c, [this, c](gloo::Context&) {
      Tensor whole = c.t.clone();
      gloo::AllreduceOptions o(context_);
      set_typed_output(o, whole);
      o.setReduceFunction(c.reduce == ReduceOp::Max ? max_function(whole.dtype()) : sum_function(whole.dtype()));
      o.setTag(tag(c));
      o.setTimeout(options_.timeout);
      gloo::allreduce(o);
      if (c.reduce == ReduceOp::Avg) divide(whole, size_);
      const int64_t n = c.other.numel();
      c.other.copy_(whole.slice(0, rank_ * n, (rank_ + 1) * n).view(c.other.shape()));
    });
  }

  // Point to point runs on the caller's thread, as in PyTorch: Gloo's unbound buffers are
  // asynchronous, and a send queued behind a blocking collective thread would deadlock with the
  // peer's matching recv queued behind its own send.
  WorkPtr do_send(const Call& c) override { return p2p(c, true); }
  WorkPtr do_recv(const Call& c) override { return p2p(c, false); }

  // Note [aborting gloo]: a collective blocked in Gloo ends at once (the caller sees the group's
  // error, not Gloo's), instead of at Gloo's own timeout.
  void abort_engine() override {
    if (!context_) return;
    try {
      if (tandem_gloo_tcp_pair_signal_exception == nullptr) {
        context_->closeConnections();
        return;
      }
      const std::string message = "process group " + group_name() + " aborted";
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        // The pairs are TCP ones (the device is); void* is the most-derived object.
        void* pair = dynamic_cast<void*>(context_->getPair(r).get());
        if (pair != nullptr) tandem_gloo_tcp_pair_signal_exception(pair, message);
      }
    } catch (const std::exception& e) {
      TANDEM_LOG_ERROR("gloo abort on ", where(), ": ", e.what());
    }
  }

  bool has_work_in_flight() override {
    std::lock_guard<std::mutex> lock(mu_);
    return running_ || !queue_.empty();
  }

  std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, std::vector<int> global_ranks) override {
    return std::make_shared<ProcessGroupGloo>(std::move(store), rank, size, options, master_addr_,
                                              std::move(global_ranks));
  }

 private:
  using Job = std::function<void(gloo::Context&)>;

  // The reduction must see whole elements, so the output is set with the real element type.
  static void set_typed_output(gloo::AllreduceOptions& o, const Tensor& t) {
    const auto n = static_cast<size_t>(t.numel());
    switch (t.dtype()) {
      case DType::Float32: o.setOutput(static_cast<float*>(t.raw_data()), n); return;
      case DType::Float64: o.setOutput(static_cast<double*>(t.raw_data()), n); return;
      case DType::Int64: o.setOutput(static_cast<int64_t*>(t.raw_data()), n); return;
      case DType::UInt8: o.setOutput(static_cast<uint8_t*>(t.raw_data()), n); return;
      case DType::BFloat16: o.setOutput(static_cast<BFloat16*>(t.raw_data()), n); return;
    }
  }

  WorkPtr p2p(const Call& c, bool send) {
    auto fail_call = [this, c](const std::string& reason, bool timeout) {
      fail(failure_message(c, reason), timeout);
      try {
        check_healthy();
      } catch (...) {
        return std::current_exception();
      }
      return std::exception_ptr();
    };
    std::unique_ptr<gloo::transport::UnboundBuffer> buf;
    try {
      buf = context_->createUnboundBuffer(c.t.raw_data(), c.t.nbytes());
      // Slots pair a send with its recv: the k-th point-to-point call of every rank.
      if (send) buf->send(c.peer, c.seq);
      else buf->recv(c.peer, c.seq);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      // Posting fails at once on a pair that has already seen its peer go: the same message,
      // naming the call and the missing rank, as when the wait fails.
      const std::string what = e.what();
      if (auto error = fail_call(what, what.find("imed out") != std::string::npos)) std::rethrow_exception(error);
      throw;
    }
    return std::make_shared<GlooP2PWork>(std::move(buf), send, options_.timeout, fail_call);
  }

  // Collectives use sequence numbers as tags (distinct for every collective in flight).
  static uint32_t tag(const Call& c) { return static_cast<uint32_t>(c.seq); }

  WorkPtr enqueue(const Call& c, Job job) {
    auto work = std::make_shared<GlooWork>(this);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({c, std::move(job), work});
    }
    cv_.notify_all();
    return work;
  }

  void loop() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      std::exception_ptr error;
      Trace* trace = trace_.load();
      Event start(true), end(true);
      if (trace) start.record(Stream::default_stream(kCPU));
      try {
        check_healthy();
        item.job(*context_);
        if (trace) {
          end.record(Stream::default_stream(kCPU));
          trace->add(kCPU, std::string(item.call.op) + " #" + std::to_string(item.call.seq), "comm", std::move(start),
                     std::move(end));
        }
      } catch (const Error& e) {
        // Ours: the group had failed already (check_healthy), or this collective cannot run
        // here; either way the group is over, and the peers must not wait for this rank.
        bool healthy = true;
        try {
          check_healthy();
        } catch (...) {
          healthy = false;
        }
        if (healthy) fail(failure_message(item.call, e.what()), false);
        try {
          check_healthy();
        } catch (...) {
          error = std::current_exception();
        }
      } catch (const std::exception& e) {
        // Gloo's exceptions say what the transport saw ("Connection closed by peer", "Timed
        // out"); ours adds which collective and which ranks.
        const std::string what = e.what();
        const bool timeout = what.find("imed out") != std::string::npos;
        fail(failure_message(item.call, what), timeout);
        try {
          check_healthy();
        } catch (...) {
          error = std::current_exception();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_ = false;
      }
      item.work->finish(error);
    }
  }

  struct Item {
    Call call;
    Job job;
    std::shared_ptr<GlooWork> work;
  };

  std::string master_addr_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  bool running_ = false;  // the thread is running a collective (has_work_in_flight)
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, const std::string& master_addr,
                                              std::vector<int> global_ranks) {
  return std::make_shared<ProcessGroupGloo>(std::move(store), rank, size, options, master_addr,
                                            std::move(global_ranks));
}

#endif

}  // namespace tandem::parallel::distributed
