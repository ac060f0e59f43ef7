// lenet and resnet with --parallel pipeline on tiny Fashion-MNIST-shaped data (tiny_dataset.h):
// the stages on virtual CPU devices of one process, and one stage per process under tandem-run
// (Gloo), print the numbers of the program on one device (loss to 1e-4), whatever --balance
// cuts the layers (by parameter count, by measured time, or as listed), and so does
// --parallel tensor on virtual CPU devices and with one shard per process under tandem-run; the
// bad combinations of flags are one line and exit code 2.
#ifdef TANDEM_LENET_PATH
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "catch.h"
#include "data/data_test_util.h"
#include "examples/program_runs.h"
#include "examples/tiny_dataset.h"

namespace {

using tandem::test::TempDir;

using Result = tandem::test::ProgramResult;
using tandem::test::epoch_lines;
using tandem::test::run_program;

// The same epochs, the loss to 1e-4; the accuracies may differ by one image (64 training and
// 32 test images), where a logit rounded otherwise tips an argmax.
void check_same_numbers(const std::string& one, const std::string& other, size_t epochs) {
  const auto a = epoch_lines(one), b = epoch_lines(other);
  REQUIRE(a.size() == epochs);
  REQUIRE(b.size() == epochs);
  for (size_t e = 0; e < epochs; ++e) {
    CHECK(b[e].epoch == a[e].epoch);
    CHECK(std::abs(b[e].loss - a[e].loss) <= 1e-4 * std::max(1.0, std::abs(a[e].loss)));
    CHECK(std::abs(b[e].train_acc - a[e].train_acc) <= 1.0 / 64 + 1e-9);
    CHECK(std::abs(b[e].test_acc - a[e].test_acc) <= 1.0 / 32 + 1e-9);
  }
}

std::string tiny_flags(const TempDir& dir) {
  tandem::test::write_tiny_dataset(dir.path());
  // ReLU with momentum learns the tiny data within two epochs, so the numbers move.
  return "--data " + dir.path().string() + " --epochs 2 --no-progress --activation relu --momentum 0.9 --lr 0.05";
}

}  // namespace

TEST_CASE("lenet --parallel pipeline on virtual CPU devices prints the one-device numbers", "[examples][pipeline]") {
  TempDir dir;
  const std::string common = tiny_flags(dir);
  // batch 30: 64 images are batches of 30, 30 and 4, so M = 8 meets a batch with fewer rows.
  for (const char* batch : {" --batch-size 16", " --batch-size 30"}) {
    Result one = run_program(std::string(TANDEM_LENET_PATH) + " " + common + batch + " --device cpu", dir);
    REQUIRE(one.code == 0);
    // The flags, and what the header line says of the layout (the balance only where --balance
    // chose it; the measured one differs from machine to machine).
    const std::vector<std::pair<const char*, const char*>> runs = {
        {" --devices cpu:0,cpu:1 --micro-batches 4 --schedule 1f1b", "[pipeline 1f1b, 4 micro-batches]"},
        {" --devices cpu:0,cpu:1,cpu:2 --micro-batches 3 --schedule gpipe", "[pipeline gpipe, 3 micro-batches]"},
        {" --devices cpu:0,cpu:1 --micro-batches 8", "[pipeline 1f1b, 8 micro-batches]"},
        {" --devices cpu:0,cpu:1 --micro-batches 4 --balance time", "[pipeline 1f1b, 4 micro-batches, balance ["},
        {" --devices cpu:0,cpu:1 --micro-batches 2 --balance parameters",
         "[pipeline 1f1b, 2 micro-batches, balance [8, 4] by parameter count]"},
        {" --devices cpu:0,cpu:1,cpu:2 --micro-batches 2 --balance 2,3,7",
         "[pipeline 1f1b, 2 micro-batches, balance [2, 3, 7]]"},
    };
    for (const auto& [flags, header] : runs) {
      Result pipe = run_program(std::string(TANDEM_LENET_PATH) + " " + common + batch + " --parallel pipeline" + flags,
                                dir);
      INFO(batch << flags << "\n" << one.output << "\n---\n" << pipe.output);
      REQUIRE(pipe.code == 0);
      CHECK(pipe.output.find(header) != std::string::npos);
      if (std::string(flags).find("time") != std::string::npos) CHECK(pipe.output.find("] by time]") != std::string::npos);
      check_same_numbers(one.output, pipe.output, 2);
    }
  }
}

TEST_CASE("lenet --parallel tensor on 2 and 4 virtual CPU devices prints the one-device numbers",
          "[examples][tensor-parallel]") {
  TempDir dir;
  const std::string common = tiny_flags(dir) + " --batch-size 16";
  for (const char* opt : {"", " --optimizer adam"}) {
    Result one = run_program(std::string(TANDEM_LENET_PATH) + " " + common + opt + " --device cpu", dir);
    REQUIRE(one.code == 0);
    for (const char* devices : {"cpu:0,cpu:1", "cpu:0,cpu:1,cpu:2,cpu:3"}) {
      Result tp = run_program(std::string(TANDEM_LENET_PATH) + " " + common + opt + " --parallel tensor --devices " +
                                  devices,
                              dir);
      INFO(opt << " " << devices << "\n" << one.output << "\n---\n" << tp.output);
      REQUIRE(tp.code == 0);
      CHECK(tp.output.find("[tensor]") != std::string::npos);
      check_same_numbers(one.output, tp.output, 2);
    }
  }
}

TEST_CASE("resnet --parallel pipeline trains a step on two virtual CPU devices", "[examples][pipeline]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  Result r = run_program(std::string(TANDEM_RESNET_PATH) + " --data " + dir.path().string() +
                             " --epochs 1 --batch-size 32 --train-limit 32 --test-limit 32 --no-progress"
                             " --parallel pipeline --devices cpu:0,cpu:1 --micro-batches 2",
                         dir);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(epoch_lines(r.output).size() == 1);
}

#if defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
TEST_CASE("lenet --parallel pipeline under tandem-run, a stage per process, prints the one-device numbers",
          "[examples][pipeline][dist]") {
  TempDir dir;
  const std::string common = tiny_flags(dir) + " --batch-size 16";
  Result one = run_program(std::string(TANDEM_LENET_PATH) + " " + common + " --device cpu", dir);
  REQUIRE(one.code == 0);
  // --balance time: rank 0 measures, every rank cuts where it says (Note [one balance for every
  // rank]); ranks that cut differently would not finish.
  for (const char* flags : {" --micro-batches 4 --schedule 1f1b", " --micro-batches 3 --schedule gpipe",
                            " --micro-batches 4 --balance time"}) {
    Result job = run_program(std::string("TANDEM_DIST_TIMEOUT=20 ") + TANDEM_RUN_PATH +
                                 " --standalone --grace-seconds 1 --nproc-per-node 2 " + TANDEM_LENET_PATH + " " +
                                 common + " --device cpu --parallel pipeline" + flags + " --trace " +
                                 dir.file("trace.json"),
                             dir);
    INFO(flags << "\n" << one.output << "\n---\n" << job.output);
    REQUIRE(job.code == 0);
    CHECK(job.output.find("on 2 processes (gloo, cpu) [pipeline") != std::string::npos);
    if (std::string(flags).find("time") != std::string::npos)
      CHECK(job.output.find("a stage per process, balance [") != std::string::npos);
    CHECK(job.output.find("[rank 1]") == std::string::npos);  // rank 0 alone speaks
    check_same_numbers(one.output, job.output, 2);
    // One lane per stage: both ranks' spans, F and B actions, in the merged timeline.
    std::ifstream f(dir.file("trace.json"));
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string trace = ss.str();
    CHECK(trace.find("stage 0 (rank 0)") != std::string::npos);
    CHECK(trace.find("stage 1 (rank 1)") != std::string::npos);
    CHECK(trace.find("\"F0\"") != std::string::npos);
    CHECK(trace.find("\"B0\"") != std::string::npos);
  }
  // More processes than layers: every rank says so, exit 2.
  Result many = run_program(std::string("TANDEM_DIST_TIMEOUT=20 ") + TANDEM_RUN_PATH +
                                " --standalone --grace-seconds 1 --nproc-per-node 13 " + TANDEM_LENET_PATH + " " +
                                common + " --device cpu --parallel pipeline",
                            dir);
  INFO(many.output);
  CHECK(many.code != 0);
  CHECK(many.output.find("lenet: --parallel pipeline: 13 processes for 12 layers; every stage needs at least one "
                         "layer") != std::string::npos);
  // A balance for another number of stages: the same, before any rank waits for another.
  Result wrong = run_program(std::string("TANDEM_DIST_TIMEOUT=20 ") + TANDEM_RUN_PATH +
                                 " --standalone --grace-seconds 1 --nproc-per-node 2 " + TANDEM_LENET_PATH + " " +
                                 common + " --device cpu --parallel pipeline --balance 3,3,6",
                             dir);
  INFO(wrong.output);
  CHECK(wrong.code != 0);
  CHECK(wrong.output.find("lenet: --balance 3,3,6 has 3 stages but there are 2 processes") != std::string::npos);
}

TEST_CASE("lenet --parallel tensor under tandem-run, a shard per process, prints the one-device numbers",
          "[examples][tensor-parallel][dist]") {
  TempDir dir;
  const std::string common = tiny_flags(dir) + " --batch-size 16";
  auto job = [&](int n, const std::string& flags) {
    return run_program(std::string("TANDEM_DIST_TIMEOUT=20 ") + TANDEM_RUN_PATH +
                           " --standalone --grace-seconds 1 --nproc-per-node " + std::to_string(n) + " " + flags,
                       dir);
  };
  for (const char* opt : {"", " --optimizer adam"}) {
    Result one = run_program(std::string(TANDEM_LENET_PATH) + " " + common + opt + " --device cpu", dir);
    REQUIRE(one.code == 0);
    for (int n : {2, 4}) {
      Result tp = job(n, std::string(TANDEM_LENET_PATH) + " " + common + opt + " --device cpu --parallel tensor");
      INFO(n << " processes" << opt << "\n" << one.output << "\n---\n" << tp.output);
      REQUIRE(tp.code == 0);
      CHECK(tp.output.find("on " + std::to_string(n) + " processes (gloo, cpu) [tensor, a shard per process]") !=
            std::string::npos);
      CHECK(tp.output.find("[rank 1]") == std::string::npos);  // rank 0 alone speaks
      check_same_numbers(one.output, tp.output, 2);
    }
  }
  // A model with no Linear -> activation -> Linear, and a flag for one process: one line, exit 2.
  Result resnet = job(2, std::string(TANDEM_RESNET_PATH) + " --data " + dir.path().string() +
                            " --epochs 1 --no-progress --device cpu --parallel tensor");
  INFO(resnet.output);
  CHECK(resnet.code != 0);
  CHECK(resnet.output.find("resnet: --parallel tensor: ResNet-18 has no Linear -> ReLU/Sigmoid -> Linear whose 2 "
                           "processes each get at least one feature of the middle") != std::string::npos);
  Result devices = job(2, std::string(TANDEM_LENET_PATH) + " " + common + " --parallel tensor --devices cpu:0,cpu:1");
  INFO(devices.output);
  CHECK(devices.code != 0);
  CHECK(devices.output.find("lenet: --devices is for one process; in a multi-process run each process takes one "
                            "device") != std::string::npos);
}
#endif

TEST_CASE("lenet and resnet reject bad pipeline flags with one line and exit code 2", "[examples][pipeline]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string data = " --data " + dir.path().string() + " --epochs 1 --no-progress";
  struct Case {
    const char* program;
    std::string flags, message;
  };
  const std::string thirteen = "cpu:0,cpu:1,cpu:2,cpu:3,cpu:4,cpu:5,cpu:6,cpu:7,cpu:8,cpu:9,cpu:10,cpu:11,cpu:12";
  const std::vector<Case> cases = {
      {TANDEM_LENET_PATH, "--parallel pipeline --devices " + thirteen,
       "lenet: --parallel pipeline: 13 devices for 12 layers; every stage needs at least one layer"},
      {TANDEM_RESNET_PATH, "--parallel pipeline --devices cpu:0,cpu:1,cpu:2,cpu:3,cpu:4,cpu:5,cpu:6,cpu:7,cpu:8",
       "resnet: --parallel pipeline: 9 devices for 8 layers; every stage needs at least one layer"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --micro-batches 0",
       "lenet: --micro-batches: 0 is out of range [1, 1048576]"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --micro-batches 17 --batch-size 16",
       "lenet: --micro-batches 17 is larger than --batch-size 16 (a micro-batch would be empty)"},
      {TANDEM_LENET_PATH, "--devices cpu:0,cpu:1 --schedule gpipe", "lenet: --schedule is for --parallel pipeline"},
      {TANDEM_LENET_PATH, "--devices cpu:0,cpu:1 --parallel dp --micro-batches 2",
       "lenet: --micro-batches is for --parallel pipeline"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --schedule zb",
       "lenet: --schedule: 'zb' is not one of gpipe|1f1b"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --precision bf16",
       "lenet: --precision bf16 is not supported with --parallel pipeline yet"},
      {TANDEM_RESNET_PATH, "--parallel tensor --devices cpu:0,cpu:1",
       "resnet: --parallel tensor: ResNet-18 has no Linear -> ReLU/Sigmoid -> Linear whose 2 devices each get at "
       "least one feature of the middle"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 7,0",
       "lenet: --balance 7,0: stage 1 gets 0 layers; every stage needs at least one"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance -1,13",
       "lenet: --balance -1,13: stage 0 gets -1 layers; every stage needs at least one"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 7,4",
       "lenet: --balance 7,4 adds up to 11 layers but LeNet (sigmoid) has 12"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 4,4,4",
       "lenet: --balance 4,4,4 has 3 stages but there are 2 devices"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance fast",
       "lenet: --balance: 'fast' is not parameters, time or a list of layer counts such as 7,5"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 7,x",
       "lenet: --balance: '7,x' is not parameters, time or a list of layer counts such as 7,5"},
      {TANDEM_LENET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 7,,5",
       "lenet: --balance: '7,,5' is not parameters, time or a list of layer counts such as 7,5"},
      {TANDEM_RESNET_PATH, "--parallel pipeline --devices cpu:0,cpu:1 --balance 4,5",
       "resnet: --balance 4,5 adds up to 9 layers but ResNet-18 has 8"},
      {TANDEM_LENET_PATH, "--devices cpu:0,cpu:1 --balance time", "lenet: --balance is for --parallel pipeline"},
      {TANDEM_LENET_PATH, "--parallel tensor --devices cpu:0,cpu:1 --micro-batches 2",
       "lenet: --micro-batches is for --parallel pipeline"},
      {TANDEM_LENET_PATH, "--parallel tensor --devices cpu:0,cpu:1 --trace t.json",
       "lenet: --trace is not supported with --parallel tensor yet"},
  };
  for (const Case& c : cases) {
    Result r = run_program(std::string(c.program) + data + " " + c.flags, dir);
    INFO(c.flags << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK(r.output == c.message + "\n");
  }
}

#endif
