// Subgroups across real processes: 4 Gloo ranks started by tandem-run, arranged as a 2x2 grid
// (rows {0,1} {2,3}, columns {0,2} {1,3}; tests/distributed/dist_worker.cpp's subgroup modes).
// Different collectives run on rows, columns and the world at the same time and give the right
// results; a mismatched collective in one row is the fingerprint error naming that row, and a
// rank killed in a row is reported with the row's ranks and the global rank.
#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "catch.h"
#include "data/data_test_util.h"
#include "parallel/distributed/launch.h"

namespace {

using tandem::test::TempDir;

struct Result {
  int code;
  std::string output;
  double seconds;
};

// tandem-run --standalone --nproc-per-node 4 worker args, with test-sized timeouts.
Result run4(const TempDir& dir, const std::string& args, int timeout_s = 20) {
  static int n = 0;
  const std::string out = dir.file("sub" + std::to_string(n++) + ".txt");
  const std::string cmd = "TANDEM_DIST_TIMEOUT=" + std::to_string(timeout_s) + " " + TANDEM_RUN_PATH +
                          std::string(" --standalone --grace-seconds 1 --nproc-per-node 4 ") + TANDEM_DIST_WORKER_PATH +
                          " " + args + " > " + out + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str(), s};
}

// The 4 ranks started by hand, so that no launcher stops the others when one fails: each must
// end on its own. Prints "rank R exit C" for each.
Result by_hand(const TempDir& dir, const std::string& args, int timeout_s = 20) {
  const int port = tandem::parallel::distributed::free_port();
  const std::string common = "TANDEM_DIST_TIMEOUT=" + std::to_string(timeout_s) +
                             " WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                             std::to_string(port) + " TANDEM_JOB_ID=g" + std::to_string(port) + " ";
  std::string cmd = "(";
  for (int r = 0; r < 4; ++r) {
    cmd += "(" + common + "RANK=" + std::to_string(r) + " LOCAL_RANK=" + std::to_string(r) + " " +
           TANDEM_DIST_WORKER_PATH + " " + args + "; echo rank " + std::to_string(r) + " exit $?) & ";
  }
  cmd += "wait)";
  static int n = 0;
  const std::string out = dir.file("hand" + std::to_string(n++) + ".txt");
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system((cmd + " > " + out + " 2>&1").c_str());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str(), s};
}

size_t count(const std::string& text, const std::string& part) {
  size_t k = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++k;
  return k;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("Subgroups on 4 processes: rows, columns and the world run collectives at the same time", "[dist][gloo]") {
  TempDir dir;
  Result r = run4(dir, "subgroups");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(count(r.output, "subgroups ok") == 4);
  CHECK(contains(r.output, "subgroups ok (row 2, column 1)"));  // global rank 3
}

TEST_CASE("Subgroups on 4 processes: a mismatched collective in one row is that row's fingerprint error",
          "[dist][gloo]") {
  TempDir dir;
  Result r = by_hand(dir, "subgroup-fingerprint");
  INFO(r.output);
  CHECK(contains(r.output, "rank 2 exit 1"));
  CHECK(contains(r.output, "rank 3 exit 1"));
  CHECK(contains(r.output, "collective #0 differs between ranks of group [2, 3]: rank 0 (global 2) called allreduce "
                           "#0 (float32 x 10, sum), rank 1 (global 3) called allreduce #0 (float32 x 20, sum)"));
  CHECK(count(r.output, "row of 0 ok") == 2);  // the other row is not affected
  CHECK(contains(r.output, "rank 0 exit 0"));
  CHECK(contains(r.output, "rank 1 exit 0"));
  CHECK_FALSE(contains(r.output, "not detected"));
  CHECK(r.seconds < 10);
}

TEST_CASE("Subgroups on 4 processes: a rank killed in a row is named with its row and global rank", "[dist][gloo]") {
  TempDir dir;
  Result r = by_hand(dir, "subgroup-kill");
  INFO(r.output);
  CHECK(contains(r.output, "rank 2 exit 1"));
  CHECK(contains(r.output, "on rank 0 (global 2) of group [2, 3]"));
  CHECK(contains(r.output, "rank 1 (global 3)"));
  CHECK(count(r.output, "row of 0 ok") == 2);  // the other row finishes
  CHECK(r.seconds < 10);
}

#endif
