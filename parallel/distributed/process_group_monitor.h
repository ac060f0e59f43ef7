#pragma once
// Inside the process groups (process_group.cpp, process_group_monitor.cpp): the monitor's state
// and the store keys of failure handling. Not part of the API.
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/distributed/process_group.h"

namespace tandem::parallel::distributed {

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
  // The first error a collective call of this group threw (an argument error, a failed wait):
  // a rank that leaves after one does not say a clean goodbye (Note [leaving a group]).
  std::string call_error;
  std::promise<Device> device_promise;  // what the thread runs under (monitor_device)
  std::shared_future<Device> device_future = device_promise.get_future().share();
};

// The number of collectives `rank` has started, as its monitor publishes it (failure_message
// names the ranks behind); the first error of a group, for the others (Note [collective failures]).
inline std::string progress_key(int rank) { return "pg/progress/" + std::to_string(rank); }
inline constexpr const char* kAbortKey = "pg/abort";

}  // namespace tandem::parallel::distributed
