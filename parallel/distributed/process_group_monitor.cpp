// A process group's failure handling (Note [collective failures]): the monitor thread that
// publishes this rank's progress and watches the store for the others' failures and deaths, the
// group's first error, leaving a group (Note [leaving a group]), and the one failure message a
// rank prints when the job cannot go on.
#include <algorithm>
#include <chrono>
#include <exception>
#include <sstream>

#include "core/error.h"
#include "core/stream.h"
#include "parallel/distributed/process_group.h"
#include "parallel/distributed/process_group_monitor.h"

namespace tandem::parallel::distributed {

// Note [leaving a group]
// A rank's group can end in two ways, and the other ranks must be able to tell them apart at
// once: a clean goodbye (every collective done, nothing failed: the job is over) or an abort
// (this rank gives up: whatever the others wait for will never come). An exception unwinding
// through the group's owner is an abort; so is a group destroyed after one of its collective
// calls threw (the program caught the error and returns 1) or while a collective is in flight,
// since the peers are, or soon will be, waiting in that collective for this rank. The abort is
// published before the engine is torn down: NCCL's finalize or the join of Gloo's thread may
// take a while, and the peers must not wait for that.
void ProcessGroup::leave() {
  if (left_) return;
  left_ = true;
  stop_monitor();
  std::string why;
  {
    std::lock_guard<std::mutex> g(monitor_->error_mu);
    if (monitor_->error.empty()) {
      if (std::uncaught_exceptions() > 0) why = "exited with an error";
      else if (!monitor_->call_error.empty()) why = "left the group after a failed collective: " + monitor_->call_error;
    }
  }
  bool in_flight = false;
  if (why.empty()) {
    try {
      in_flight = has_work_in_flight();
    } catch (const std::exception& e) {
      why = std::string("left the group: its collectives could not be checked: ") + e.what();
    }
  }
  if (in_flight) why = "left the group with collectives in flight";
  if (!why.empty()) fail(where() + " " + why, false);
  std::lock_guard<std::mutex> g(monitor_->error_mu);
  clean_ = monitor_->error.empty();
}

ProcessGroup::~ProcessGroup() {
  leave();
  if (size_ == 1) return;
  try {
    if (clean_) {
      // Note [leaving together]: rank 0's process hosts the store, so it leaves last — the
      // others may still be using the store (their monitor, a last key) a moment after their
      // final collective. Bounded: a rank that never comes costs at most 30 s here.
      // Only the store's host (global rank 0) waits, in each of its groups. A rank that aborts
      // or dies instead will not come: stop waiting for it then.
      store_->add("pg/exited", 1);
      if (rank_ == 0 && global_ranks_[0] == 0) {
        const auto deadline = std::chrono::steady_clock::now() + std::min<Milliseconds>(options_.timeout, std::chrono::seconds(30));
        auto gone = [&] {
          if (store_->check({kAbortKey})) return true;
          return !dead_ranks().empty();
        };
        for (int polls = 0; store_->add("pg/exited", 0) < size_ && std::chrono::steady_clock::now() < deadline; ++polls) {
          if (polls % 16 == 0 && gone()) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    }
  } catch (...) {  // the store may be gone already: nothing left to coordinate
  }
}

void ProcessGroup::start_monitor() {
  // A group of one has nobody to wait for, but its collectives still have deadlines (NCCL's
  // poll_in_flight), so it has a monitor too.
  const Device d = device();
  monitor_->thread = std::thread([this, d] {
    // First, before anything can touch CUDA: without it the thread's first CUDA call (an event
    // query in poll_in_flight) would make a context on GPU 0 in every rank.
    try {
      set_current_device(d);
    } catch (const std::exception& e) {
      TANDEM_LOG_ERROR("process group monitor: ", e.what());
    }
    monitor_->device_promise.set_value(current_device());
    monitor_loop();
  });
}

Device ProcessGroup::monitor_device() const {
  TANDEM_CHECK(monitor_->device_future.wait_for(std::chrono::seconds(10)) == std::future_status::ready, Value,
               "group ", name_, ": the monitor thread has not started");
  return monitor_->device_future.get();
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
        fail(where() + " stops because another rank failed: " + store_->get_string(kAbortKey), false);
      }
      // One request for every rank that left without a goodbye (store.h), not one per rank.
      for (int r : healthy ? dead_ranks() : std::vector<int>{}) {
        if (r != rank_) {
          fail(rank_str(r) + " died (it left the store without saying goodbye); " + where() + " stops", false);
          break;
        }
      }
    } catch (const std::exception& e) {
      fail(where() + " lost the store: " + e.what(), false);
    }
    // Apart from the store: an error here is the engine's or the device's (a CUDA error from an
    // event query), and is reported as what it is.
    try {
      poll_in_flight();
    } catch (const std::exception& e) {
      fail(where() + ": checking the collectives in flight failed: " + e.what(), false);
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
  os << c.str() << " on " << where() << ": " << reason;
  try {
    // Dead ranks first (the store saw their connection drop without a goodbye); then live ranks
    // whose published progress shows they never started this collective. A rank that has not
    // published yet (progress goes out about once per monitor interval) is not accused.
    std::vector<std::string> dead, behind;
    std::string aborted;  // what a rank that failed first published (the group's abort key)
    // A peer's death can reach this rank through the engine (a closed connection) a moment
    // before the store's server notices it: look again for a short while before giving up.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    do {
      dead.clear();
      behind.clear();
      const std::vector<int> gone = dead_ranks();
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        if (std::find(gone.begin(), gone.end(), r) != gone.end()) {
          dead.push_back(rank_str(r));
        } else if (store_->check({progress_key(r)})) {
          const int64_t seen = std::stoll(store_->get_string(progress_key(r)));
          if (seen <= static_cast<int64_t>(c.seq)) {
            behind.push_back(rank_str(r) + " (last seen at #" + std::to_string(seen - 1) + ")");
          }
        }
      }
      if (store_->check({kAbortKey})) aborted = store_->get_string(kAbortKey);
      if (!dead.empty() || !behind.empty() || !aborted.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } while (std::chrono::steady_clock::now() < give_up);
    auto join = [](const std::vector<std::string>& xs) {
      std::string out;
      for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + xs[i];
      return out;
    };
    if (!dead.empty()) os << "; " << join(dead) << (dead.size() > 1 ? " are" : " is") << " gone (left the store without a goodbye)";
    if (!behind.empty()) os << "; did not arrive: " << join(behind);
    // A peer that failed (or left with collectives in flight) closes its connections as it
    // aborts: this rank's engine may see that before the monitor reads the abort key, so the
    // message carries the peer's own reason.
    if (!aborted.empty()) os << "; another rank failed first: " << aborted;
  } catch (const std::exception& e) {
    os << " (the store could not say which ranks are missing: " << e.what() << ")";
  }
  return os.str();
}

}  // namespace tandem::parallel::distributed
