#pragma once
// The tensor-parallel modes of the test worker (tests/distributed/dist_worker.cpp), one shard
// per rank (worker_tensor_parallel.cpp):
//
//   tensor-parallel [--adam] [--steps S] [--batch B] [--kill-rank R --kill-step S]
//        LeNet with Linear(400, 120) column-split and Linear(120, 84) row-split over the ranks,
//        the other layers replicated, trained with SGD + momentum (or Adam); every rank also
//        trains the unsplit LeNet in-process on the same batches and prints
//        "tp rank R max_rel_err X loss_err Y forward_err Z replicas C" (X: this rank's shards
//        and replicated layers against the unsplit ones; C: a checksum of the replicated
//        layers, the same on every rank)
//   tensor-parallel-errors
//        bad splits over the group; prints each error ("caught: ...")
#include <memory>
#include <string>
#include <vector>

namespace tandem::parallel::distributed {
class ProcessGroup;
}

namespace tandem::test {

// Runs `mode` (one of the above); throws what fails.
void run_tensor_parallel(const std::string& mode,
                         const std::shared_ptr<parallel::distributed::ProcessGroup>& group,
                         const std::vector<std::string>& args);

}  // namespace tandem::test
