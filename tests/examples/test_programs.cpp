// The lenet and resnet programs end to end on tiny Fashion-MNIST-shaped IDX files written here: it trains,
// writes its CSV, and fails with the documented exit codes and one-line messages.
#ifdef TANDEM_LENET_PATH
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "core/tensor.h"
#include "data/data_test_util.h"
#include "data/idx.h"

namespace {

using tandem::test::TempDir;

struct Result {
  int code;
  std::string output;
};

// Runs a program with `args`; returns its exit code and what it printed.
Result run_program(const char* program, const TempDir& dir, const std::string& args) {
  const std::string out = dir.file("out.txt");
  const std::string cmd = std::string(program) + " " + args + " > " + out + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

Result run_lenet(const TempDir& dir, const std::string& args) {
  return run_program(TANDEM_LENET_PATH, dir, args);
}

// 64 training and 32 test images of 28x28 with labels in [0, 10).
void write_tiny_dataset(const TempDir& dir) {
  using namespace tandem;
  for (auto [prefix, n] : {std::pair<std::string, int64_t>{"train", 64}, {"t10k", 32}}) {
    Tensor images = rand({n, 28, 28}, kFloat64).to(kFloat64);
    std::vector<uint8_t> px;
    for (double v : images.to_vector<double>()) px.push_back(static_cast<uint8_t>(v * 255));
    std::vector<int64_t> labels;
    for (int64_t i = 0; i < n; ++i) labels.push_back(i % 10);
    data::write_idx_images(dir.file(prefix + "-images-idx3-ubyte.gz"), from_vector(px, {n, 28, 28}), true);
    data::write_idx_labels(dir.file(prefix + "-labels-idx1-ubyte.gz"), from_vector(labels, {n}), true);
  }
}

int count_lines(const std::string& path) {
  std::ifstream f(path);
  int n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

}  // namespace

TEST_CASE("lenet trains on tiny data and writes its CSV", "[examples]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string common = "--data " + dir.path().string() + " --epochs 2 --batch-size 16 --no-progress";

  SECTION("one CPU device") {
    Result r = run_lenet(dir, common + " --device cpu --csv " + dir.file("run.csv"));
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("epoch   2") != std::string::npos);
    std::ifstream csv(dir.file("run.csv"));
    std::string header;
    std::getline(csv, header);
    CHECK(header == "epoch,loss,train_acc,test_acc,seconds,images_per_s");
    CHECK(count_lines(dir.file("run.csv")) == 3);
  }
  SECTION("two virtual CPU devices, both parallel paths") {
    for (const char* path : {"scratch", "dp"}) {
      Result r = run_lenet(dir, common + " --devices cpu:0,cpu:1 --lr-schedule cosine --parallel " + path);
      INFO(r.output);
      CHECK(r.code == 0);
      CHECK(r.output.find("(cosine)") != std::string::npos);
    }
  }
}

TEST_CASE("resnet trains a step on tiny data, on one and two virtual CPU devices", "[examples]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string common = "--data " + dir.path().string() +
                             " --epochs 1 --batch-size 8 --train-limit 16 --test-limit 8 --no-progress";
  for (const char* devices : {"--device cpu", "--devices cpu:0,cpu:1"}) {
    Result r = run_program(TANDEM_RESNET_PATH, dir, common + " " + devices);
    INFO(devices << " -> " << r.output);
    CHECK(r.code == 0);
    CHECK(r.output.find("epoch   1") != std::string::npos);
  }
  Result bad = run_program(TANDEM_RESNET_PATH, dir, common + " --lr -1");
  CHECK(bad.code == 2);
}

TEST_CASE("lenet rejects bad input with a one-line error and a non-zero exit", "[examples]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string data = "--data " + dir.path().string() + " --no-progress --epochs 1";

  // Bad flags: exit code 2, the message names the flag.
  for (const char* bad : {"--epochs x", "--batch-size 0", "--activation tanh", "--devices cpu:0,cpu:0",
                          "--device tpu", "--no-such-flag 1", "--optimizer rmsprop",
                          "--lr-schedule step"}) {
    Result r = run_lenet(dir, data + " " + bad);
    INFO(bad << " -> " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("lenet: ") == 0);
  }
  // Missing data: exit code 1, the message names the file.
  Result missing = run_lenet(dir, "--data " + dir.file("nowhere") + " --device cpu");
  CHECK(missing.code == 1);
  CHECK(missing.output.find("nowhere") != std::string::npos);
  // A corrupt file: exit code 1, the message names it.
  {
    std::ofstream f(dir.file("t10k-labels-idx1-ubyte.gz"), std::ios::binary | std::ios::trunc);
    f << "this is not gzip";
  }
  Result corrupt = run_lenet(dir, data + " --device cpu");
  CHECK(corrupt.code == 1);
  CHECK(corrupt.output.find("t10k-labels-idx1-ubyte.gz") != std::string::npos);
  // A CSV that cannot be written fails before training, leaving nothing behind.
  Result csv = run_lenet(dir, data + " --device cpu --csv " + dir.file("no/such/dir/run.csv"));
  CHECK(csv.code == 1);
  CHECK(csv.output.find("run.csv") != std::string::npos);
  // A GPU that does not exist.
  Result gpu = run_lenet(dir, data + " --device cuda:7");
  CHECK(gpu.code == 1);
  CHECK(gpu.output.find("cuda:7") != std::string::npos);
}
#endif
