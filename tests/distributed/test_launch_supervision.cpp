// The launcher's hold on its workers: signals it forwards (stopping ones and USR1/USR2), workers
// that die with a launcher killed outright, spawn() inside another launcher's environment, and
// worker output that reaches the launcher's stdout line by line as it is printed.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data/data_test_util.h"
#include "distributed/launch_test_util.h"

using tandem::test::TempDir;
using namespace tandem::test::launch_util;

namespace {

// Variables of a launcher around the test binary itself (a test run under srun or torchrun):
// unset in the processes these tests start, so that only what a test sets is there.
const std::vector<std::string> kNoContract = {"RANK",
                                              "WORLD_SIZE",
                                              "LOCAL_RANK",
                                              "LOCAL_WORLD_SIZE",
                                              "MASTER_ADDR",
                                              "MASTER_PORT",
                                              "TANDEM_JOB_ID",
                                              "OMPI_COMM_WORLD_RANK",
                                              "OMPI_COMM_WORLD_SIZE",
                                              "OMPI_COMM_WORLD_LOCAL_RANK",
                                              "OMPI_COMM_WORLD_LOCAL_SIZE",
                                              "SLURM_PROCID",
                                              "SLURM_NTASKS",
                                              "SLURM_LOCALID",
                                              "SLURM_NTASKS_PER_NODE",
                                              "SLURM_TASKS_PER_NODE",
                                              "SLURM_JOB_ID",
                                              "SLURM_STEP_ID",
                                              "TORCHELASTIC_USE_AGENT_STORE",
                                              "TANDEM_STORE_PORT"};

std::vector<std::string> env_with(std::vector<std::string> set) {
  std::vector<std::string> env = kNoContract;
  env.insert(env.end(), set.begin(), set.end());
  return env;
}

// Waits up to timeout_s for `part` to appear count times in a file another process writes.
bool file_shows(const std::string& path, const std::string& part, size_t count,
                double timeout_s = 3) {
  const auto until = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (count_of(read_text(path), part) < count) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// Two sleeping workers, each of which writes its pid to pid<RANK> once it is set up, then
// becomes `sleep 30` (exec keeps the pid). Returns the launcher and the workers' pids.
struct SleepingJob {
  Child launcher;
  std::vector<pid_t> workers;
};

SleepingJob start_sleeping_job(const TempDir& dir) {
  const std::string script = "echo $$ > " + dir.file("tmp") + "$RANK && mv " + dir.file("tmp") +
                             "$RANK " + dir.file("pid") + "$RANK && exec sleep 30";
  SleepingJob job;
  job.launcher = start(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "1", "/bin/sh", "-c", script},
      dir, kNoContract);
  for (int r = 0; r < 2; ++r) {
    wait_for_file(dir.file("pid" + std::to_string(r)));
    job.workers.push_back(pid_in(dir.file("pid" + std::to_string(r))));
  }
  return job;
}

// A failing check must not leave `sleep 30`s behind.
void kill_leftovers(const std::vector<pid_t>& pids) {
  for (pid_t p : pids)
    if (alive(p)) kill(p, SIGKILL);
}

}  // namespace

#ifdef TANDEM_RUN_PATH

TEST_CASE("tandem-run: SIGHUP and SIGQUIT to the launcher stop every worker", "[dist]") {
  for (const int sig : {SIGHUP, SIGQUIT}) {
    TempDir dir;
    SleepingJob job = start_sleeping_job(dir);
    const auto sent = Clock::now();
    REQUIRE(kill(job.launcher.pid, sig) == 0);
    const Finished f = finish(job.launcher, 5);
    INFO("signal " << sig << "\nstdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 128 + sig);
    CHECK(f.err.find(std::string("got ") + (sig == SIGHUP ? "SIGHUP" : "SIGQUIT") +
                     "; stopping 2 worker(s)") != std::string::npos);
    CHECK(f.err.find("exited with code") == std::string::npos);  // a stop, not a failure
    for (pid_t p : job.workers) CHECK(gone_soon(p));
    CHECK(std::chrono::duration<double>(Clock::now() - sent).count() < 3.0);
    kill_leftovers(job.workers);
  }
}

TEST_CASE("tandem-run: workers die with a launcher killed by SIGKILL", "[dist]") {
  TempDir dir;
  SleepingJob job = start_sleeping_job(dir);
  REQUIRE(kill(job.launcher.pid, SIGKILL) == 0);
  const Finished f = finish(job.launcher, 5);
  CHECK(f.code == 128 + SIGKILL);
  for (pid_t p : job.workers) CHECK(gone_soon(p));
  kill_leftovers(job.workers);
}

TEST_CASE("tandem-run: SIGUSR1 and SIGUSR2 reach every worker and the job goes on", "[dist]") {
  TempDir dir;
  // Each worker traps both, says it is ready, and runs until the test creates `stop` (10 s at
  // most); the loop's `sleep` is in the worker's process group too and may die of the signal:
  // the loop goes on.
  const std::string script = "trap 'echo got USR1' USR1; trap 'echo got USR2' USR2; touch " +
                             dir.file("ready") + "$RANK; i=0; while [ ! -f " + dir.file("stop") +
                             " ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; echo done";
  const Child c = start(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "1", "/bin/sh", "-c", script},
      dir, kNoContract);
  wait_for_file(dir.file("ready0"));
  wait_for_file(dir.file("ready1"));
  REQUIRE(kill(c.pid, SIGUSR1) == 0);
  const bool usr1 = file_shows(c.out_path, "] got USR1\n", 2);
  REQUIRE(kill(c.pid, SIGUSR2) == 0);
  const bool usr2 = file_shows(c.out_path, "] got USR2\n", 2);
  std::ofstream(dir.file("stop")) << "";
  const Finished f = finish(c, 5);
  INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
  CHECK(usr1);
  CHECK(usr2);
  CHECK(f.code == 0);
  CHECK(count_of(f.out, "[rank 0] got USR1\n") == 1);
  CHECK(count_of(f.out, "[rank 1] got USR2\n") == 1);
  CHECK(count_of(f.out, "] done\n") == 2);
  CHECK(f.err.find("got SIGUSR1; forwarding it to 2 worker(s)") != std::string::npos);
  CHECK(f.err.find("got SIGUSR2; forwarding it to 2 worker(s)") != std::string::npos);
}

// True when the process ignores sig (SigIgn in /proc/<pid>/status, a hex mask of bit sig - 1).
bool ignores(pid_t pid, int sig) {
  std::istringstream in(read_text("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(in, line);)
    if (line.rfind("SigIgn:", 0) == 0)
      return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  return false;
}

TEST_CASE("tandem-run: a signal it was started with ignored stays ignored (nohup)", "[dist]") {
  TempDir dir;
  const std::string script = "echo $$ > " + dir.file("tmp") + "$RANK && mv " + dir.file("tmp") +
                             "$RANK " + dir.file("pid") + "$RANK && exec sleep 30";
  // The shell ignores SIGHUP and SIGINT, and exec keeps them ignored in tandem-run.
  const std::string launcher = std::string("trap '' HUP INT; exec ") + TANDEM_RUN_PATH +
                               " --nproc-per-node 2 --grace-seconds 1 /bin/sh -c '" + script + "'";
  const Child c = start({"/bin/sh", "-c", launcher}, dir, kNoContract);
  std::vector<pid_t> workers;
  for (int r = 0; r < 2; ++r) {
    wait_for_file(dir.file("pid" + std::to_string(r)));
    workers.push_back(pid_in(dir.file("pid" + std::to_string(r))));
  }
  REQUIRE(kill(c.pid, SIGHUP) == 0);
  REQUIRE(kill(c.pid, SIGINT) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK(alive(c.pid));
  for (pid_t p : workers) {
    CHECK(alive(p));
    CHECK(ignores(p, SIGHUP));  // inherited, as from any parent
    CHECK(ignores(p, SIGINT));
    CHECK_FALSE(ignores(p, SIGPIPE));  // the launcher's own choice is not the workers'
  }
  REQUIRE(kill(c.pid, SIGTERM) == 0);
  const Finished f = finish(c, 5);
  INFO("stderr:\n" << f.err);
  CHECK(f.code == 143);
  CHECK(f.err.find("got SIGHUP") == std::string::npos);
  CHECK(f.err.find("got SIGINT") == std::string::npos);
  for (pid_t p : workers) CHECK(gone_soon(p));
  kill_leftovers(workers);
}

// What the output test's workers run: rank r prints "tick r i" for i = 0, 1, 2 with printf
// and no flush, taking turns with the other rank through files (turn k = 2 i + r waits for
// turn k - 1's file), so that in time the lines alternate 0, 1, 0, 1, 0, 1.
TEST_CASE("launch: ticker", "[.launch_ticker]") {
  const char* dir = std::getenv("TANDEM_TICK_DIR");
  const char* rank_text = std::getenv("RANK");
  REQUIRE(dir);
  REQUIRE(rank_text);
  const int rank = std::atoi(rank_text);
  auto turn_file = [&](int k) { return std::string(dir) + "/turn" + std::to_string(k); };
  for (int i = 0; i < 3; ++i) {
    const int k = 2 * i + rank;
    for (int w = 0; w < 500 && k > 0 && !std::filesystem::exists(turn_file(k - 1)); ++w)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    // Time for the launcher to relay the other rank's line before this one is written.
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    std::printf("tick %d %d\n", rank, i);
    std::ofstream(turn_file(k)) << "";
  }
}

TEST_CASE("tandem-run: the workers' lines arrive interleaved as they are printed", "[dist]") {
  TempDir dir;
  std::vector<std::string> launcher_args = {TANDEM_RUN_PATH, "--nproc-per-node", "2"};
  for (const std::string& a : catch_case("launch: ticker")) launcher_args.push_back(a);
  const Finished f =
      finish(start(launcher_args, dir, env_with({"TANDEM_TICK_DIR=" + dir.path().string()})), 10);
  INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
  CHECK(f.code == 0);
  std::vector<std::string> ticks;
  for (const std::string& line : lines_of(f.out))
    if (line.find("] tick ") != std::string::npos) ticks.push_back(line);
  CHECK(ticks == std::vector<std::string>{"[rank 0] tick 0 0", "[rank 1] tick 1 0",
                                          "[rank 0] tick 0 1", "[rank 1] tick 1 1",
                                          "[rank 0] tick 0 2", "[rank 1] tick 1 2"});
}

#endif  // TANDEM_RUN_PATH

// spawn(2) started inside the environment of another launcher's one-task job must still start
// 2 ranks; inside a rank of a bigger job of another size it refuses, naming the contract.
TEST_CASE("launch: spawn inside another launcher's environment", "[dist]") {
  TempDir dir;
  const std::string d = "TANDEM_SPAWN_TEST_DIR=" + dir.path().string();
  auto run = [&](std::vector<std::string> env) {
    env.push_back(d);
    return finish(start(catch_case("launch: spawn child"), dir, env_with(env)), 10);
  };
  auto started_two_ranks = [&](const Finished& f) {
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 0);
    CHECK(count_of(f.out, "[rank 0] spawn rc=0 worker") == 1);
    CHECK(count_of(f.out, "[rank 1] spawn rc=0 worker") == 1);
    CHECK(count_of(f.out, "spawn rc=0 parent") == 1);
    const std::string r0 = read_text(dir.file("rank0")), r1 = read_text(dir.file("rank1"));
    CHECK(r0.substr(0, 4) == "0 2 ");
    CHECK(r1.substr(0, 4) == "1 2 ");
    CHECK(r0.substr(4) == r1.substr(4));  // one job id, spawn's own
    std::istringstream fields(r0);
    std::string rank, world, job, store_port, master_port;
    fields >> rank >> world >> job >> store_port >> master_port;
    CHECK(job != "4242");  // not the other launcher's job id (a port may contain those digits)
    CHECK(store_port == master_port);  // the store on spawn's port, whatever was around it
  };
  SECTION("srun -n1: Slurm's variables of a one-task step") {
    started_two_ranks(run({"SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0",
                           "SLURM_NTASKS_PER_NODE=1", "SLURM_JOB_ID=4242", "SLURM_STEP_ID=0"}));
  }
  SECTION("mpirun -np 1") {
    started_two_ranks(
        run({"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1", "OMPI_COMM_WORLD_LOCAL_RANK=0",
             "OMPI_COMM_WORLD_LOCAL_SIZE=1", "OMPI_MCA_ess_base_jobid=4242"}));
  }
  SECTION("torchrun --nproc-per-node 1") {
    started_two_ranks(run({"RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1",
                           "MASTER_ADDR=127.0.0.1", "MASTER_PORT=1", "TANDEM_JOB_ID=4242",
                           "TORCHELASTIC_USE_AGENT_STORE=True"}));
  }
  SECTION("spawn(1) starts one worker, which runs the function") {
    const Finished f = run({"TANDEM_SPAWN_TEST_NPROCS=1", "SLURM_PROCID=0", "SLURM_NTASKS=1"});
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 0);
    CHECK(count_of(f.out, "[rank 0] spawn rc=0 worker") == 1);
    CHECK(count_of(f.out, "spawn rc=0 parent") == 1);
    CHECK(read_text(dir.file("rank0")).substr(0, 4) == "0 1 ");
  }
  SECTION("a rank of a job of 2 runs the function as that rank") {
    const Finished f =
        run({"SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=2"});
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 0);
    CHECK(count_of(f.out, "spawn rc=0 worker") == 1);
    CHECK(read_text(dir.file("rank1")).substr(0, 4) == "1 2 ");
    CHECK_FALSE(std::filesystem::exists(dir.file("rank0")));
  }
  SECTION("a rank of a job of another size is refused") {
    const Finished f =
        run({"SLURM_PROCID=1", "SLURM_NTASKS=4", "SLURM_LOCALID=1", "SLURM_NTASKS_PER_NODE=4"});
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 3);
    CHECK(f.out.find("spawn error: spawn(2): this process is already rank 1 of 4 (slurm") !=
          std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir.file("rank1")));
  }
}
