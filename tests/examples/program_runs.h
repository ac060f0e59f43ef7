#pragma once
// Running the example programs from a test: one process, or a job under tandem-run with Gloo
// ranks; their epoch lines as numbers.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/data_test_util.h"

namespace tandem::test {

struct ProgramResult {
  int code;            // the exit code, -1 when a signal ended it
  std::string output;  // stdout and stderr
};

// Runs `command` (a program and its arguments, or environment assignments before them) with
// `args` through the shell, its output into a file of `dir`.
inline ProgramResult run_program(const std::string& command, const TempDir& dir,
                                 const std::string& args = "") {
  const std::string out = dir.file("out.txt");
  const std::string cmd = command + " " + args + " > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

#ifdef TANDEM_RUN_PATH
// Collectives that hang fail in seconds, not the default ten minutes.
inline const std::string kDistEnv = "TANDEM_DIST_TIMEOUT=20 ";

// `program` as nproc ranks of a job under tandem-run on this host.
inline ProgramResult run_launched(const TempDir& dir, int nproc, const std::string& program,
                                  const std::string& args) {
  return run_program(kDistEnv + TANDEM_RUN_PATH +
                         " --standalone --grace-seconds 1 --nproc-per-node " +
                         std::to_string(nproc) + " " + program,
                     dir, args);
}
#endif

struct EpochLine {
  std::string prefix;  // what precedes "epoch" ("[rank 0] " under the launcher)
  long long epoch;
  double loss, train_acc, test_acc;
};

// The "epoch N  loss L  train acc A  test acc T ..." lines of an output.
inline std::vector<EpochLine> epoch_lines(const std::string& out) {
  std::vector<EpochLine> lines;
  std::istringstream is(out);
  for (std::string line; std::getline(is, line);) {
    const size_t at = line.find("epoch ");
    EpochLine e;
    if (at == std::string::npos ||
        std::sscanf(line.c_str() + at, "epoch %lld loss %lf train acc %lf test acc %lf", &e.epoch,
                    &e.loss, &e.train_acc, &e.test_acc) != 4)
      continue;
    e.prefix = line.substr(0, at);
    lines.push_back(e);
  }
  return lines;
}

}  // namespace tandem::test
