// One pipeline stage per process over Gloo: the test worker (tests/distributed/dist_worker.cpp,
// mode "pipeline") started by tandem-run with 2 and 4 ranks on localhost. GPipe and 1F1B with
// M in {1, 2, 3, 4, 8} on a batch of 11 (uneven micro-batches) reach the parameters of
// one-device training after 3 steps (LeNet, SGD with momentum and Adam); each stage's activation
// memory is flat in M under 1F1B and grows under GPipe; a killed stage ends the job naming the
// rank; a header that is not the one expected is an error naming both sides.
// Timeouts are test-sized (TANDEM_DIST_TIMEOUT).
#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "catch.h"
#include "distributed/worker_run.h"
#include "data/data_test_util.h"
#include "helpers.h"
#include "parallel/distributed/launch.h"

namespace {

using Result = tandem::test::WorkerResult;
using tandem::test::sh;
std::string env(int timeout_s = 20) { return tandem::test::dist_timeout_env(timeout_s); }
Result run(const tandem::test::TempDir& dir, int n, const std::string& args, int timeout_s = 20) {
  return tandem::test::run_workers(dir, n, args, timeout_s);
}

using tandem::test::contains;
using tandem::test::TempDir;
using Clock = std::chrono::steady_clock;

// Every "stage S max_rel_err X loss_err Y in_flight K" line: {S: {X, Y, K}}.
struct StageLine {
  double err, loss_err;
  int in_flight;
};
std::map<int, StageLine> stage_lines(const std::string& out) {
  std::map<int, StageLine> lines;
  std::regex re("stage ([0-9]+) max_rel_err ([-+.e0-9]+) loss_err ([-+.e0-9]+) in_flight ([0-9]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    lines[std::stoi((*it)[1])] = {std::stod((*it)[2]), std::stod((*it)[3]), std::stoi((*it)[4])};
  return lines;
}

// Tolerance as tests/parallel/test_pipeline.cpp: 1e-5 relative, and bitwise for M = 1 (the
// same arithmetic as one device, stage by stage; the bytes cross processes unchanged).
void check_equals_one_device(int ranks, const std::string& opt) {
  TempDir dir;
  for (int M : {1, 2, 3, 4, 8}) {
    for (const char* kind : {"gpipe", "1f1b"}) {
      Result r = run(dir, ranks, std::string("pipeline --schedule ") + kind + " --micro-batches " + std::to_string(M) +
                                     " --steps 3 --batch 11 " + opt);
      INFO(ranks << " processes, " << kind << ", M " << M << " " << opt << "\n" << r.output);
      CHECK(r.code == 0);
      const auto lines = stage_lines(r.output);
      REQUIRE(lines.size() == size_t(ranks));
      for (const auto& [s, l] : lines) {
        CHECK(l.err <= (M == 1 ? 0.0 : 1e-5));
        CHECK(l.loss_err <= 1e-5);
        // What each stage held at once is what the schedule says (Note [1F1B in-flight bound]).
        CHECK(l.in_flight == (std::string(kind) == "1f1b" ? std::min(ranks - s, M) : M));
      }
    }
  }
}

}  // namespace

TEST_CASE("pipeline over 2 processes equals one-device training (SGD momentum)", "[dist][pipeline]") {
  check_equals_one_device(2, "");
}

TEST_CASE("pipeline over 2 processes equals one-device training (Adam)", "[dist][pipeline]") {
  check_equals_one_device(2, "--adam");
}

TEST_CASE("pipeline over 4 processes equals one-device training (SGD momentum)", "[dist][pipeline]") {
  check_equals_one_device(4, "");
}

TEST_CASE("pipeline over 4 processes equals one-device training (Adam)", "[dist][pipeline]") {
  check_equals_one_device(4, "--adam");
}

// Every "stage S <schedule> M m ... peak X MB above live, of which gradients G MB" line: {S: X - G}.
std::map<int, double> activation_peaks(const std::string& out) {
  std::map<int, double> peaks;
  std::regex re("stage ([0-9]+) [a-z0-9]+ M [0-9]+ .* peak ([.0-9]+) MB above live, of which gradients ([.0-9]+) MB");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    peaks[std::stoi((*it)[1])] = std::stod((*it)[2]) - std::stod((*it)[3]);
  return peaks;
}

TEST_CASE("Over processes, 1F1B's activation memory per stage stays flat in M and GPipe's grows",
          "[dist][pipeline][memory]") {
  // Micro-batches of a fixed 32 rows, so the batch grows with M: each process is one stage and
  // its allocator peak is the stage's own (Note [sent tensors are released]). From M = 4 on,
  // 1F1B is in its steady state on both stages (a weight gradient accumulated while two
  // micro-batches are held), so the peaks compare like with like.
  TempDir dir;
  std::map<std::string, std::map<int, std::map<int, double>>> peak;  // [schedule][M][stage]
  for (const char* kind : {"gpipe", "1f1b"}) {
    for (int M : {4, 16}) {
      Result r = run(dir, 2, std::string("pipeline-bench --schedule ") + kind + " --micro-batches " +
                                 std::to_string(M) + " --rows 32 --width 128 --layers 2 --steps 3");
      INFO(kind << " M " << M << "\n" << r.output);
      REQUIRE(r.code == 0);
      peak[kind][M] = activation_peaks(r.output);
      REQUIRE(peak[kind][M].size() == 2);
    }
  }
  for (int s : {0, 1}) {
    INFO("stage " << s << ": gpipe " << peak["gpipe"][4][s] << " -> " << peak["gpipe"][16][s] << " MB, 1f1b "
                  << peak["1f1b"][4][s] << " -> " << peak["1f1b"][16][s] << " MB");
    CHECK(peak["gpipe"][16][s] > 2.0 * peak["gpipe"][4][s]);
    CHECK(peak["1f1b"][16][s] <= 1.05 * peak["1f1b"][4][s]);
  }
}

TEST_CASE("A killed pipeline stage ends the job, naming the rank", "[dist][pipeline][failure]") {
  TempDir dir;
  Result r = run(dir, 4, "pipeline --micro-batches 4 --kill-rank 2 --kill-step 1", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(r.seconds < 5 + 3);
  CHECK(contains(r.output, "rank 2 (pid"));
  CHECK(contains(r.output, "SIGKILL"));
}

TEST_CASE("Without a launcher, the neighbour of a killed stage fails on its own, naming the rank",
          "[dist][pipeline][failure]") {
  TempDir dir;
  const int port = tandem::parallel::distributed::free_port();
  const std::string common = env(5) + "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=p" + std::to_string(port) + " ";
  const std::string w = std::string(TANDEM_DIST_WORKER_PATH) + " pipeline --kill-rank 1 --kill-step 1";
  Result r = sh(dir, "(" + common + "RANK=1 LOCAL_RANK=1 " + w + " & " + common + "RANK=0 LOCAL_RANK=0 " + w +
                         "; echo rank0 exit $?; wait)");
  INFO(r.output);
  CHECK(contains(r.output, "rank0 exit 1"));
  CHECK(r.seconds < 5 + 10);  // within the timeout (a dead peer is usually seen at once)
  // The dead neighbour shows in the receive that waits for it, or in a send posted after its
  // connection closed (whichever stage 0 reaches first).
  CHECK(std::regex_search(r.output, std::regex("pipeline stage 0 \\(cpu:0\\) at [FB][0-9]+: (recv|send) #[0-9]+ .* on rank 0 of 2")));
  CHECK(contains(r.output, "rank 1"));
}

TEST_CASE("A pipeline message that is not the one expected is an error naming both sides", "[dist][pipeline]") {
  TempDir dir;
  Result r = run(dir, 2, "pipeline-messages", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(contains(r.output, "caught ShapeError: pipeline: stage 0 received the gradient of micro-batch 0 (float32 [3, 2]) "
                           "from stage 1 for an activation of shape [2,3]"));
  CHECK(contains(r.output, "caught ValueError: pipeline: stage 1 expected the activation of micro-batch 0 from stage 0 "
                           "but received the activation of micro-batch 1 (float32 [2, 3])"));
}

#endif
