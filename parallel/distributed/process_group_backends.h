#pragma once
// The backends' factories, for process_group.cpp's new_process_group, and what the backends
// share. Each factory is defined in its own file and throws DistError when its engine is not in
// this build.
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/distributed/process_group.h"

namespace tandem::parallel::distributed {

// CPU tensors over Gloo's TCP transport (process_group_gloo.cpp). master_addr picks the
// address Gloo's pairs listen on (loopback for a job on loopback). global_ranks: as in
// ProcessGroup's constructor.
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, const std::string& master_addr,
                                              std::vector<int> global_ranks = {});
// This rank's GPU (the current CUDA device) over NCCL (process_group_nccl.cpp).
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options, std::vector<int> global_ranks = {});

// Note [settling without the lock]
// A non-blocking NCCL communicator answers a call with "in progress" and must be polled until it
// settles. The poll needs the communicator's lock (ncclCommAbort frees what the poll reads), but
// holding that lock for the whole wait would keep the monitor from aborting the communicator,
// so a dead peer would cost the whole timeout instead of a monitor interval. settle_unlocked
// therefore takes `mu` for each poll only, and abort takes precedence: once aborted() is true
// (read under `mu`) it stops polling.
enum class SettleResult { kDone, kAborted, kTimedOut };
// Calls in_progress() under `mu` until it returns false (kDone), aborted() returns true
// (kAborted, checked first, under `mu` too) or `timeout` has passed (kTimedOut). `mu` is not
// held between polls nor on return.
SettleResult settle_unlocked(std::mutex& mu, const std::function<bool()>& aborted,
                             const std::function<bool()>& in_progress, Milliseconds timeout);

}  // namespace tandem::parallel::distributed
