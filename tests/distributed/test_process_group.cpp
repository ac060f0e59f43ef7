// The process group's own mechanisms, with ranks as threads of this process (each with its own
// store client, as a process would have): group names and store prefixes, subgroups, leaving a
// group, aborting Gloo, the monitor thread's device, how in-flight errors are reported, and the
// lock-free settle of a non-blocking communicator. The same over real processes is in
// test_subgroups.cpp and test_ddp.cpp.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "core/cuda_graph.h"
#include "helpers.h"
#include "parallel/distributed/collective_graph.h"
#include "parallel/distributed/process_group.h"
#include "parallel/distributed/process_group_backends.h"

using namespace tandem;
using namespace tandem::parallel::distributed;
using Clock = std::chrono::steady_clock;

namespace {

// Catch2's assertions are not thread-safe: the rank threads assert through RANK_CHECK, one at a
// time, and never while waiting for a collective (so no rank holds up another's progress).
std::mutex g_catch_mu;
#define RANK_CHECK(...)                                      \
  do {                                                       \
    const bool rank_check_ok_ = static_cast<bool>(__VA_ARGS__); \
    std::lock_guard<std::mutex> rank_check_lock_(g_catch_mu); \
    CHECK(rank_check_ok_);                                   \
    if (!rank_check_ok_) WARN(#__VA_ARGS__);                 \
  } while (0)

// The message of the E that f throws; "no exception" or "another exception: ..." otherwise.
template <typename E, typename F>
std::string caught(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("another exception: ") + e.what();
  }
  return "no exception";
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// n ranks as threads: fn(rank, store) on each, every rank with its own client of one TCP store
// (rank 0's hosts it). Returns each rank's error message ("" when it returned normally).
std::vector<std::string> run_ranks(int n, const std::function<void(int, std::shared_ptr<TCPStore>)>& fn) {
  TCPStoreOptions o;
  o.is_master = true;
  o.rank = 0;
  o.timeout = std::chrono::seconds(10);
  o.job_id = "pg-test";
  auto master = std::make_shared<TCPStore>("127.0.0.1", 0, o);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::shared_ptr<TCPStore> store = master;
        if (r > 0) {
          TCPStoreOptions c = o;
          c.is_master = false;
          c.rank = r;
          store = std::make_shared<TCPStore>("127.0.0.1", master->port(), c);
        }
        fn(r, store);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = std::string("error: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

ProcessGroupOptions quick(int timeout_s = 10) {
  ProcessGroupOptions o;
  o.timeout = std::chrono::seconds(timeout_s);
  o.monitor_interval = std::chrono::milliseconds(50);
  return o;
}

// Waits (a few seconds at most) until the group has failed; returns its error, "" if it did not.
std::string wait_for_failure(const ProcessGroup& pg, double seconds = 5) {
  const auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    try {
      pg.check_healthy();
    } catch (const std::exception& e) {
      return e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return "";
}

// A one-rank group with no engine, to test what the base class does on its own.
class BareGroup : public ProcessGroup {
 public:
  BareGroup(std::shared_ptr<Store> store, Device device, std::function<void()> poll = {})
      : ProcessGroup(std::move(store), 0, 1, quick()), device_(device), poll_(std::move(poll)) {
    start_monitor();
  }
  ~BareGroup() override { leave(); }
  std::string backend() const override { return "bare"; }
  Device device() const override { return device_; }

 protected:
  WorkPtr do_allreduce(const Call&) override { return nullptr; }
  WorkPtr do_broadcast(const Call&) override { return nullptr; }
  WorkPtr do_allgather(const Call&) override { return nullptr; }
  WorkPtr do_reduce_scatter(const Call&) override { return nullptr; }
  WorkPtr do_send(const Call&) override { return nullptr; }
  WorkPtr do_recv(const Call&) override { return nullptr; }
  void check_tensor(const char*, const Tensor&) const override {}
  std::shared_ptr<ProcessGroup> make_subgroup(std::shared_ptr<Store>, int, int, ProcessGroupOptions,
                                              std::vector<int>) override {
    return nullptr;
  }
  void poll_in_flight() override {
    if (poll_) poll_();
  }

 private:
  Device device_;
  std::function<void()> poll_;
};

std::shared_ptr<TCPStore> lone_store() {
  TCPStoreOptions o;
  o.is_master = true;
  o.rank = 0;
  o.timeout = std::chrono::seconds(10);
  o.job_id = "pg-test";
  return std::make_shared<TCPStore>("127.0.0.1", 0, o);
}

}  // namespace

#ifdef TANDEM_WITH_GLOO

TEST_CASE("Process groups on one store have their own keys: a failure in one leaves the other alone",
          "[dist][gloo]") {
  auto errors = run_ranks(2, [](int r, std::shared_ptr<TCPStore> store) {
    auto a = new_process_group("gloo", store, r, 2, quick());
    auto b = new_process_group("gloo", store, r, 2, quick());
    RANK_CHECK(a->group_name() != b->group_name());
    // Different sizes on the two ranks of b: b's fingerprints catch it, a's must not see it.
    Tensor x = ones({r == 0 ? 10 : 20});
    RANK_CHECK(test::contains(caught<DistError>([&] { b->allreduce(x)->wait(); }), "differs between ranks"));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // several monitor intervals
    Tensor y = full({7}, r + 1);
    a->allreduce(y)->wait();
    for (float v : y.to_vector<float>()) RANK_CHECK(v == 3.0f);
    a->check_healthy();
  });
  for (const auto& e : errors) CHECK(e == "");
}

TEST_CASE("new_group: members get a subgroup of sorted ranks with its own collectives, others nullptr",
          "[dist][gloo]") {
  auto errors = run_ranks(3, [](int r, std::shared_ptr<TCPStore> store) {
    ProcessGroupOptions o = quick();
    o.group_name = "world";
    auto world = new_process_group("gloo", store, r, 3, o);
    // Any order; the subgroup's ranks are sorted.
    auto sub = new_group(world, {2, 0});
    if (r == 1) {
      RANK_CHECK(sub == nullptr);
    } else {
      RANK_CHECK(sub != nullptr);
      if (!sub) return;
      RANK_CHECK(sub->size() == 2);
      RANK_CHECK(sub->rank() == (r == 0 ? 0 : 1));
      RANK_CHECK(sub->global_ranks() == std::vector<int>{0, 2});
      RANK_CHECK(sub->global_rank(1) == 2);
      RANK_CHECK(sub->group_rank(2) == 1);
      RANK_CHECK(sub->group_name() == "world/sub0");
      RANK_CHECK(test::contains(caught<ValueError>([&] { sub->group_rank(1); }), "global rank 1"));
      Tensor t = full({5}, r + 1);
      sub->allreduce(t)->wait();
      for (float v : t.to_vector<float>()) RANK_CHECK(v == 4.0f);  // global ranks 0 and 2: 1 + 3
      Tensor m = full({3}, 10 * r);
      sub->allreduce(m, ReduceOp::Max)->wait();
      for (float v : m.to_vector<float>()) RANK_CHECK(v == 20.0f);
      // A subgroup of a subgroup: ranks of the subgroup, named under it.
      auto inner = sub->new_group({1});
      if (r == 2) {
        RANK_CHECK(inner != nullptr);
        if (!inner) return;
        RANK_CHECK(inner->global_ranks() == std::vector<int>{2});
        RANK_CHECK(inner->group_name() == "world/sub0/sub0");
      } else {
        RANK_CHECK(inner == nullptr);
      }
    }
    // Bad lists: a clear error naming the rank, on every rank.
    RANK_CHECK(test::contains(caught<ValueError>([&] { world->new_group({0, 3}); }), "rank 3 is not in [0, 3)"));
    RANK_CHECK(test::contains(caught<ValueError>([&] { world->new_group({1, 0, 1}); }),
                         "rank 1 appears more than once"));
    RANK_CHECK(test::contains(caught<ValueError>([&] { world->new_group({}); }), "empty"));
    // The failed calls were counted alike on every rank: the next subgroup is sub4 everywhere.
    auto all = world->new_group({0, 1, 2});
    RANK_CHECK(all != nullptr);
    if (!all) return;
    RANK_CHECK(all->group_name() == "world/sub4");
    Tensor t = full({2}, r + 1);
    all->allreduce(t)->wait();
    world->allreduce(t)->wait();
    for (float v : t.to_vector<float>()) RANK_CHECK(v == 18.0f);
  });
  for (const auto& e : errors) CHECK(e == "");
}

TEST_CASE("A Gloo collective stuck on a dead peer is ended by the abort, and the group joins its thread",
          "[dist][gloo]") {
  std::atomic<bool> done{false};
  // Rank 0's view of the store reports rank 1 gone once `marked` is set: what the server answers
  // after rank 1's session ended without a goodbye (store.h), without ending rank 1's thread.
  struct MarkingStore : PrefixStore {
    std::atomic<bool>* marked;
    MarkingStore(std::shared_ptr<Store> s, std::atomic<bool>* m) : PrefixStore("t", std::move(s)), marked(m) {}
    std::vector<int> disconnected_ranks() override {
      return *marked ? std::vector<int>{1} : PrefixStore::disconnected_ranks();
    }
  };
  std::atomic<bool> marked{false};
  auto errors = run_ranks(2, [&](int r, std::shared_ptr<TCPStore> tcp) {
    std::shared_ptr<Store> store = std::make_shared<PrefixStore>("t", tcp);  // both ranks: keys under t/
    if (r == 0) store = std::make_shared<MarkingStore>(tcp, &marked);
    auto pg = new_process_group("gloo", store, r, 2, quick(/*timeout_s=*/30));
    if (r == 1) {  // alive, but never joins the collective; "dies" below
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    Tensor t = ones({1000});
    WorkPtr w = pg->allreduce(t);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    marked = true;  // rank 1 "dies"
    const auto t0 = Clock::now();
    RANK_CHECK(test::contains(caught<DistError>([&] { w->wait(); }), "rank 1 died"));
    // The collective itself ended (Gloo was aborted), not only the wait for it: long before
    // Gloo's own timeout of 30 s.
    while (!w->is_completed() && seconds_since(t0) < 10) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    RANK_CHECK(w->is_completed());
    RANK_CHECK(seconds_since(t0) < 3);
    const auto t1 = Clock::now();
    pg.reset();  // joins the collective thread (ASan: nothing runs on the group after this)
    RANK_CHECK(seconds_since(t1) < 2);
    done = true;
  });
  for (const auto& e : errors) CHECK(e == "");
}

TEST_CASE("A rank that catches a collective's error and destroys its group does not say a clean goodbye",
          "[dist][gloo]") {
  auto errors = run_ranks(2, [](int r, std::shared_ptr<TCPStore> store) {
    auto pg = new_process_group("gloo", store, r, 2, quick(/*timeout_s=*/30));
    if (r == 1) {
      // A bad call (the output has the wrong size), caught; then the program "returns 1".
      Tensor in = ones({4}), out = zeros({5});
      RANK_CHECK(test::contains(caught<ShapeError>([&] { pg->allgather(out, in); }), "output must have"));
      pg.reset();
      return;
    }
    Tensor t = ones({4});
    const auto t0 = Clock::now();
    const std::string msg = caught<DistError>([&] { pg->allreduce(t)->wait(); });
    RANK_CHECK(test::contains(msg, "rank 1 of 2 left the group after a failed collective"));
    RANK_CHECK(test::contains(msg, "allgather"));
    RANK_CHECK(seconds_since(t0) < 5);
  });
  for (const auto& e : errors) CHECK(e == "");
}

TEST_CASE("A group destroyed with a collective in flight aborts instead of saying goodbye", "[dist][gloo]") {
  std::atomic<bool> left{false};
  // No fingerprints: the first collectives would otherwise wait in the call for the other rank's
  // fingerprint (Note [collective fingerprints]), and rank 1's would not be in flight alone.
  ProcessGroupOptions o = quick(/*timeout_s=*/30);
  o.fingerprint_collectives = 0;
  auto errors = run_ranks(2, [&](int r, std::shared_ptr<TCPStore> store) {
    auto pg = new_process_group("gloo", store, r, 2, o);
    if (r == 1) {
      Tensor t = ones({4});
      WorkPtr w = pg->allreduce(t);  // rank 0 never joins: in flight
      const auto t0 = Clock::now();
      pg.reset();
      RANK_CHECK(seconds_since(t0) < 2);  // aborted and joined, not Gloo's 30 s
      RANK_CHECK(w->is_completed());
      left = true;
      return;
    }
    // Rank 0 learns of it through the abort key rank 1 published as it left, promptly (its
    // monitor reads the key every interval), without a collective of its own.
    const auto t0 = Clock::now();
    while (!left && seconds_since(t0) < 20) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const std::string msg = wait_for_failure(*pg);
    RANK_CHECK(test::contains(msg, "rank 1 of 2 left the group with collectives in flight"));
    RANK_CHECK(seconds_since(t0) < 10);
  });
  for (const auto& e : errors) CHECK(e == "");
}

TEST_CASE("The monitor of a Gloo group runs under the CPU", "[dist][gloo]") {
  auto store = lone_store();
  auto pg = new_process_group("gloo", store, 0, 1, quick());
  RANK_CHECK(pg->monitor_device() == kCPU);
}

extern "C" void test_sigpipe_handler(int) {}

TEST_CASE("A Gloo group ignores SIGPIPE unless the program handles it (Note [SIGPIPE and Gloo])",
          "[dist][gloo]") {
  struct sigaction saved {};
  REQUIRE(sigaction(SIGPIPE, nullptr, &saved) == 0);
  auto disposition = [] {
    struct sigaction now {};
    sigaction(SIGPIPE, nullptr, &now);
    return now.sa_handler;
  };
  SECTION("the default action becomes ignore: a dead peer is an error, not exit status 141") {
    ::signal(SIGPIPE, SIG_DFL);
    auto pg = new_process_group("gloo", lone_store(), 0, 1, quick());
    CHECK(disposition() == SIG_IGN);
  }
  SECTION("a handler the program installed stays") {
    ::signal(SIGPIPE, test_sigpipe_handler);
    auto pg = new_process_group("gloo", lone_store(), 0, 1, quick());
    CHECK(disposition() == test_sigpipe_handler);
  }
  sigaction(SIGPIPE, &saved, nullptr);
}

#endif  // TANDEM_WITH_GLOO

TEST_CASE("The monitor thread sets its group's device before anything else", "[dist]") {
  // A virtual CPU device stands for "this rank's GPU": a thread starts on the CPU (like a CUDA
  // thread on GPU 0), so only a monitor that sets the group's device runs under cpu:1.
  auto store = lone_store();
  BareGroup pg(store, Device::cpu(1));
  CHECK(pg.monitor_device() == Device::cpu(1));
}

TEST_CASE("A CUDA error while checking collectives in flight is reported as one, not as a lost store", "[dist]") {
  auto store = lone_store();
  BareGroup pg(store, kCPU, [] { throw CudaError("cudaEventQuery: an illegal memory access was encountered"); });
  const std::string msg = wait_for_failure(pg);
  CHECK(test::contains(msg, "checking the collectives in flight failed"));
  CHECK(test::contains(msg, "illegal memory access"));
  CHECK_FALSE(test::contains(msg, "lost the store"));
}

TEST_CASE("settle_unlocked polls under the lock only, so an abort is never held up", "[dist]") {
  std::mutex mu;
  bool aborted = false;
  int polls = 0;
  SettleResult result = SettleResult::kDone;
  const auto t0 = Clock::now();
  std::thread settling([&] {
    result = settle_unlocked(
        mu, [&] { return aborted; },
        [&] {
          ++polls;
          return true;  // forever "in progress", like a communicator whose peer died
        },
        std::chrono::seconds(20));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t1 = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);  // what abort_engine takes
    aborted = true;
  }
  CHECK(seconds_since(t1) < 0.5);
  settling.join();
  CHECK(result == SettleResult::kAborted);
  CHECK(seconds_since(t0) < 1);
  CHECK(polls > 1);

  int left = 3;
  CHECK(settle_unlocked(mu, [] { return false; }, [&] { return --left > 0; }, std::chrono::seconds(5)) ==
        SettleResult::kDone);
  CHECK(settle_unlocked(mu, [] { return false; }, [] { return true; }, std::chrono::milliseconds(20)) ==
        SettleResult::kTimedOut);
}

// ---- Note [collectives in a CUDA graph] ------------------------------------------------------
namespace {

// A bare group whose collectives count as capturable; it records what it is asked to watch.
class CapturingGroup final : public BareGroup {
 public:
  explicit CapturingGroup(std::shared_ptr<Store> store) : BareGroup(std::move(store), kCPU) {}
  bool supports_capture() const override { return true; }
  void fail_now(const std::string& why) { fail(why, false); }
  std::vector<std::string> watched;

 protected:
  void watch_graph(const Call& c) override { watched.push_back(c.str()); }
};

// A capture that records nothing: its "replay" only counts (the collectives of a step are host
// calls here, so what the test checks is the group's bookkeeping around the launches).
struct CountingGraph final : CUDAGraph {
  bool have = false;
  int* launches = nullptr;
  bool can_capture(Device) const override { return true; }
  void capture_begin(Device) override { have = false; }
  void capture_end() override { have = true; }
  void capture_abort() noexcept override {}
  void replay() const override { ++*launches; }
  void reset() noexcept override { have = false; }
  bool captured() const override { return have; }
};

}  // namespace

TEST_CASE("A CUDA graph's collectives keep their group's numbers and are watched at every launch",
          "[dist][cuda_graph]") {
  auto store = lone_store();
  auto pg = std::make_shared<CapturingGroup>(store);
  int launches = 0;
  auto fake = std::make_unique<CountingGraph>();
  fake->launches = &launches;
  auto* graph = new CollectiveGraph({pg}, std::move(fake));
  const Tensor t = zeros({4});
  int steps = 0;
  StepGraph step([&](const std::vector<Tensor>&) {
    ++steps;
    pg->allreduce(t);
    pg->allreduce(t, ReduceOp::Avg);
  }, {/*warmup_steps=*/2, /*enabled=*/true}, std::unique_ptr<CUDAGraph>(graph));

  step({t});
  step({t});  // two eager steps: #0..#3
  CHECK(pg->sequence_number() == 4);
  CHECK(pg->watched.empty());
  step({t});  // the capture issues #4 and #5; its launch is this step and numbers nothing
  CHECK(steps == 3);
  CHECK(launches == 1);
  CHECK(graph->collectives() == std::vector<uint64_t>{2});
  CHECK(pg->sequence_number() == 6);
  REQUIRE(pg->watched.size() == 1);
  CHECK(pg->watched[0] == "the 2 collectives #4..#5 replayed from a CUDA graph");
  step({t});  // a replay: the next two numbers, as if issued
  step({t});
  CHECK(steps == 3);
  CHECK(launches == 3);
  CHECK(pg->sequence_number() == 10);
  REQUIRE(pg->watched.size() == 3);
  CHECK(pg->watched[2] == "the 2 collectives #8..#9 replayed from a CUDA graph");
  pg->allreduce(t);  // an eager collective after the replays takes the next number
  CHECK(pg->sequence_number() == 11);

  SECTION("a failed group replays nothing and throws its error") {
    pg->fail_now("rank 1 is gone");
    CHECK(test::contains(caught<Error>([&] { step({t}); }), "rank 1 is gone"));
    CHECK(launches == 3);
    CHECK(pg->sequence_number() == 11);
  }
}

TEST_CASE("A CollectiveGraph says why a group's step cannot be captured", "[dist][cuda_graph]") {
  auto store = lone_store();
  auto bare = std::make_shared<BareGroup>(store, kCPU);  // a backend without capture
  int launches = 0;
  auto fake = std::make_unique<CountingGraph>();
  fake->launches = &launches;
  CollectiveGraph graph({bare}, std::move(fake));
  CHECK_FALSE(graph.can_capture(kCPU));
  CHECK(test::contains(graph.why_not(kCPU), "the bare process group runs its collectives on a host thread"));
  auto capturing = std::make_shared<CapturingGroup>(store);
  auto fake2 = std::make_unique<CountingGraph>();
  fake2->launches = &launches;
  CollectiveGraph other({capturing}, std::move(fake2));
  CHECK(other.can_capture(kCPU));
  CHECK(test::contains(other.why_not(Device::cpu(1)), "the process group works on "));
  CHECK(test::contains(other.why_not(Device::cpu(1)), ", the step on cpu:1"));
  const std::vector<std::shared_ptr<ProcessGroup>> none{nullptr};
  CHECK(test::contains(caught<ValueError>([&] { CollectiveGraph g(none); }), "a process group is null"));
}
