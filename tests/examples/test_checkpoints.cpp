// Training checkpoints end to end with real processes: a run SIGKILLed at a random step and
// resumed with --resume ends with the very tensors of an uninterrupted run (one CPU device,
// two virtual CPU devices on both parallel paths, and two processes over Gloo); SIGTERM stops
// a run with exit 143 and a checkpoint that resumes; a checkpoint of another model names the
// tensor; bad checkpoint flags fail before training with one line.
#ifdef TANDEM_LENET_PATH
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "core/tensor.h"
#include "data/data_test_util.h"
#include "data/idx.h"
#include "helpers.h"
#include "nn/serialize_checkpoint.h"
#include "examples/tiny_dataset.h"

namespace {

namespace fs = std::filesystem;
using tandem::test::TempDir;

using tandem::test::write_tiny_dataset;  // tiny_dataset.h

std::vector<std::string> split(const std::string& s) {
  std::istringstream is(s);
  std::vector<std::string> out;
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

// A program started with fork + exec, its stdout and stderr going to `log`.
pid_t spawn(const std::string& program, const std::string& args, const std::string& log) {
  std::vector<std::string> words = split(args);
  words.insert(words.begin(), program);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    ::execv(program.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// The exit code, or 128 + the signal that ended it.
int wait_code(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int run(const std::string& program, const std::string& args, const std::string& log) {
  return wait_code(spawn(program, args, log));
}

// (step, path) of the checkpoints in dir, oldest first (names sort by step).
std::vector<std::pair<int64_t, std::string>> checkpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ckpt-", 0) == 0 && name.size() == 29) out.emplace_back(std::stoll(name.substr(5, 12)), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Every tensor of the two checkpoints, bit for bit (model, optimizer, generators, extra).
void require_same_tensors(const std::string& a, const std::string& b) {
  const tandem::nn::SafetensorsFile x = tandem::nn::read_safetensors(a), y = tandem::nn::read_safetensors(b);
  REQUIRE(x.tensors.keys() == y.tensors.keys());
  REQUIRE(x.tensors.size() > 10);
  for (const auto& [name, t] : x.tensors) {
    INFO("tensor " << name);
    const tandem::Tensor& u = y.tensors.at(name);
    REQUIRE(t.shape() == u.shape());
    REQUIRE(t.nbytes() == u.nbytes());
    REQUIRE(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()) == 0);
  }
  CHECK(x.metadata.at("step") == y.metadata.at("step"));
}

}  // namespace

TEST_CASE("a SIGKILLed run resumed with --resume ends bit for bit as the uninterrupted run", "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  // 3 epochs of 8 steps; a checkpoint after every step, so a kill can land anywhere, even
  // while one is being written.
  const int64_t total = 24;
  const std::string common = "--data " + dir.path().string() +
                             " --epochs 3 --batch-size 8 --test-limit 16 --no-progress --momentum 0.9 "
                             "--activation relu --checkpoint-every 1";
  std::mt19937 rng(std::random_device{}());
  for (const char* where : {"--device cpu", "--devices cpu:0,cpu:1", "--devices cpu:0,cpu:1 --parallel dp"}) {
    const int64_t kill_after = std::uniform_int_distribution<int64_t>(2, total - 3)(rng);
    INFO(where << ", killed once a checkpoint of step >= " << kill_after << " exists");
    const fs::path whole = dir.path() / "whole", cut = dir.path() / "cut";
    fs::remove_all(whole);
    fs::remove_all(cut);
    const std::string args = common + " " + where;
    REQUIRE(run(TANDEM_LENET_PATH, args + " --checkpoint " + whole.string(), dir.file("whole.log")) == 0);

    const pid_t pid = spawn(TANDEM_LENET_PATH, args + " --checkpoint " + cut.string(), dir.file("cut.log"));
    bool killed = false;
    for (int i = 0; i < 20000 && !killed; ++i) {
      const auto c = checkpoints(cut);
      if (!c.empty() && c.back().first >= kill_after) killed = ::kill(pid, SIGKILL) == 0;
      else std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    const int code = wait_code(pid);
    INFO(read_text(dir.file("cut.log")));
    if (code == 0) {
      // The run finished before the kill landed (a loaded machine): cut its history back to
      // step kill_after, which is the state a kill right after that checkpoint leaves.
      WARN(where << ": the run ended before the kill; resuming from its checkpoint of step " << kill_after);
      for (const auto& [step, path] : checkpoints(cut))
        if (step > kill_after) fs::remove(path);
    } else {
      REQUIRE(code == 128 + SIGKILL);
    }
    const auto left = checkpoints(cut);
    REQUIRE(!left.empty());
    REQUIRE(left.back().first < total);
    // What a crash can leave besides: a temporary file (never a name --resume picks) and, to
    // prove the fallback, a damaged copy of the newest checkpoint under a later step.
    std::ofstream((cut / ".ckpt-000000000999.safetensors.tmp.1.0").string()) << "partial";
    {
      std::ifstream src(left.back().second, std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(src)), {});
      std::ofstream((cut / "ckpt-000000000998.safetensors").string(), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    }
    REQUIRE(run(TANDEM_LENET_PATH, args + " --checkpoint " + cut.string() + " --resume", dir.file("resume.log")) == 0);
    const std::string out = read_text(dir.file("resume.log"));
    INFO(out);
    CHECK(out.find("skipping " + (cut / "ckpt-000000000998.safetensors").string()) != std::string::npos);
    CHECK(out.find("resuming from " + left.back().second) != std::string::npos);
    require_same_tensors((whole / "ckpt-000000000024.safetensors").string(),
                         (cut / "ckpt-000000000024.safetensors").string());
  }
}

TEST_CASE("on a GPU, a run replayed from a CUDA graph ends with the very tensors of an eager run",
          "[examples][checkpoint][cuda]") {
  TANDEM_REQUIRE_CUDA();
  TempDir dir;
  write_tiny_dataset(dir.path());
  // 64 images in batches of 12: five full batches (two warm-up steps, a capture, replays) and
  // a short one run eagerly, every epoch; a learning rate that changes every epoch. The
  // graphed run gathers its batches and adds its sums inside the graph.
  const std::string common = "--data " + dir.path().string() +
                             " --device cuda:0 --epochs 3 --batch-size 12 --test-limit 16 --no-progress "
                             "--momentum 0.9 --activation relu --lr-schedule cosine --checkpoint ";
  const fs::path eager = dir.path() / "eager", graphed = dir.path() / "graphed";
  REQUIRE(run(TANDEM_LENET_PATH, common + eager.string() + " --no-cuda-graph", dir.file("eager.log")) == 0);
  REQUIRE(run(TANDEM_LENET_PATH, common + graphed.string(), dir.file("graphed.log")) == 0);
  const auto a = checkpoints(eager), b = checkpoints(graphed);
  REQUIRE(!a.empty());
  REQUIRE(!b.empty());
  CHECK(a.back().first == 18);
  require_same_tensors(a.back().second, b.back().second);
  // The printed epochs agree too (the seconds and images/s aside).
  auto losses = [&](const std::string& log) {
    std::vector<std::string> out;
    std::istringstream is(read_text(log));
    for (std::string line; std::getline(is, line);)
      if (line.rfind("epoch ", 0) == 0) out.push_back(line.substr(0, line.find("test acc ") + 15));
    return out;
  };
  CHECK(losses(dir.file("eager.log")).size() == 3);
  CHECK(losses(dir.file("eager.log")) == losses(dir.file("graphed.log")));
}

// Note [the weight copy written by the update] (nn/optim/optimizer.h): a bf16 run on `where`
// whose optimizer writes the autocast weight copy ends with the very tensors of one that casts
// the copy at every step (`cast_flags` added to it), for SGD with momentum and for Adam; so
// does the same run cut after step 5 and resumed, whose copy is stale after the load.
void check_weight_copy_in_update(const TempDir& dir, const std::string& where, const std::string& cast_flags) {
  // 2 epochs of 8 steps, a checkpoint after every step.
  const std::string common = "--data " + dir.path().string() + " " + where +
                             " --epochs 2 --batch-size 8 --test-limit 16 --no-progress --precision bf16 "
                             "--activation relu --checkpoint-every 1";
  const std::string last = "ckpt-000000000016.safetensors";
  for (const char* optimizer : {"--momentum 0.9", "--optimizer adam --lr 0.001"}) {
    INFO(where << " " << optimizer);
    const std::string args = common + " " + optimizer;
    const fs::path cast = dir.path() / "cast", update = dir.path() / "update";
    fs::remove_all(cast);
    fs::remove_all(update);
    const auto run_with = [&](const std::string& env, const std::string& more, const std::string& log) {
      const std::string cmd = env + " " + TANDEM_LENET_PATH + " " + args + " " + more + " > " + dir.file(log) + " 2>&1";
      const int status = std::system(cmd.c_str());
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    const int cast_code = run_with("TANDEM_WEIGHT_COPY_IN_UPDATE=0", cast_flags + " --checkpoint " + cast.string(), "cast.log");
    INFO(read_text(dir.file("cast.log")));
    REQUIRE(cast_code == 0);
    const int update_code = run_with("TANDEM_WEIGHT_COPY_IN_UPDATE=1", "--checkpoint " + update.string(), "update.log");
    INFO(read_text(dir.file("update.log")));
    REQUIRE(update_code == 0);
    CHECK(read_text(dir.file("update.log")).find("bf16 autocast") != std::string::npos);
    require_same_tensors((cast / last).string(), (update / last).string());

    for (const auto& [step, path] : checkpoints(update))
      if (step > 5) fs::remove(path);
    const int resume_code = run_with("TANDEM_WEIGHT_COPY_IN_UPDATE=1", "--checkpoint " + update.string() + " --resume", "resume.log");
    INFO(read_text(dir.file("resume.log")));
    REQUIRE(resume_code == 0);
    CHECK(read_text(dir.file("resume.log")).find("resuming from") != std::string::npos);
    require_same_tensors((cast / last).string(), (update / last).string());
  }
}

TEST_CASE("bf16: the weight copy written by the update gives the tensors of a cast at every step, resumed too",
          "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  check_weight_copy_in_update(dir, "--device cpu", "");
}

TEST_CASE("on a GPU, a graphed bf16 run whose update writes the weight copy ends as an eager one that casts",
          "[examples][checkpoint][cuda]") {
  TANDEM_REQUIRE_CUDA();
  TempDir dir;
  write_tiny_dataset(dir.path());
  // Graphed: the copy written by every replay's update, and, resumed, a capture right after
  // the load (Note [the one-device step] in examples/common/steppers.cpp).
  check_weight_copy_in_update(dir, "--device cuda:0", "--no-cuda-graph");
}

TEST_CASE("SIGTERM stops a run after its step with exit 143 and a checkpoint that resumes", "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  const fs::path ckpt = dir.path() / "ckpt";
  // Far more epochs than the test waits for: the signal, not the end, stops it.
  const std::string args = "--data " + dir.path().string() + " --epochs 500 --batch-size 8 --test-limit 16 "
                           "--no-progress --checkpoint-every 5 --keep 2 --checkpoint " + ckpt.string();
  const pid_t pid = spawn(TANDEM_LENET_PATH, args, dir.file("run.log"));
  for (int i = 0; i < 20000 && checkpoints(ckpt).size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(::kill(pid, SIGTERM) == 0);
  const int code = wait_code(pid);
  const std::string out = read_text(dir.file("run.log"));
  INFO(out);
  REQUIRE(code == 143);
  CHECK(out.find("lenet: stopped by SIGTERM at epoch") != std::string::npos);
  CHECK(out.find("--resume") != std::string::npos);
  const auto left = checkpoints(ckpt);
  CHECK(left.size() <= 2);  // --keep 2
  REQUIRE(!left.empty());
  // The newest is the stop's checkpoint: the step the message names, not a multiple of 5 in general.
  const tandem::nn::TrainingCheckpoint c = tandem::nn::read_training_checkpoint(left.back().second);
  CHECK(out.find("(run step " + std::to_string(c.step) + ")") != std::string::npos);
  CHECK(out.find(left.back().second) != std::string::npos);
  // It resumes (a shorter run now: the epochs already done count).
  const int64_t epochs_now = c.epoch + 2;
  std::string resume = args;
  resume.replace(resume.find("--epochs 500"), 12, "--epochs " + std::to_string(epochs_now));
  REQUIRE(run(TANDEM_LENET_PATH, resume + " --resume", dir.file("resume.log")) == 0);
  CHECK(read_text(dir.file("resume.log")).find("resuming from " + left.back().second) != std::string::npos);
}

TEST_CASE("resuming from another model's checkpoint names the tensor, and bad checkpoint flags fail first",
          "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  const std::string data = "--data " + dir.path().string() + " --batch-size 8 --test-limit 16 --no-progress";
  const fs::path ckpt = dir.path() / "ckpt";
  REQUIRE(run(TANDEM_LENET_PATH, data + " --epochs 1 --checkpoint " + ckpt.string(), dir.file("a.log")) == 0);
  const auto c = checkpoints(ckpt);
  REQUIRE(c.size() == 1);  // the end of the run writes one
  CHECK(c.back().first == 8);

  CHECK(run(TANDEM_RESNET_PATH, data + " --epochs 1 --resume " + c.back().second, dir.file("b.log")) == 1);
  const std::string b = read_text(dir.file("b.log"));
  INFO(b);
  CHECK(b.find("tensor 'model.0.0.weight'") != std::string::npos);
  CHECK(b.find(c.back().second) != std::string::npos);

  // No checkpoint in the folder: a fresh start, said so.
  REQUIRE(run(TANDEM_LENET_PATH, data + " --epochs 1 --checkpoint " + (dir.path() / "empty").string() + " --resume",
              dir.file("c.log")) == 0);
  CHECK(read_text(dir.file("c.log")).find("no checkpoint in") != std::string::npos);

  // Another batch size would not continue the same run.
  CHECK(run(TANDEM_LENET_PATH, "--data " + dir.path().string() + " --batch-size 16 --epochs 2 --resume " + c.back().second,
            dir.file("d.log")) == 1);
  CHECK(read_text(dir.file("d.log")).find("batch_size 8") != std::string::npos);

  std::ofstream(dir.file("a-file")) << "x";
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--checkpoint " + ckpt.string() + " --keep 0", "--keep"},
           {"--resume", "--resume without a file needs --checkpoint"},
           {"--checkpoint-every 5", "--checkpoint-every needs --checkpoint"},
           {"--resume " + dir.file("absent.safetensors"), "no such file"},
           {"--checkpoint " + dir.file("a-file") + "/sub", "--checkpoint"},
           {"--checkpoint " + ckpt.string() + " --checkpoint-every -1", "--checkpoint-every"}}) {
    INFO(flags);
    CHECK(run(TANDEM_LENET_PATH, data + " " + flags, dir.file("e.log")) == 2);
    const std::string e = read_text(dir.file("e.log"));
    INFO(e);
    CHECK(e.find(says) != std::string::npos);
    CHECK(std::count(e.begin(), e.end(), '\n') == 1);
  }
}

TEST_CASE("a loss that is not finite stops the run naming epoch and step, keeping the last good checkpoint",
          "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  const fs::path ckpt = dir.path() / "ckpt";
  const int code = run(TANDEM_LENET_PATH,
                       "--data " + dir.path().string() + " --batch-size 8 --test-limit 16 --no-progress --epochs 3 "
                       "--activation relu --lr 1e6 --checkpoint-every 1 --checkpoint " + ckpt.string(),
                       dir.file("nan.log"));
  const std::string out = read_text(dir.file("nan.log"));
  INFO(out);
  REQUIRE(code == 1);
  CHECK(out.find(" not finite at epoch ") != std::string::npos);
  // Every checkpoint left is one of a finite run: the last good one is named, and it resumes.
  const auto left = checkpoints(ckpt);
  if (!left.empty()) {
    CHECK(out.find("The last good checkpoint: " + left.back().second) != std::string::npos);
    const tandem::nn::TrainingCheckpoint c = tandem::nn::read_training_checkpoint(left.back().second);
    for (const auto& [name, t] : c.model) {
      INFO(name);
      const std::vector<double> v = t.to(tandem::kFloat64).to_vector<double>();
      CHECK(std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); }));
    }
  } else {
    CHECK(out.find("No checkpoint was written") != std::string::npos);
  }
}

#if defined(TANDEM_RUN_PATH) && defined(TANDEM_WITH_GLOO)
// Two processes over Gloo: rank 0 writes, every rank loads on --resume (docs/08-checkpoints.md).
// Note [the loss window inside the step]: the step appends its loss sum at a cursor on the
// device; read every 100 steps, the window names the same first bad step as a check after
// every step does.
TEST_CASE("the loss window names the first step whose loss is not finite, read every step or every 100",
          "[examples][checkpoint]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  const std::string flags = "--data " + dir.path().string() +
                            " --batch-size 8 --test-limit 16 --no-progress --epochs 3 --activation relu --lr 1e6";
  const auto verdict = [&](const std::string& more, const std::string& log) {
    REQUIRE(run(TANDEM_LENET_PATH, flags + more, dir.file(log)) == 1);
    const std::string out = read_text(dir.file(log));
    INFO(out);
    const size_t at = out.find(" not finite at epoch ");
    REQUIRE(at != std::string::npos);
    return out.substr(at, out.find(')', at) - at);  // epoch, step, run step and the sum
  };
  const std::string every_step = verdict(" --checkpoint-every 1 --checkpoint " + (dir.path() / "c").string(), "1.log");
  CHECK(verdict("", "100.log") == every_step);
}

TEST_CASE("two processes: a run cut at a random checkpoint and resumed ends as the whole run, and SIGTERM stops the job",
          "[examples][checkpoint][dist]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  // tandem-run's own flags, then the program.
  const std::string launch = std::string("--standalone --grace-seconds 20 --nproc-per-node 2 ") + TANDEM_LENET_PATH;
  ::setenv("TANDEM_DIST_TIMEOUT", "20", 1);
  const std::string common = "--data " + dir.path().string() + " --device cpu --epochs 2 --batch-size 8 "
                             "--test-limit 16 --no-progress --momentum 0.9 --checkpoint-every 2";
  const fs::path whole = dir.path() / "whole", cut = dir.path() / "cut";
  REQUIRE(run(TANDEM_RUN_PATH, launch + " " + common + " --checkpoint " + whole.string(),
              dir.file("whole.log")) == 0);
  INFO(read_text(dir.file("whole.log")));
  REQUIRE(checkpoints(whole).size() == 8);  // steps 2, 4, ..., 16
  // The cut run's history: the whole run's checkpoints up to a random one, as a kill right
  // after it would leave them.
  std::mt19937 rng(std::random_device{}());
  const int64_t keep_until = 2 * std::uniform_int_distribution<int64_t>(1, 6)(rng);
  INFO("resumed from step " << keep_until);
  fs::create_directories(cut);
  for (const auto& [step, path] : checkpoints(whole))
    if (step <= keep_until) fs::copy_file(path, cut / fs::path(path).filename());
  REQUIRE(run(TANDEM_RUN_PATH, launch + " " + common + " --checkpoint " + cut.string() +
                                   " --resume",
              dir.file("cut.log")) == 0);
  const std::string out = read_text(dir.file("cut.log"));
  INFO(out);
  CHECK(out.find("resuming from") != std::string::npos);
  require_same_tensors((whole / "ckpt-000000000016.safetensors").string(),
                       (cut / "ckpt-000000000016.safetensors").string());

  // SIGTERM to the launcher reaches both ranks; they agree on the step, rank 0 writes, and
  // the job ends with 143.
  const fs::path term = dir.path() / "term";
  std::string longer = common;
  longer.replace(longer.find("--epochs 2"), 10, "--epochs 500");
  const pid_t pid = spawn(TANDEM_RUN_PATH, launch + " " + longer + " --checkpoint " +
                                               term.string(), dir.file("term.log"));
  for (int i = 0; i < 30000 && checkpoints(term).size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(::kill(pid, SIGTERM) == 0);
  const int code = wait_code(pid);
  const std::string t = read_text(dir.file("term.log"));
  INFO(t);
  CHECK(code == 143);
  CHECK(t.find("stopped by SIGTERM") != std::string::npos);
  const auto left = checkpoints(term);
  REQUIRE(!left.empty());
  CHECK(tandem::nn::read_training_checkpoint(left.back().second).step == left.back().first);
}

// The same in a job of two processes: each rank appends its own sums inside its step (an empty
// shard's stand-in too), and the window is summed over the ranks at each check.
TEST_CASE("two processes: the loss window names the first bad step, read every step or every 100",
          "[examples][checkpoint][dist]") {
  TempDir dir;
  write_tiny_dataset(dir.path());
  ::setenv("TANDEM_DIST_TIMEOUT", "20", 1);
  const std::string launch = std::string("--standalone --grace-seconds 20 --nproc-per-node 2 ") + TANDEM_LENET_PATH;
  const std::string flags = " --data " + dir.path().string() +
                            " --device cpu --batch-size 8 --test-limit 16 --no-progress --epochs 3 --activation relu --lr 1e6";
  const auto verdict = [&](const std::string& more, const std::string& log) {
    REQUIRE(run(TANDEM_RUN_PATH, launch + flags + more, dir.file(log)) != 0);
    const std::string out = read_text(dir.file(log));
    INFO(out);
    const size_t at = out.find(" not finite at epoch ");
    REQUIRE(at != std::string::npos);
    return out.substr(at, out.find(')', at) - at);
  };
  const std::string every_step = verdict(" --checkpoint-every 1 --checkpoint " + (dir.path() / "c").string(), "1.log");
  CHECK(verdict("", "100.log") == every_step);
}
#endif
#endif
