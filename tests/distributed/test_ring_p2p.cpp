// The teaching ring allreduce over send/recv (parallel/distributed/ring_p2p.h) across real processes:
// the test worker's "ring" mode (tests/distributed/dist_worker.cpp) started by tandem-run on localhost
// with 2 and 3 ranks (and 1, where it has nothing to do). Closed-form sums at tiny, odd and
// large sizes, and random data against the group's own allreduce.
#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "catch.h"
#include "data/data_test_util.h"

namespace {

using tandem::test::TempDir;

struct Result {
  int code;
  std::string output;
};

// Runs a shell command line; returns its exit code and what it printed.
Result sh(const TempDir& dir, const std::string& cmd) {
  static int n = 0;
  const std::string out = dir.file("out" + std::to_string(n++) + ".txt");
  const int status = std::system((cmd + " > " + out + " 2>&1").c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

// tandem-run --standalone --nproc-per-node n worker args, with test-sized timeouts.
Result run(const TempDir& dir, int n, const std::string& args, int timeout_s = 20) {
  return sh(dir, "TANDEM_DIST_TIMEOUT=" + std::to_string(timeout_s) + " " + TANDEM_RUN_PATH +
                     std::string(" --standalone --grace-seconds 1 --nproc-per-node ") +
                     std::to_string(n) + " " + TANDEM_DIST_WORKER_PATH + " " + args);
}

size_t count(const std::string& text, const std::string& part) {
  size_t k = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++k;
  return k;
}

}  // namespace

TEST_CASE("Ring allreduce over send/recv: closed-form sums, equal to allreduce, 1 to 3 processes",
          "[dist][gloo]") {
  TempDir dir;
  for (int n : {1, 2, 3}) {
    Result r = run(dir, n, "ring");
    INFO(n << " ranks\n" << r.output);
    CHECK(r.code == 0);
    CHECK(count(r.output, "ring ok") == size_t(n));
  }
}

#endif
