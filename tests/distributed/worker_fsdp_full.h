#pragma once
// The FULL_SHARD modes of the test worker (tests/distributed/worker_fsdp_full.cpp), reached from
// dist_worker.cpp's dispatch; tests/distributed/test_zero.cpp starts them under tandem-run.
#include <memory>
#include <string>
#include <vector>

#include "parallel/distributed/process_group.h"

namespace tandem::test {

// Runs `mode` when it is one of the fsdp-full modes and returns true; false for another mode.
// Throws (the worker exits 1) when a check fails.
bool run_fsdp_full_mode(const std::string& mode,
                        const std::shared_ptr<parallel::distributed::ProcessGroup>& group,
                        const std::vector<std::string>& args);

}  // namespace tandem::test
