// Tensor parallelism with one shard per process over Gloo: the test worker's "tensor-parallel"
// modes (tests/distributed/worker_tensor_parallel.cpp) started by tandem-run with 2 and 4 ranks
// on localhost. LeNet with Linear(400, 120) column-split and Linear(120, 84) row-split, on
// batches of 11, trains to the parameters of the unsplit model after 1 and 4 steps, SGD with
// momentum and Adam; the replicated layers stay the same on every rank; a killed shard ends the
// job naming the rank; a bad split is an error naming the features and the ranks. Timeouts are test-sized (TANDEM_DIST_TIMEOUT).
#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <map>
#include <regex>
#include <string>

#include "catch.h"
#include "data/data_test_util.h"
#include "distributed/worker_run.h"
#include "helpers.h"

namespace {

using tandem::test::contains;
using tandem::test::TempDir;
using tandem::test::WorkerResult;

// Every "tp rank R max_rel_err X loss_err Y forward_err Z replicas C" line, by rank.
struct RankLine {
  double err, loss_err, forward_err;
  std::string replicas;  // printed with 17 digits: compared as text, bit for bit
};
std::map<int, RankLine> rank_lines(const std::string& out) {
  std::map<int, RankLine> lines;
  std::regex re("tp rank ([0-9]+) max_rel_err ([-+.e0-9]+) loss_err ([-+.e0-9]+) forward_err ([-+.e0-9]+) "
                "replicas ([-+.e0-9]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    lines[std::stoi((*it)[1])] = {std::stod((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4]), (*it)[5]};
  return lines;
}

// 1e-5 relative after k steps, as the one-process tensor-parallel test (tests/parallel/).
void check_equals_one_process(int ranks, const std::string& opt) {
  TempDir dir;
  for (int steps : {1, 4}) {
    WorkerResult r = tandem::test::run_workers(
        dir, ranks, "tensor-parallel --steps " + std::to_string(steps) + " --batch 11 " + opt);
    INFO(ranks << " processes, " << steps << " steps " << opt << "\n" << r.output);
    CHECK(r.code == 0);
    const auto lines = rank_lines(r.output);
    REQUIRE(lines.size() == size_t(ranks));
    for (const auto& [rank, l] : lines) {
      CHECK(l.err <= 1e-5);
      CHECK(l.loss_err <= 1e-5);
      CHECK(l.forward_err <= 1e-5);
      // Every rank received the whole gradient of the replicated layers: they stay equal.
      CHECK(l.replicas == lines.begin()->second.replicas);
    }
  }
}

}  // namespace

TEST_CASE("tensor parallelism over 2 processes equals one-process training (SGD momentum)",
          "[dist][tensor-parallel]") {
  check_equals_one_process(2, "");
}

TEST_CASE("tensor parallelism over 2 processes equals one-process training (Adam)", "[dist][tensor-parallel]") {
  check_equals_one_process(2, "--adam");
}

TEST_CASE("tensor parallelism over 4 processes equals one-process training (SGD momentum)",
          "[dist][tensor-parallel]") {
  check_equals_one_process(4, "");
}

TEST_CASE("tensor parallelism over 4 processes equals one-process training (Adam)", "[dist][tensor-parallel]") {
  check_equals_one_process(4, "--adam");
}

TEST_CASE("A killed tensor-parallel shard ends the job, naming the rank", "[dist][tensor-parallel][failure]") {
  TempDir dir;
  WorkerResult r = tandem::test::run_workers(dir, 4, "tensor-parallel --kill-rank 2 --kill-step 1", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(r.seconds < 5 + 3);
  CHECK(contains(r.output, "rank 2 (pid"));
  CHECK(contains(r.output, "SIGKILL"));
}

TEST_CASE("A tensor-parallel split with more ranks than features is an error naming both",
          "[dist][tensor-parallel]") {
  TempDir dir;
  WorkerResult r = tandem::test::run_workers(dir, 4, "tensor-parallel-errors", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(contains(r.output, "caught column: ColumnParallelLinear: 3 output features over 4 ranks; every rank needs one"));
  CHECK(contains(r.output, "caught row: RowParallelLinear: 3 input features over 4 ranks; every rank needs one"));
  CHECK(contains(r.output, "caught two inputs: copy_to_tensor_parallel_region: 2 tensors for 1 rank"));
  CHECK(contains(r.output, "caught full_weight: ColumnParallelLinear::full_weight: this process holds 1 of the 4 "
                           "shards"));
}

#endif
