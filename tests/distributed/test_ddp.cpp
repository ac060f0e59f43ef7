// DistributedDataParallel and the Gloo process group across real processes: the test worker
// (tests/distributed/dist_worker.cpp) started by tandem-run with 2 and 3 ranks on localhost, plus the
// failure cases — a rank killed mid-training, different models, a bad environment, a second
// job on the same port. Timeouts are test-sized (TANDEM_DIST_TIMEOUT).
#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

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

// The "params HASH" lines of every rank.
std::set<std::string> param_hashes(const std::string& out) {
  std::set<std::string> hashes;
  std::regex re("params ([0-9a-f]{16})");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it)
    hashes.insert((*it)[1]);
  return hashes;
}

size_t count(const std::string& text, const std::string& part) {
  size_t k = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++k;
  return k;
}

}  // namespace

TEST_CASE("Gloo process group: every collective gives the closed-form result on 2 and 3 processes", "[dist][gloo]") {
  TempDir dir;
  for (int n : {2, 3}) {
    Result r = run(dir, n, "collectives");
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(count(r.output, "collectives ok") == size_t(n));
  }
}

TEST_CASE("DDP over Gloo trains to the one-process parameters (BatchNorm, uneven shards)", "[dist][ddp]") {
  TempDir dir;
  struct Case {
    int ranks;
    std::string args;
  };
  for (const Case& c : {Case{2, "--steps 4 --batch 10"}, Case{3, "--steps 4 --batch 10"},  // 10 = 4+3+3 on 3 ranks
                        Case{2, "--bn --steps 5 --batch 11"}, Case{3, "--bn --steps 5 --batch 11"},
                        Case{2, "--steps 4 --batch 10 --no-overlap"}, Case{3, "--steps 3 --batch 9 --bucket-kb 100"}}) {
    Result r = run(dir, c.ranks, "ddp " + c.args);
    INFO(c.ranks << " ranks, " << c.args << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK(contains(r.output, "max_rel_err"));
    CHECK(param_hashes(r.output).size() == 1);  // every rank holds bit-identical parameters
    CHECK(count(r.output, "params ") == size_t(c.ranks));
  }
}

TEST_CASE("DDP no_sync accumulation over k steps equals one batch k times larger", "[dist][ddp]") {
  TempDir dir;
  for (int k : {2, 3}) {
    Result r = run(dir, 2, "no-sync --accum " + std::to_string(k));
    INFO(r.output);
    CHECK(r.code == 0);
    CHECK(contains(r.output, "max_rel_err"));
  }
}

// Note [the forward arms the reducer] (parallel/reducer.h): rank 1 alone runs a backward
// through ddp.module() while rank 0 goes on to its next step; a collective from it would pair
// with rank 0's allreduces (a fingerprint error or a timeout), so ending fast and clean is the
// check, with the gradients the local ones. no_sync around the backward only or around the
// forward only: the forward decides.
TEST_CASE("DDP reduces only a backward that its forward armed, outside no_sync", "[dist][ddp]") {
  TempDir dir;
  Result r = run(dir, 2, "armed", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(count(r.output, "armed ok") == 2);
  std::set<std::string> synced;
  std::regex re("synced ([0-9a-f]{16})");
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), re); it != std::sregex_iterator(); ++it)
    synced.insert((*it)[1]);
  CHECK(synced.size() == 1);  // the reduced gradients are the same on both ranks
  CHECK(count(r.output, "synced ") == 2);
  CHECK(r.seconds < 5);
}

TEST_CASE("DDP: an unused parameter is a named error unless find_unused_parameters", "[dist][ddp]") {
  TempDir dir;
  Result bad = run(dir, 2, "unused");
  INFO(bad.output);
  CHECK(bad.code != 0);
  CHECK(contains(bad.output, "'unused.weight'"));
  CHECK(contains(bad.output, "find_unused_parameters"));
  Result ok = run(dir, 2, "unused --find-unused");
  INFO(ok.output);
  CHECK(ok.code == 0);
  CHECK(count(ok.output, "unused ok") == 2);
}

TEST_CASE("DDP: a model that differs on one rank is an error naming the parameter and the ranks", "[dist][ddp]") {
  TempDir dir;
  Result r = run(dir, 2, "mismatch");
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(contains(r.output, "5.weight float32 [6,16]"));
  CHECK(contains(r.output, "on rank 1"));
  CHECK(!contains(r.output, "mismatch not detected"));
}

TEST_CASE("A rank killed mid-training ends every rank and the launcher, naming the collective and the rank",
          "[dist][ddp][failure]") {
  TempDir dir;
  Result r = run(dir, 3, "kill --kill-rank 1 --kill-step 3", /*timeout_s=*/5);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(r.seconds < 5 + 3);  // within the collective timeout and the launcher's grace
  CHECK(contains(r.output, "rank 1 (pid"));
  CHECK(contains(r.output, "SIGKILL"));
  // The launcher may stop the survivors before they notice; when one does speak, it names the
  // collective with its number.
  if (contains(r.output, "rank 0: error") || contains(r.output, "rank 2: error")) {
    CHECK(std::regex_search(r.output, std::regex("allreduce #[0-9]+|broadcast #[0-9]+")));
  }
}

TEST_CASE("Without the launcher stopping them, survivors of a killed rank exit non-zero on their own",
          "[dist][ddp][failure]") {
  // Both ranks started by hand (no launcher to stop rank 0): rank 1 dies, rank 0 must notice.
  TempDir dir;
  const int port = tandem::parallel::distributed::free_port();
  const std::string common = env(5) + "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=t" + std::to_string(port) + " ";
  const std::string w = TANDEM_DIST_WORKER_PATH;
  Result r = sh(dir, "(" + common + "RANK=1 LOCAL_RANK=1 " + w + " kill --kill-rank 1 --kill-step 2 & " + common +
                         "RANK=0 LOCAL_RANK=0 " + w + " kill --kill-rank 1 --kill-step 2; echo rank0 exit $?; wait)");
  INFO(r.output);
  CHECK(contains(r.output, "rank0 exit 1"));
  // The 5 s collective timeout plus slack for a loaded machine (a parallel ctest run once took
  // longer than 5 + 3 s): a hang would last until the test's own limit.
  CHECK(r.seconds < 5 + 10);
  CHECK(std::regex_search(r.output, std::regex("(allreduce|broadcast) #[0-9]+ .* on rank 0 of 2")));
  CHECK(contains(r.output, "rank 1"));
}

TEST_CASE("Ranks that issue different collectives get an error naming both, not a hang", "[dist][failure]") {
  TempDir dir;
  Result r = run(dir, 2, "fingerprint", /*timeout_s=*/10);
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK(contains(r.output, "collective #0 differs between ranks"));
  CHECK(contains(r.output, "float32 x 10"));
  CHECK(contains(r.output, "float32 x 20"));
  CHECK(!contains(r.output, "not detected"));
  CHECK(r.seconds < 8);
}

TEST_CASE("A rank that goes silent makes the others time out, naming the collective and the rank",
          "[dist][failure]") {
  TempDir dir;
  // Started by hand so that no launcher stops anyone early: rank 0 must end on its own within
  // the 2 s collective timeout (plus the monitor's publication delay), rank 1 sleeps 6 s.
  const int port = tandem::parallel::distributed::free_port();
  const std::string common = env(2) + "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=s" + std::to_string(port) + " ";
  const std::string w = std::string(TANDEM_DIST_WORKER_PATH) + " silent --after 3 --sleep 6";
  Result r = sh(dir, "(" + common + "RANK=1 LOCAL_RANK=1 " + w + " & s=$(date +%s%N); " + common +
                         "RANK=0 LOCAL_RANK=0 " + w + "; echo rank0 exit $? after $((($(date +%s%N) - s) / 1000000)) ms; wait)");
  INFO(r.output);
  CHECK(contains(r.output, "rank0 exit 1"));
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("after ([0-9]+) ms")));
  CHECK(std::stoi(m[1]) < 4500);  // the 2 s timeout, not rank 1's 6 s sleep
  CHECK(std::regex_search(r.output, std::regex("allreduce #3 .*on rank 0 of 2")));
  CHECK(contains(r.output, "imed out"));
  CHECK(contains(r.output, "did not arrive: rank 1 (last seen at #2)"));
}

TEST_CASE("Two nodes on loopback train to the same numbers as one node", "[dist][ddp]") {
  TempDir dir;
  Result one = run(dir, 2, "ddp --bn --steps 3 --batch 8");
  REQUIRE(one.code == 0);
  const int port = tandem::parallel::distributed::free_port();
  const std::string node = env() + TANDEM_RUN_PATH + std::string(" --nnodes 2 --nproc-per-node 1 --grace-seconds 1 ") +
                           "--master-addr 127.0.0.1 --master-port " + std::to_string(port) + " --node-rank ";
  const std::string args = std::string(" ") + TANDEM_DIST_WORKER_PATH + " ddp --bn --steps 3 --batch 8";
  Result two = sh(dir, "(" + node + "1" + args + " & " + node + "0" + args + "; wait)");
  INFO(one.output << "\n---\n" << two.output);
  CHECK(two.code == 0);
  CHECK(param_hashes(two.output) == param_hashes(one.output));
  CHECK(param_hashes(two.output).size() == 1);
}

TEST_CASE("A bad environment gives one clear line and a non-zero exit", "[dist][failure]") {
  TempDir dir;
  const std::string w = std::string(" ") + TANDEM_DIST_WORKER_PATH + " collectives";
  SECTION("RANK >= WORLD_SIZE") {
    Result r = sh(dir, env(2) + "RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999" + w);
    INFO(r.output);
    CHECK(r.code == 1);
    CHECK(contains(r.output, "RANK=2"));
    CHECK(contains(r.output, "WORLD_SIZE=2"));
  }
  SECTION("nothing listening at MASTER_ADDR:MASTER_PORT") {
    const int port = tandem::parallel::distributed::free_port();
    Result r = sh(dir, env(1) + "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + w);
    INFO(r.output);
    CHECK(r.code == 1);
    CHECK(contains(r.output, "nothing listening at 127.0.0.1:" + std::to_string(port)));
    CHECK(r.seconds < 5);
  }
  SECTION("the port is taken") {
    // A first job holds the port (its rank 1 never comes, so it waits); a second rank 0 on the
    // same port cannot listen.
    const int port = tandem::parallel::distributed::free_port();
    const std::string at = "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port);
    Result r = sh(dir, "(" + env(3) + "RANK=0 WORLD_SIZE=2 " + at + w + " & sleep 0.5; " + env(3) + "RANK=0 WORLD_SIZE=2 " +
                           at + w + "; echo second exit $?; wait)");
    INFO(r.output);
    CHECK(contains(r.output, "second exit 1"));
    CHECK(contains(r.output, "127.0.0.1:" + std::to_string(port)));
    CHECK(contains(r.output, "in use"));
  }
}

TEST_CASE("A second job on the same address and port is refused and the first one's numbers do not change",
          "[dist][failure]") {
  TempDir dir;
  Result alone = run(dir, 2, "ddp --steps 30 --batch 10");
  REQUIRE(alone.code == 0);
  const int port = tandem::parallel::distributed::free_port();
  const std::string at = " --master-addr 127.0.0.1 --master-port " + std::to_string(port) + " --nproc-per-node 2 ";
  const std::string job = env(10) + TANDEM_RUN_PATH + std::string(" --grace-seconds 1 ") + at;
  // The intruder's rank 0 cannot bind the port; its rank 1 reaches the first job's store and
  // is refused by the job id.
  Result r = sh(dir, "(" + job + "--run-id first " + TANDEM_DIST_WORKER_PATH +
                         " ddp --steps 30 --batch 10 --pause-ms 40 > " + dir.file("first.txt") + " 2>&1 & sleep 0.3; " + job +
                         "--run-id second " + TANDEM_DIST_WORKER_PATH + " ddp --steps 30 --batch 10; echo second exit $?; wait)");
  std::ifstream f(dir.file("first.txt"));
  std::stringstream first;
  first << f.rdbuf();
  INFO(r.output << "\n--- first job ---\n" << first.str());
  CHECK(contains(r.output, "second exit 1"));
  CHECK((contains(r.output, "refused") || contains(r.output, "in use")));
  CHECK(param_hashes(first.str()) == param_hashes(alone.output));
}

#endif
