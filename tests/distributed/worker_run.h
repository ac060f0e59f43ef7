#pragma once
// Running the test worker (tests/distributed/dist_worker.cpp) and other shell command lines from
// the multi-process tests: each returns the exit code, everything printed (stdout and stderr,
// through a file in the test's folder) and the seconds it took. Timeouts are test-sized: the
// worker's collectives get TANDEM_DIST_TIMEOUT seconds.
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "data/data_test_util.h"

namespace tandem::test {

struct WorkerResult {
  int code;            // the exit status, -1 when killed by a signal
  std::string output;  // stdout and stderr together
  double seconds;
};

// Runs `cmd` with /bin/sh, its output into a new file of `dir`.
inline WorkerResult sh(const TempDir& dir, const std::string& cmd) {
  static int n = 0;
  const std::string out = dir.file("cmd" + std::to_string(n++) + ".txt");
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system((cmd + " > " + out + " 2>&1").c_str());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str(), s};
}

// "TANDEM_DIST_TIMEOUT=<s> ": the environment prefix of a worker's command line.
inline std::string dist_timeout_env(int timeout_s = 20) {
  return "TANDEM_DIST_TIMEOUT=" + std::to_string(timeout_s) + " ";
}

#if defined(TANDEM_DIST_WORKER_PATH) && defined(TANDEM_RUN_PATH)
// tandem-run --standalone --grace-seconds 1 --nproc-per-node n <worker> args
inline WorkerResult run_workers(const TempDir& dir, int n, const std::string& args, int timeout_s = 20) {
  return sh(dir, dist_timeout_env(timeout_s) + TANDEM_RUN_PATH +
                     std::string(" --standalone --grace-seconds 1 --nproc-per-node ") + std::to_string(n) + " " +
                     TANDEM_DIST_WORKER_PATH + " " + args);
}
#endif

}  // namespace tandem::test
