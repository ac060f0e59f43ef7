// The one-page data-parallel step (examples/train_step.cpp) end to end on generated data: it
// trains on two virtual CPU devices, the loss goes down, the replicas stay identical, and bad
// flags and missing data fail with the documented exit codes.
#ifdef TANDEM_TRAIN_STEP_PATH
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "data/data_test_util.h"

namespace {

struct Run {
  int code;
  std::string output;
};

Run train_step(const std::string& args) {
  tandem::test::TempDir dir;
  const std::string out = dir.file("out.txt");
  const int status = std::system((std::string(TANDEM_TRAIN_STEP_PATH) + " " + args + " > " + out + " 2>&1").c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

}  // namespace

TEST_CASE("train_step trains on two virtual CPU devices", "[examples]") {
  const Run r = train_step("--synthetic 320 --epochs 4 --batch-size 32 --lr 0.1 --activation relu");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::regex line(R"(epoch (\d+)  loss ([0-9.]+)  replicas differ by ([0-9.e+-]+))");
  std::vector<double> losses;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
    losses.push_back(std::stod((*it)[2]));
    CHECK(std::stod((*it)[3]) == 0.0);  // the same update from the same gradient: bit-identical
  }
  REQUIRE(losses.size() == 4);
  CHECK(losses.back() < losses.front());
  CHECK(losses.back() < 1.0);  // well below ln 10 = 2.30, where a network that learned nothing sits
}

TEST_CASE("train_step rejects bad flags and missing data", "[examples]") {
  for (const char* bad : {"--epochs 0", "--devices cpu:0,cuda:0", "--devices gpu:1", "--unknown 3", "--activation tanh"}) {
    const Run r = train_step(bad);
    INFO(bad << ": " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.rfind("train_step: ", 0) == 0);
  }
  const Run missing = train_step("--data /nonexistent/fashion");
  INFO(missing.output);
  CHECK(missing.code == 1);
  CHECK(missing.output.find("/nonexistent/fashion") != std::string::npos);
}
#endif
