// The launcher: tandem-run started as a real process over /bin/sh workers (the environment
// contract, output prefixes, stopping on failure, signals, flags), spawn() through this very
// test binary, and launch()'s argument checks.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/data_test_util.h"
#include "distributed/launch_test_util.h"
#include "parallel/distributed/env.h"
#include "parallel/distributed/launch.h"

extern char** environ;

using namespace tandem;
using namespace tandem::parallel::distributed;
using tandem::test::check_throws_containing;
using tandem::test::TempDir;
using namespace tandem::test::launch_util;

TEST_CASE("launch: bad options are ValueErrors", "[dist]") {
  check_throws_containing<ValueError>([] { launch({.nproc_per_node = 0}, {"true"}); },
                                      {"nproc_per_node", "0"});
  check_throws_containing<ValueError>([] { launch({.nnodes = 2, .node_rank = 2}, {"true"}); },
                                      {"node_rank 2", "nnodes 2"});
  check_throws_containing<ValueError>([] { launch({.master_port = 70000}, {"true"}); },
                                      {"master_port 70000"});
  check_throws_containing<ValueError>([] { launch({}, {}); }, {"no program"});
  check_throws_containing<ValueError>([] { spawn(0, [](int, int) {}); }, {"nprocs", "0"});
  const int port = free_port();
  CHECK(port > 0);
  CHECK(port <= 65535);
}

// A test binary may be started without the launcher target built.
#ifdef TANDEM_RUN_PATH

TEST_CASE("tandem-run: every rank gets the contract, and output lines carry the rank", "[dist]") {
  TempDir dir;
  const std::string script =
      "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
      "$TANDEM_JOB_ID $OMP_NUM_THREADS $NCCL_NVLS_ENABLE $TANDEM_STORE_HOSTED\"; echo \"err $RANK\" >&2; "
      "echo two; printf \"tail $RANK\"";
  const Finished f =
      finish(start({TANDEM_RUN_PATH, "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
                    "--master_port=29611", "--grace-seconds", "1", "sh", "-c", script},
                   dir));
  INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
  CHECK(f.code == 0);
  std::set<std::string> jobs;
  std::set<int> ranks;
  for (const std::string& line : lines_of(f.out)) {
    REQUIRE(line.rfind("[rank ", 0) == 0);
    const int rank = line[6] - '0';
    CHECK(line.substr(7, 2) == "] ");
    std::istringstream in(line.substr(9));
    std::string word;
    in >> word;
    if (word == "two" || word == "tail") {
      if (word == "tail")
        CHECK(line == "[rank " + std::to_string(rank) + "] tail " + std::to_string(rank));
      continue;
    }
    REQUIRE(word == "env");
    int r, world, local, local_world, port;
    std::string addr, job, omp, nvls, hosted;
    in >> r >> world >> local >> local_world >> addr >> port >> job >> omp >> nvls >> hosted;
    CHECK(hosted == "0");  // rank 0 hosts the store of a job with a given port
    CHECK(r == rank);
    CHECK(world == 3);
    CHECK(local == r);
    CHECK(local_world == 3);
    CHECK(addr == "127.0.0.1");
    CHECK(port == 29611);
    CHECK(omp == (std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "1"));
    CHECK(nvls == (std::getenv("NCCL_NVLS_ENABLE") ? std::getenv("NCCL_NVLS_ENABLE") : "0"));
    jobs.insert(job);
    ranks.insert(r);
  }
  CHECK(ranks == std::set<int>{0, 1, 2});
  REQUIRE(jobs.size() == 1);  // one id for the whole job
  CHECK(jobs.begin()->size() == 16);
  CHECK(count_of(f.out, "] two\n") == 3);
  CHECK(count_of(f.out, "] tail ") == 3);  // a last line without '\n' is flushed at EOF
  for (int r = 0; r < 3; ++r)
    CHECK(count_of(f.err, "[rank " + std::to_string(r) + "] err " + std::to_string(r) + "\n") == 1);
}

TEST_CASE("tandem-run: standalone picks a free port and a fresh job id", "[dist]") {
  TempDir dir;
  const std::vector<std::string> args = {TANDEM_RUN_PATH,
                                         "--standalone",
                                         "--nproc-per-node",
                                         "2",
                                         "/bin/sh",
                                         "-c",
                                         "echo $MASTER_ADDR $MASTER_PORT $TANDEM_JOB_ID $TANDEM_STORE_HOSTED"};
  const Finished a = finish(start(args, dir)), b = finish(start(args, dir));
  INFO(a.out << a.err << b.out << b.err);
  CHECK(a.code == 0);
  CHECK(b.code == 0);
  const std::vector<std::string> la = lines_of(a.out), lb = lines_of(b.out);
  REQUIRE(la.size() == 2);
  REQUIRE(lb.size() == 2);
  CHECK(la[0].substr(9) == la[1].substr(9));  // both ranks: same address, port and id
  CHECK(la[0].substr(9, 10) == "127.0.0.1 ");
  CHECK(la[0].substr(9).find(" 29500 ") == std::string::npos);
  CHECK(la[0].substr(9) != lb[0].substr(9));  // another job: another id (and likely port)
  // The launcher hosts the store (Note [the launcher hosts the store] in launch.cpp).
  CHECK(la[0].substr(la[0].size() - 2) == " 1");
}

TEST_CASE("tandem-run: the second node's ranks follow the first's", "[dist]") {
  TempDir dir;
  const Finished f = finish(start(
      {TANDEM_RUN_PATH, "--nnodes", "2", "--node_rank", "1", "--nproc-per-node=2", "--master-port",
       "29612", "--", "/bin/sh", "-c", "echo $RANK $LOCAL_RANK $WORLD_SIZE $TANDEM_JOB_ID"},
      dir));
  INFO(f.out << f.err);
  CHECK(f.code == 0);
  std::vector<std::string> lines = lines_of(f.out);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"[rank 2] 2 0 4 127.0.0.1:29612:4",
                                          "[rank 3] 3 1 4 127.0.0.1:29612:4"});
}

TEST_CASE("tandem-run: --no-prefix leaves the output alone", "[dist]") {
  TempDir dir;
  const Finished f = finish(start({TANDEM_RUN_PATH, "--no-prefix", "--nproc-per-node", "2",
                                   "/bin/sh", "-c", "echo plain $RANK"},
                                  dir));
  CHECK(f.code == 0);
  std::vector<std::string> lines = lines_of(f.out);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"plain 0", "plain 1"});
}

TEST_CASE("tandem-run: one failing rank stops the others and is named", "[dist]") {
  TempDir dir;
  // Rank 0 sleeps in a child of its own (so the whole process group must go); rank 1 fails
  // once rank 0 has written both pids.
  const std::string script = "if [ \"$RANK\" = 1 ]; then while [ ! -f " + dir.file("pids") +
                             " ]; do sleep 0.01; done; echo dying >&2; exit 3; fi; "
                             "sleep 30 & echo \"$$ $!\" > " +
                             dir.file("tmp") + " && mv " + dir.file("tmp") + " " +
                             dir.file("pids") + "; wait";
  const Finished f = finish(start(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "1", "/bin/sh", "-c", script},
      dir));
  INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
  CHECK(f.code == 1);
  CHECK(f.seconds < 2.0);
  CHECK(f.err.find("tandem-run: rank 1 (pid ") != std::string::npos);
  CHECK(f.err.find(") exited with code 3; stopping the other 1 worker(s)\n") != std::string::npos);
  CHECK(count_of(f.err, "tandem-run:") == 1);  // one line, not one per rank
  // The failing rank's last words come before the launcher's line.
  CHECK(f.err.find("[rank 1] dying") < f.err.find("tandem-run: rank 1"));
  std::istringstream pids(read_text(dir.file("pids")));
  pid_t shell = 0, sleeper = 0;
  pids >> shell >> sleeper;
  REQUIRE(shell > 0);
  REQUIRE(sleeper > 0);
  CHECK(gone_soon(shell));
  CHECK(gone_soon(sleeper));
}

TEST_CASE("tandem-run: a rank killed by a signal is named with it", "[dist]") {
  TempDir dir;
  const Finished f =
      finish(start({TANDEM_RUN_PATH, "--nproc-per-node", "3", "--grace-seconds", "1", "/bin/sh",
                    "-c", "if [ \"$RANK\" = 2 ]; then sleep 0.2; kill -9 $$; fi; sleep 30"},
                   dir));
  INFO(f.err);
  CHECK(f.code == 1);
  CHECK(f.seconds < 2.5);
  CHECK(f.err.find(") was killed by signal 9 (SIGKILL); stopping the other 2 worker(s)") !=
        std::string::npos);
  CHECK(f.err.find("tandem-run: rank 2 (pid ") != std::string::npos);
}

TEST_CASE("tandem-run: a worker that ignores SIGTERM is killed after the grace period", "[dist]") {
  TempDir dir;
  const std::string script = "if [ \"$RANK\" = 0 ]; then while [ ! -f " + dir.file("ready") +
                             " ]; do sleep 0.01; done; exit 5; fi; trap '' TERM; echo $$ > " +
                             dir.file("stubborn") + "; touch " + dir.file("ready") + "; sleep 30";
  const Finished f = finish(start(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "0.5", "/bin/sh", "-c", script},
      dir));
  INFO(f.err);
  CHECK(f.code == 1);
  CHECK(f.seconds >= 0.45);
  CHECK(f.seconds < 2.5);
  CHECK(f.err.find("exited with code 5") != std::string::npos);
  CHECK(gone_soon(pid_in(dir.file("stubborn"))));
}

TEST_CASE("tandem-run: SIGTERM to the launcher reaches every worker", "[dist]") {
  TempDir dir;
  const std::string script =
      "trap 'echo got TERM; exit 143' TERM; touch " + dir.file("ready") + "$RANK; sleep 30 & wait";
  const Child c = start(
      {TANDEM_RUN_PATH, "--nproc-per-node", "2", "--grace-seconds", "1", "/bin/sh", "-c", script},
      dir);
  wait_for_file(dir.file("ready0"));
  wait_for_file(dir.file("ready1"));
  const auto sent = Clock::now();
  REQUIRE(kill(c.pid, SIGTERM) == 0);
  const Finished f = finish(c);
  INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
  CHECK(f.code == 143);
  CHECK(std::chrono::duration<double>(Clock::now() - sent).count() < 2.0);
  CHECK(count_of(f.out, "[rank 0] got TERM") == 1);
  CHECK(count_of(f.out, "[rank 1] got TERM") == 1);
  CHECK(f.err.find("got SIGTERM; stopping 2 worker(s)") != std::string::npos);
  CHECK(f.err.find("exited with code") == std::string::npos);  // a stop, not a failure
}

TEST_CASE("tandem-run: bad flags are one line and exit code 2", "[dist]") {
  TempDir dir;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nproc-per-node", "0", "true"}, "--nproc-per-node 0 is not in 1.."},
      {{"--nproc-per-node", "two", "true"}, "--nproc-per-node expects an integer, got 'two'"},
      {{"--nnodes", "2", "--node-rank", "2", "true"}, "--node-rank 2 is not below --nnodes 2"},
      {{"--master-port", "70000", "true"}, "--master-port 70000 is not in 1..65535"},
      {{"--bogus", "true"}, "unknown flag --bogus"},
      {{"--nproc-per-node"}, "--nproc-per-node needs a value"},
      {{"--standalone", "--nnodes", "2", "true"}, "--standalone is one node"},
      {{"--grace-seconds", "-1", "true"}, "--grace-seconds expects seconds"},
      {{}, "no program to run"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> args = {TANDEM_RUN_PATH};
    args.insert(args.end(), flags.begin(), flags.end());
    const Finished f = finish(start(args, dir));
    INFO("flags: " << (flags.empty() ? std::string() : flags[0]) << "\nstderr: " << f.err);
    CHECK(f.code == 2);
    CHECK(lines_of(f.err).size() == 1);
    CHECK(f.err.find("tandem-run: " + message) != std::string::npos);
  }
  const Finished help = finish(start({TANDEM_RUN_PATH, "--help"}, dir));
  CHECK(help.code == 0);
  CHECK(help.out.find("--nproc-per-node N|gpu") != std::string::npos);
}

TEST_CASE("tandem-run: a program that does not exist", "[dist]") {
  TempDir dir;
  for (const std::string prog : {"tandem-no-such-program", "/nonexistent/tandem-prog"}) {
    const Finished f =
        finish(start({TANDEM_RUN_PATH, "--nproc-per-node", "2", prog, "--flag"}, dir));
    INFO(f.err);
    CHECK(f.code != 0);
    CHECK(f.err.find("tandem-run: cannot run '" + prog + "': No such file or directory") !=
          std::string::npos);
    CHECK(lines_of(f.err).size() == 1);
  }
}

#endif  // TANDEM_RUN_PATH

// spawn() re-executes the running binary, so this test binary is its own worker program: the
// hidden case below is what the re-executed copies run. TANDEM_SPAWN_TEST_NPROCS sets nprocs
// (default 2); an error from spawn itself is printed as "spawn error: ..." with exit code 3.
TEST_CASE("launch: spawn child", "[.spawn_child]") {
  const char* dir = std::getenv("TANDEM_SPAWN_TEST_DIR");
  const bool fail = std::getenv("TANDEM_SPAWN_TEST_FAIL") != nullptr;
  const char* nprocs = std::getenv("TANDEM_SPAWN_TEST_NPROCS");
  REQUIRE(dir);
  bool worker = false;  // fn ran in this process
  int rc = 0;
  try {
    rc = spawn(nprocs ? std::atoi(nprocs) : 2,
               [&](int rank, int world) {
                 worker = true;
                 const char* job = std::getenv("TANDEM_JOB_ID");
                 const char* port = std::getenv("MASTER_PORT");
                 // rank, world, job id, the store's port, MASTER_PORT
                 std::ofstream(std::string(dir) + "/rank" + std::to_string(rank))
                     << rank << " " << world << " " << (job ? job : "-") << " "
                     << read_dist_env().master_port << " " << (port ? port : "-");
                 if (fail && rank == 1) throw std::runtime_error("boom");
               },
               {.grace = std::chrono::milliseconds(1000)});
  } catch (const std::exception& e) {
    std::cout << "spawn error: " << e.what() << std::endl;
    std::_Exit(3);
  }
  std::cout << "spawn rc=" << rc << (worker ? " worker" : " parent") << std::endl;
  // A worker ends here as `return spawn(...)` from main would.
  if (worker) std::_Exit(rc);
}

TEST_CASE("launch: spawn re-executes the program as its workers", "[dist]") {
  TempDir dir;
  SECTION("every rank runs the function") {
    const Finished f = finish(start(catch_case("launch: spawn child"), dir,
                                    {"TANDEM_SPAWN_TEST_DIR=" + dir.path().string()}));
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.code == 0);
    CHECK(count_of(f.out, "[rank 0] spawn rc=0 worker") == 1);
    CHECK(count_of(f.out, "[rank 1] spawn rc=0 worker") == 1);
    CHECK(count_of(f.out, "spawn rc=0 parent") == 1);
    const std::string r0 = read_text(dir.file("rank0")), r1 = read_text(dir.file("rank1"));
    CHECK(r0.substr(0, 4) == "0 2 ");
    CHECK(r1.substr(0, 4) == "1 2 ");
    CHECK(r0.substr(4) == r1.substr(4));  // one job id
  }
  SECTION("an exception in one rank stops the job") {
    const Finished f =
        finish(start(catch_case("launch: spawn child"), dir,
                     {"TANDEM_SPAWN_TEST_DIR=" + dir.path().string(), "TANDEM_SPAWN_TEST_FAIL=1"}));
    INFO("stdout:\n" << f.out << "stderr:\n" << f.err);
    CHECK(f.err.find("[rank 1] rank 1: error: boom") != std::string::npos);
    CHECK(f.err.find("tandem-run: rank 1 (pid ") != std::string::npos);
    CHECK(count_of(f.out, "spawn rc=1 parent") == 1);
  }
}
