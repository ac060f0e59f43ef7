// The lenet and resnet programs end to end on tiny Fashion-MNIST-shaped IDX files written here: it trains,
// writes its CSV, and fails with the documented exit codes and one-line messages; and, with the
// launcher and Gloo, one process per device: the job prints the one-process run's numbers.
#ifdef TANDEM_LENET_PATH
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "core/tensor.h"
#include "data/data_test_util.h"
#include "data/idx.h"
#include "examples/program_runs.h"
#include "examples/tiny_dataset.h"
#include "parallel/distributed/launch.h"

namespace {

using tandem::test::TempDir;

using Result = tandem::test::ProgramResult;
using tandem::test::run_program;

Result run_lenet(const TempDir& dir, const std::string& args) {
  return run_program(TANDEM_LENET_PATH, dir, args);
}

void write_tiny_dataset(const TempDir& dir) { tandem::test::write_tiny_dataset(dir.path()); }  // tiny_dataset.h

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
  SECTION("a last batch of 1 row on two devices runs on one of them") {
    // 33 images in batches of 16: the last batch has one row, fewer than the devices.
    for (const char* path : {"scratch", "dp"}) {
      Result r = run_lenet(dir, common + " --devices cpu:0,cpu:1 --train-limit 33 --parallel " + path);
      INFO(path << " -> " << r.output);
      CHECK(r.code == 0);
      CHECK(r.output.find("epoch   2") != std::string::npos);
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
  // Channels-last and bfloat16 autocast, on one device and on two (the from-scratch path).
  for (const char* devices : {"--device cpu", "--devices cpu:0,cpu:1 --parallel scratch"}) {
    Result r = run_program(TANDEM_RESNET_PATH, dir, common + " " + devices + " --channels-last --precision bf16");
    INFO(devices << " -> " << r.output);
    CHECK(r.code == 0);
    CHECK(r.output.find("bf16 autocast, channels-last") != std::string::npos);
    CHECK(r.output.find("epoch   1") != std::string::npos);
  }
  Result bad = run_program(TANDEM_RESNET_PATH, dir, common + " --lr -1");
  CHECK(bad.code == 2);
  Result fp16 = run_program(TANDEM_RESNET_PATH, dir, common + " --precision fp16");
  CHECK(fp16.code == 2);
  CHECK(fp16.output.find("fp16") != std::string::npos);
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
  // A virtual CPU device out of range is a bad flag that names the value.
  for (auto [bad, value] : {std::pair<std::string, std::string>{"--device cpu:99999", "'cpu:99999'"},
                             {"--devices cpu:0,cpu:64", "'cpu:64'"}}) {
    Result r = run_lenet(dir, data + " " + bad);
    INFO(bad << " -> " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find(value) != std::string::npos);
    CHECK(r.output.find("cpu:0 to cpu:63") != std::string::npos);
  }
  // A GPU that does not exist.
  Result gpu = run_lenet(dir, data + " --device cuda:7");
  CHECK(gpu.code == 1);
  CHECK(gpu.output.find("cuda:7") != std::string::npos);
  // The multi-process flags outside a multi-process run.
  for (const char* bad : {"--backend gloo", "--bucket-cap-mb 4", "--no-overlap"}) {
    Result r = run_lenet(dir, data + " --device cpu " + bad);
    INFO(bad << " -> " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("multi-process") != std::string::npos);
  }
}

TEST_CASE("lenet checks its --csv and --data paths before training", "[examples]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string data = "--data " + dir.path().string() + " --no-progress --epochs 1 --device cpu";
  // A CSV path that is a directory fails before training with the OS reason, leaving nothing.
  std::filesystem::create_directory(dir.file("csv-dir"));
  Result csv_dir = run_lenet(dir, data + " --csv " + dir.file("csv-dir"));
  INFO(csv_dir.output);
  CHECK(csv_dir.code == 1);
  CHECK(csv_dir.output.find("csv-dir': Is a directory") != std::string::npos);
  CHECK(csv_dir.output.find("epoch") == std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir.file("csv-dir.tmp")));
  CHECK(std::filesystem::is_empty(dir.file("csv-dir")));
  // A data file's path that is a directory is named as one.
  std::filesystem::remove(dir.file("train-images-idx3-ubyte.gz"));
  std::filesystem::create_directory(dir.file("train-images-idx3-ubyte.gz"));
  Result r = run_lenet(dir, data);
  INFO(r.output);
  CHECK(r.code == 1);
  CHECK(r.output.find("'" + dir.file("train-images-idx3-ubyte.gz") + "' is a directory") != std::string::npos);
}

TEST_CASE("lenet --help says the batch is global", "[examples]") {
  TempDir dir;
  Result r = run_lenet(dir, "--help");
  CHECK(r.code == 0);
  CHECK(r.output.find("global minibatch size, split across devices or processes") != std::string::npos);
  CHECK(r.output.find("--distributed") != std::string::npos);
}

// ---- one process per device -------------------------------------------------------------------

#if defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
namespace {

using tandem::test::EpochLine;
using tandem::test::epoch_lines;
using tandem::test::kDistEnv;
using tandem::test::run_launched;

// The rows of a CSV written by --csv, as numbers, without the header.
std::vector<std::vector<double>> csv_rows(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::vector<double>> rows;
  std::string line;
  std::getline(f, line);
  while (std::getline(f, line)) {
    std::vector<double> row;
    std::istringstream is(line);
    for (std::string cell; std::getline(is, cell, ',');) row.push_back(std::stod(cell));
    rows.push_back(row);
  }
  return rows;
}

}  // namespace

TEST_CASE("lenet on 2 processes under tandem-run prints the one-process run's numbers", "[examples][dist]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string common = "--data " + dir.path().string() + " --device cpu --epochs 2 --batch-size 16 --no-progress";
  // d2l's LeNet, and ReLU with momentum, which learns the tiny data within two epochs.
  for (const char* model : {"", " --activation relu --momentum 0.9"}) {
    Result one = run_lenet(dir, common + model + " --csv " + dir.file("one.csv"));
    Result two = run_launched(dir, 2, TANDEM_LENET_PATH, common + model + " --csv " + dir.file("two.csv"));
    INFO(one.output << "\n---\n" << two.output);
    REQUIRE(one.code == 0);
    REQUIRE(two.code == 0);
    CHECK(two.output.find("[rank 0] LeNet (") == 0);
    CHECK(two.output.find(") on 2 processes (gloo, cpu), batch 16 (global)") != std::string::npos);
    CHECK(two.output.find("[rank 1]") == std::string::npos);  // rank 0 alone speaks

    const std::vector<EpochLine> a = epoch_lines(one.output), b = epoch_lines(two.output);
    REQUIRE(a.size() == 2);
    REQUIRE(b.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      CHECK(b[e].prefix == "[rank 0] ");
      CHECK(b[e].epoch == a[e].epoch);
      CHECK(std::abs(b[e].loss - a[e].loss) <= 1e-4 * std::max(1.0, std::abs(a[e].loss)));
      CHECK(b[e].train_acc == a[e].train_acc);
      CHECK(b[e].test_acc == a[e].test_acc);
    }
    // One CSV, rank 0's, with the header and a row per epoch: the same numbers to 1e-4.
    CHECK(count_lines(dir.file("two.csv")) == 3);
    const auto ra = csv_rows(dir.file("one.csv")), rb = csv_rows(dir.file("two.csv"));
    REQUIRE(ra.size() == 2);
    REQUIRE(rb.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      CHECK(std::abs(rb[e][1] - ra[e][1]) <= 1e-4 * std::abs(ra[e][1]));  // loss
      CHECK(rb[e][2] == ra[e][2]);                                        // train acc
      CHECK(rb[e][3] == ra[e][3]);                                        // test acc
    }
  }
}

TEST_CASE("lenet and resnet train on 3 processes with an uneven last shard", "[examples][dist]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string data = "--data " + dir.path().string() + " --device cpu --no-progress";
  // 64 images padded to 66, batch 16: the last global batch has 2 rows, so one rank has none.
  Result lenet = run_launched(dir, 3, TANDEM_LENET_PATH, data + " --epochs 2 --batch-size 16 --bucket-cap-mb 0.05");
  INFO(lenet.output);
  CHECK(lenet.code == 0);
  CHECK(epoch_lines(lenet.output).size() == 2);
  // The same with BatchNorm (ResNet-18): 16 images padded to 18, batch 8.
  Result resnet = run_launched(dir, 3, TANDEM_RESNET_PATH,
                               data + " --epochs 1 --batch-size 8 --train-limit 16 --test-limit 8 --no-overlap");
  INFO(resnet.output);
  CHECK(resnet.code == 0);
  CHECK(epoch_lines(resnet.output).size() == 1);
}

TEST_CASE("lenet in a multi-process run: --distributed alone, and the flags it rejects", "[examples][dist]") {
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string data = "--data " + dir.path().string() + " --no-progress --epochs 1 --batch-size 16";
  // No launcher, --distributed: a job of one process.
  const std::string port = "MASTER_PORT=" + std::to_string(tandem::parallel::distributed::free_port()) + " ";
  Result alone = run_program((kDistEnv + port + TANDEM_LENET_PATH).c_str(), dir, data + " --device cpu --distributed");
  INFO(alone.output);
  CHECK(alone.code == 0);
  CHECK(alone.output.find("on 1 process (gloo, cpu)") != std::string::npos);
  // Under a launcher (its variables in the environment), the in-process device flags are bad flags.
  for (const char* bad : {"--devices cpu:0,cpu:1", "--parallel dp", "--comm ring", "--device cuda:1",
                          "--device cpu --backend nccl", "--backend mpi"}) {
    Result r = run_program(("RANK=0 WORLD_SIZE=2 " + std::string(TANDEM_LENET_PATH)).c_str(), dir, data + " " + bad);
    INFO(bad << " -> " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("lenet: ") == 0);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
  Result launched = run_launched(dir, 2, TANDEM_LENET_PATH, data + " --devices cpu:0,cpu:1");
  CHECK(launched.code != 0);
  CHECK(launched.output.find("exited with code 2") != std::string::npos);
}

TEST_CASE("ddp_tutorial starts its own 2 workers and trains", "[examples][dist]") {
  // The program sits beside lenet.
#ifdef TANDEM_DDP_TUTORIAL_PATH
  const std::string program = TANDEM_DDP_TUTORIAL_PATH;
#else
  const std::string program = (std::filesystem::path(TANDEM_LENET_PATH).parent_path() / "ddp_tutorial").string();
#endif
  if (!std::filesystem::exists(program)) {
    WARN("ddp_tutorial is not built: " << program);
    return;
  }
  TempDir dir;
  write_tiny_dataset(dir);
  const std::string args = "--nprocs 2 --device cpu --epochs 1 --train-limit 64 --batch-size 16 --data " + dir.path().string();
  Result r = run_program((kDistEnv + program).c_str(), dir, args);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("[rank 0] epoch 1  loss ") != std::string::npos);
  CHECK(r.output.find("finished running basic DDP example on rank 1") != std::string::npos);
}
#endif
#endif
