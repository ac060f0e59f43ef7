// Pipeline stages x data-parallel replicas on a 2 x 2 grid of Gloo processes: the test worker
// (tests/distributed/dist_worker.cpp, mode "grid") under tandem-run with 4 ranks. GPipe and 1F1B,
// M in {1, 2, 3}, a global batch of 11 (shards of 6 and 5, uneven micro-batches), SGD with
// momentum and Adam: after 3 steps every rank's stage equals one-process training on the global
// batch and the two replicas of a stage hold the same parameters; a grid that is not the world
// size is an error naming both; a killed rank ends the job naming it.
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
#include "data/data_test_util.h"
#include "helpers.h"

namespace {

using tandem::test::contains;
using tandem::test::TempDir;
using Clock = std::chrono::steady_clock;

struct Result {
  int code;
  std::string output;
  double seconds;
};

Result run(const TempDir& dir, const std::string& args, int timeout_s = 20) {
  static int n = 0;
  const std::string out = dir.file("grid" + std::to_string(n++) + ".txt");
  const std::string cmd = "TANDEM_DIST_TIMEOUT=" + std::to_string(timeout_s) + " " + TANDEM_RUN_PATH +
                          std::string(" --standalone --grace-seconds 1 --nproc-per-node 4 ") +
                          TANDEM_DIST_WORKER_PATH + " " + args;
  const auto t0 = Clock::now();
  const int status = std::system((cmd + " > " + out + " 2>&1").c_str());
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str(), s};
}

struct Line {
  int stage, replica;
  double err, loss_err;
  std::string checksum;
};
std::vector<Line> grid_lines(const std::string& out) {
  std::vector<Line> lines;
  std::regex re("grid stage ([0-9]+) replica ([0-9]+) max_rel_err ([-+.e0-9]+) loss_err ([-+.e0-9]+) checksum ([-+.e0-9]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    lines.push_back({std::stoi((*it)[1]), std::stoi((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4]), (*it)[5]});
  return lines;
}

void check_equals_one_process(const std::string& opt) {
  TempDir dir;
  for (int M : {1, 2, 3}) {
    for (const char* kind : {"gpipe", "1f1b"}) {
      Result r = run(dir, std::string("grid --schedule ") + kind + " --micro-batches " + std::to_string(M) +
                              " --steps 3 --batch 11 " + opt);
      INFO(kind << ", M " << M << " " << opt << "\n" << r.output);
      CHECK(r.code == 0);
      const auto lines = grid_lines(r.output);
      REQUIRE(lines.size() == 4);
      std::map<int, std::string> checksum;  // stage -> the first replica's
      std::map<std::pair<int, int>, int> seen;
      for (const Line& l : lines) {
        CHECK(l.err <= 1e-5);
        CHECK(l.loss_err <= 1e-5);
        ++seen[{l.stage, l.replica}];
        // The replicas of a stage apply the same averaged gradients: the same parameters.
        if (checksum.count(l.stage)) CHECK(checksum[l.stage] == l.checksum);
        else checksum[l.stage] = l.checksum;
      }
      CHECK(seen.size() == 4);  // every (stage, replica) once
    }
  }
}

}  // namespace

TEST_CASE("a 2 x 2 grid of stages and replicas equals one-process training (SGD momentum)", "[dist][pipeline][grid]") {
  check_equals_one_process("");
}

TEST_CASE("a 2 x 2 grid of stages and replicas equals one-process training (Adam)", "[dist][pipeline][grid]") {
  check_equals_one_process("--adam");
}

TEST_CASE("a grid that is not the world size is an error naming both", "[dist][pipeline][grid]") {
  TempDir dir;
  Result r = run(dir, "grid --stages 3 --replicas 1", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(contains(r.output, "GridLayout: 3 stages x 1 replicas = 3 processes, but the world has 4"));
}

TEST_CASE("a killed rank of the grid ends the job, naming the rank", "[dist][pipeline][grid][failure]") {
  TempDir dir;
  Result r = run(dir, "grid --micro-batches 2 --kill-rank 3 --kill-step 1", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(r.seconds < 5 + 3);
  CHECK(contains(r.output, "rank 3 (pid"));
  CHECK(contains(r.output, "SIGKILL"));
}

#endif
