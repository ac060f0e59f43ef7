// lenet and resnet with --zero 1|2|3 under tandem-run (Gloo ranks on the tiny dataset): the
// numbers and the final weights and optimizer state of DDP; the memory line, whose figures fall
// with the world size as ZeRO's formulas say; checkpoints of sharded state that resume across
// world sizes and stages (2 ranks --zero 2 -> 3 ranks --zero 1 or 3 -> one process without
// --zero) as the uninterrupted run, and a checkpoint that does not fit ends the job naming the
// tensor; and the bad flag combinations, each one line and exit 2.
#if defined(TANDEM_LENET_PATH) && defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "catch.h"
#include "data/data_test_util.h"
#include "examples/program_runs.h"
#include "examples/tiny_dataset.h"
#include "nn/serialize.h"

namespace {

namespace fs = std::filesystem;
using tandem::test::epoch_lines;
using tandem::test::ProgramResult;
using tandem::test::run_launched;
using tandem::test::run_program;
using tandem::test::TempDir;

// 48 images, a global batch of 12: 4 steps an epoch, the same global batches on 1, 2 and 3 ranks
// (no padding, no uneven shard).
std::string tiny_flags(const TempDir& dir) {
  return "--data " + dir.path().string() +
         " --device cpu --no-progress --train-limit 48 --test-limit 16 "
         "--batch-size 12 --optimizer adam";
}

// The largest |a - b| over the largest |a| of one tensor (0 when both are zero).
double relative_error(const tandem::Tensor& a, const tandem::Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double err = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err = std::max(err, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(x[i]));
  }
  return scale > 0 ? err / scale : err;
}

// Every tensor of the two checkpoint files (model, optimizer, generators, extra): the same names
// and shapes, floating values within `tol` (relative_error; 0: the same bits) -- the optimizer's
// state within 10 tol: Adam's exp_avg_sq squares the gradients, and so doubles their rounding
// differences (as tests/distributed/test_zero.cpp allows 1e-5 for the state) -- the others
// equal. Returns the largest errors of the model and of the optimizer, and their tensors.
std::string require_close_checkpoints(const std::string& a, const std::string& b, double tol) {
  const tandem::nn::SafetensorsFile x = tandem::nn::read_safetensors(a),
                                    y = tandem::nn::read_safetensors(b);
  std::vector<std::string> kx = x.tensors.keys(), ky = y.tensors.keys();
  std::sort(kx.begin(), kx.end());
  std::sort(ky.begin(), ky.end());
  REQUIRE(kx == ky);
  REQUIRE(x.tensors.size() > 10);
  double worst[2] = {0, 0};  // model (and extra), optimizer
  std::string where[2] = {"-", "-"};
  for (const auto& [name, t] : x.tensors) {
    INFO("tensor " << name << " of " << a << " and " << b);
    const tandem::Tensor& u = y.tensors.at(name);
    REQUIRE(t.shape() == u.shape());
    REQUIRE(t.dtype() == u.dtype());
    if (tol == 0 || !tandem::is_floating(t.dtype())) {
      REQUIRE(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()) == 0);
      continue;
    }
    const int k = name.rfind("optimizer.", 0) == 0 ? 1 : 0;
    const double e = relative_error(t, u);
    if (e > worst[k]) {
      worst[k] = e;
      where[k] = name;
    }
    REQUIRE(e <= (k == 1 ? 10 * tol : tol));
  }
  CHECK(x.metadata.at("step") == y.metadata.at("step"));
  char buf[64];
  std::snprintf(buf, sizeof buf, "model %.2g (", worst[0]);
  std::string out = buf + where[0];
  std::snprintf(buf, sizeof buf, "), optimizer %.2g (", worst[1]);
  return out + buf + where[1] + ")";
}

std::string ckpt(const fs::path& dir, int step) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%012d.safetensors", step);
  return (dir / name).string();
}

// A folder holding only the checkpoint of `step` from `from` (what a run cut there leaves).
fs::path cut_at(const TempDir& dir, const std::string& name, const fs::path& from, int step) {
  const fs::path to = dir.path() / name;
  fs::create_directories(to);
  fs::copy_file(ckpt(from, step), ckpt(to, step));
  return to;
}

// The memory line of an output (Note [the memory line] in examples/common/zero_stepper.cpp).
struct MemoryLine {
  int rank = -1, world = 0, stage = 0;
  long long params, shard, grads, state, total, ddp_params, ddp_grads, ddp_state, ddp_total;
};

MemoryLine memory_line(const std::string& out) {
  MemoryLine m;
  const size_t at = out.find("memory of rank ");
  REQUIRE(at != std::string::npos);
  REQUIRE(out.find("memory of rank ", at + 1) == std::string::npos);  // one line per run
  const size_t bytes = out.find("bytes: ", at);
  REQUIRE(std::sscanf(out.c_str() + at, "memory of rank %d of %d (ZeRO-%d", &m.rank, &m.world,
                      &m.stage) == 3);
  REQUIRE(std::sscanf(out.c_str() + bytes,
                      "bytes: params %lld + shard %lld, grads %lld, optimizer state %lld, total "
                      "%lld; DDP: params "
                      "%lld, grads %lld, optimizer state %lld, total %lld",
                      &m.params, &m.shard, &m.grads, &m.state, &m.total, &m.ddp_params,
                      &m.ddp_grads, &m.ddp_state, &m.ddp_total) == 9);
  return m;
}

}  // namespace

TEST_CASE(
    "lenet --zero 1|2|3 on 2 processes prints DDP's numbers and ends with DDP's weights and "
    "optimizer state",
    "[examples][dist][zero]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string common = tiny_flags(dir) + " --epochs 2";
  const fs::path ddp_dir = dir.path() / "ddp";
  ProgramResult ddp =
      run_launched(dir, 2, TANDEM_LENET_PATH, common + " --checkpoint " + ddp_dir.string());
  INFO(ddp.output);
  REQUIRE(ddp.code == 0);
  CHECK(ddp.output.find("memory of rank") == std::string::npos);  // DDP prints no memory line
  const auto want = epoch_lines(ddp.output);
  REQUIRE(want.size() == 2);
  for (int stage : {1, 2, 3}) {
    const fs::path zdir = dir.path() / ("zero" + std::to_string(stage));
    ProgramResult z = run_launched(
        dir, 2, TANDEM_LENET_PATH,
        common + " --zero " + std::to_string(stage) + " --checkpoint " + zdir.string());
    INFO("--zero " << stage << "\n" << z.output);
    REQUIRE(z.code == 0);
    CHECK(z.output.find(stage == 3 ? "[ZeRO-3: FSDP]" : "[ZeRO-" + std::to_string(stage) + "]") !=
          std::string::npos);
    const auto got = epoch_lines(z.output);
    REQUIRE(got.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      CHECK(got[e].loss == want[e].loss);  // printed to 4 decimals
      CHECK(got[e].train_acc == want[e].train_acc);
      CHECK(got[e].test_acc ==
            want[e].test_acc);  // FSDP's evaluation gathers each unit for its forward
    }
    // The checkpoints are DDP's file: the same names, in the plain optimizer's layout, values to
    // 1e-6 (the same reductions in another order at most).
    WARN("--zero " << stage << " vs DDP after 8 steps: "
                   << require_close_checkpoints(ckpt(ddp_dir, 8), ckpt(zdir, 8), 1e-6));
  }
}

TEST_CASE("resnet --zero 1|2|3 on 2 processes: BatchNorm, and DDP's numbers",
          "[examples][dist][zero]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string common = "--data " + dir.path().string() +
                             " --device cpu --no-progress --epochs 1 "
                             "--batch-size 8 --train-limit 16 --test-limit 8 --optimizer adam";
  const fs::path ddp_dir = dir.path() / "ddp";
  ProgramResult ddp =
      run_launched(dir, 2, TANDEM_RESNET_PATH, common + " --checkpoint " + ddp_dir.string());
  INFO(ddp.output);
  REQUIRE(ddp.code == 0);
  const auto want = epoch_lines(ddp.output);
  REQUIRE(want.size() == 1);
  for (int stage : {1, 2, 3}) {
    const fs::path zdir = dir.path() / ("zero" + std::to_string(stage));
    ProgramResult z = run_launched(
        dir, 2, TANDEM_RESNET_PATH,
        common + " --zero " + std::to_string(stage) + " --checkpoint " + zdir.string());
    INFO("--zero " << stage << "\n" << z.output);
    REQUIRE(z.code == 0);
    const auto got = epoch_lines(z.output);
    REQUIRE(got.size() == 1);
    CHECK(got[0].loss == want[0].loss);
    CHECK(got[0].test_acc == want[0].test_acc);
    // Rank 0's BatchNorm statistics included (stage 2 and FSDP broadcast no buffers in forward;
    // rank 0's are its own either way).
    require_close_checkpoints(ckpt(ddp_dir, 2), ckpt(zdir, 2), 1e-6);
  }
}

TEST_CASE("the --zero memory line: bytes per rank fall with the world size as ZeRO's formulas say",
          "[examples][dist][zero]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string common = tiny_flags(dir) + " --epochs 1";
  // LeNet: Ψ = 61706 float32 parameters in 10 tensors; Adam: two moments and a step count.
  const long long psi = 61706, full = 4 * psi, ddp_state = 8 * psi + 4 * 10;
  for (int stage : {1, 2, 3}) {
    for (int world : {1, 2, 3}) {
      ProgramResult r =
          run_launched(dir, world, TANDEM_LENET_PATH, common + " --zero " + std::to_string(stage));
      INFO("--zero " << stage << " on " << world << "\n" << r.output);
      REQUIRE(r.code == 0);
      const MemoryLine m = memory_line(r.output);
      CHECK(m.rank == 0);
      CHECK(m.world == world);
      CHECK(m.stage == stage);
      // DDP's figures do not depend on the world size.
      CHECK(m.ddp_params == full);
      CHECK(m.ddp_grads == full);
      CHECK(m.ddp_state == ddp_state);
      CHECK(m.ddp_total == 2 * full + ddp_state);
      // The shard: 4 ceil(n_g / N) bytes per group (a bucket or a unit), padding under 4 bytes a
      // group; at most 5 groups (LeNet's layers).
      CHECK(m.shard >= full / world);
      CHECK(m.shard <= full / world + 4 * 5);
      // The optimizer state of the shard: two moments (8 bytes an element) and a step per group.
      CHECK(m.state >= 2 * m.shard);
      CHECK(m.state <= 2 * m.shard + 4 * 5);
      // The stages: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too (at
      // rest: the module's parameters hold no bytes between steps).
      CHECK(m.params == (stage == 3 ? 0 : full));
      CHECK(m.grads == (stage == 1 ? full : m.shard));
      CHECK(m.total == m.params + m.shard + m.grads + m.state);
      if (world == 1) CHECK(m.shard == full);
    }
  }
  // DDP itself prints none.
  ProgramResult ddp = run_launched(dir, 2, TANDEM_LENET_PATH, common);
  CHECK(ddp.output.find("memory of rank") == std::string::npos);
}

TEST_CASE("a --zero checkpoint resumes at any world size and stage as the uninterrupted run",
          "[examples][dist][zero][checkpoint]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string common = tiny_flags(dir) + " --epochs 2 --checkpoint-every 2";
  auto flags = [&](const fs::path& ckpts, const std::string& more) {
    return common + " --checkpoint " + ckpts.string() + " " + more;
  };
  // The whole run: 2 ranks, ZeRO-2, checkpoints at steps 2, 4, 6, 8.
  const fs::path whole = dir.path() / "whole";
  ProgramResult a = run_launched(dir, 2, TANDEM_LENET_PATH, flags(whole, "--zero 2"));
  INFO(a.output);
  REQUIRE(a.code == 0);
  const std::string end = ckpt(whole, 8);
  REQUIRE(fs::exists(end));
  // One file per checkpoint, rank 0's, nothing per rank.
  CHECK(std::distance(fs::directory_iterator(whole), fs::directory_iterator{}) == 4);

  // The same layout, cut at step 4: the same bits.
  const fs::path same = cut_at(dir, "same", whole, 4);
  ProgramResult b = run_launched(dir, 2, TANDEM_LENET_PATH, flags(same, "--zero 2 --resume"));
  INFO(b.output);
  REQUIRE(b.code == 0);
  CHECK(b.output.find("resuming from") != std::string::npos);
  require_close_checkpoints(end, ckpt(same, 8), 0);

  // 3 ranks, ZeRO-1 from step 2 ...
  const fs::path three = cut_at(dir, "three", whole, 2);
  ProgramResult c = run_launched(dir, 3, TANDEM_LENET_PATH, flags(three, "--zero 1 --resume"));
  INFO(c.output);
  REQUIRE(c.code == 0);
  CHECK(c.output.find("on 3 processes (gloo, cpu) [ZeRO-1]") != std::string::npos);
  WARN("2 ranks ZeRO-2 -> 3 ranks ZeRO-1 at step 2: " << require_close_checkpoints(
           end, ckpt(three, 8), 1e-6));
  // ... and from its step 6, one process without --zero: the plain optimizer reads the file.
  const fs::path one = cut_at(dir, "one", three, 6);
  ProgramResult d = run_program(TANDEM_LENET_PATH, dir, flags(one, "--resume"));
  INFO(d.output);
  REQUIRE(d.code == 0);
  CHECK(d.output.find("resuming from") != std::string::npos);
  WARN("-> one process at step 6: " << require_close_checkpoints(end, ckpt(one, 8), 1e-6));

  // 3 ranks, FSDP, from the ZeRO-2 checkpoint of step 4.
  const fs::path fsdp = cut_at(dir, "fsdp", whole, 4);
  ProgramResult e = run_launched(dir, 3, TANDEM_LENET_PATH, flags(fsdp, "--zero 3 --resume"));
  INFO(e.output);
  REQUIRE(e.code == 0);
  WARN("-> 3 ranks FSDP at step 4: " << require_close_checkpoints(end, ckpt(fsdp, 8), 1e-6));
  // FSDP's own checkpoint of step 6 resumes in FSDP on 2 ranks.
  const fs::path fsdp2 = cut_at(dir, "fsdp2", fsdp, 6);
  ProgramResult f = run_launched(dir, 2, TANDEM_LENET_PATH, flags(fsdp2, "--zero 3 --resume"));
  INFO(f.output);
  REQUIRE(f.code == 0);
  require_close_checkpoints(end, ckpt(fsdp2, 8), 1e-6);
}

TEST_CASE("The --zero flag's bad combinations are one line and exit 2", "[examples][dist][zero]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string data =
      "--data " + dir.path().string() + " --no-progress --epochs 1 --batch-size 16 --device cpu";
  const std::string launched =
      std::string("RANK=0 WORLD_SIZE=2 ") + TANDEM_LENET_PATH;  // a launcher's variables
  struct Case {
    std::string command, flags, says;
  };
  const std::vector<Case> cases = {
      {TANDEM_LENET_PATH, "--zero 1", "run under a launcher"},
      {TANDEM_LENET_PATH, "--zero 2 --devices cpu:0,cpu:1", "--devices is for one process"},
      {launched, "--zero 0", "is not a stage"},
      {launched, "--zero 4", "is not a stage"},
      {launched, "--zero two", "is not a stage"},
      {launched, "--zero 1 --parallel pipeline", "--parallel pipeline splits"},
      {launched, "--zero 3 --parallel tensor", "--parallel tensor splits"},
      {launched, "--zero 2 --devices cpu:0,cpu:1", "--devices is for one process"},
  };
  for (const Case& c : cases) {
    ProgramResult r = run_program(c.command, dir, data + " " + c.flags);
    INFO(c.flags << " -> " << r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("lenet: --") == 0);
    CHECK(r.output.find(c.says) != std::string::npos);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
}
TEST_CASE(
    "resuming --zero from another model's or optimizer's checkpoint names the tensor on every rank "
    "and ends the job",
    "[examples][dist][zero][checkpoint]") {
  TempDir dir;
  tandem::test::write_tiny_dataset(dir.path());
  const std::string common = tiny_flags(dir) + " --epochs 1";
  const fs::path sgd = dir.path() / "sgd";
  // A checkpoint of SGD with momentum (its state: momentum_buffer), and one of ResNet-18.
  std::string flags = common;
  flags.replace(flags.find("--optimizer adam"), 16, "--momentum 0.9");
  REQUIRE(run_launched(dir, 2, TANDEM_LENET_PATH, flags + " --checkpoint " + sgd.string()).code ==
          0);
  const fs::path resnet = dir.path() / "resnet";
  REQUIRE(
      run_launched(dir, 2, TANDEM_RESNET_PATH, common + " --checkpoint " + resnet.string()).code ==
      0);
  for (int stage : {1, 2, 3}) {
    const std::string zero = " --zero " + std::to_string(stage) + " --resume ";
    ProgramResult model = run_launched(dir, 2, TANDEM_LENET_PATH, common + zero + ckpt(resnet, 4));
    INFO("--zero " << stage << " from ResNet-18\n" << model.output);
    CHECK(model.code != 0);
    CHECK(model.output.find("lenet: error: " + ckpt(resnet, 4) + ": tensor 'model.0.weight'") !=
          std::string::npos);
    ProgramResult optim = run_launched(dir, 2, TANDEM_LENET_PATH, common + zero + ckpt(sgd, 4));
    INFO("--zero " << stage << " (Adam) from SGD\n" << optim.output);
    CHECK(optim.code != 0);
    CHECK(optim.output.find("the optimizer.* tensors: ") != std::string::npos);
    CHECK(optim.output.find("'momentum_buffer' is not a state of this optimizer") !=
          std::string::npos);
  }
}
#endif
