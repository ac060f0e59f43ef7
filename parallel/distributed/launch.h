#pragma once
// The launcher: start one worker process per rank, supervise them, stop them all on failure.
//
// `tandem-run` (examples/tandem_run.cpp) is a thin command line over launch(); spawn() is the
// same machinery started from inside a program, as PyTorch's mp.spawn.
//
// Every worker gets the environment contract of env.h -- RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TANDEM_JOB_ID -- plus OMP_NUM_THREADS=1 and
// NCCL_NVLS_ENABLE=0 unless those are already set (torchrun sets the first: one OpenMP thread
// per process instead of every process taking every core; the second keeps NCCL off NVLink
// multicast unless the user asks for it). Global rank = node_rank * nproc_per_node + local
// rank.
//
// Note [one failure stops the job]: a worker that dies leaves its peers blocked in a
// collective until their timeout. The launcher does not wait for that: as soon as one worker
// exits non-zero or is killed, it prints one line naming the rank, its pid and its exit code
// (or signal), sends SIGTERM to every other worker's process group, SIGKILL after `grace`,
// reaps them all and returns 1. Each worker runs in its own process group, so whatever the
// worker started dies with it, and Ctrl-C in a terminal reaches the launcher alone, which
// forwards it (SIGINT/SIGTERM to the launcher go to every worker, then the same grace and
// SIGKILL; the launcher returns 130/143, as a shell would).
//
// Output: with prefix_output, each worker's stdout and stderr go through a pipe and the
// launcher relays whole lines, each as "[rank N] line", to its own stdout and stderr; a last
// line without '\n' is flushed at EOF. Without it, workers write to the launcher's streams
// directly.
//
// Workers are started with posix_spawn (a vfork and an exec): the launcher's memory is never
// duplicated and nothing runs in the child before exec, so calling these from a process that
// already uses CUDA or threads is safe. One launch()/spawn() at a time per process (they
// install signal handlers for their duration and restore them on return).
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tandem::parallel::distributed {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // A single-node job on a free port of 127.0.0.1 (master_addr and master_port are ignored;
  // needs nnodes == 1).
  bool standalone = false;
  // TANDEM_JOB_ID for the workers; empty: random hex on one node, "<addr>:<port>:<world>" when
  // nnodes > 1 (every node's launcher derives the same one).
  std::string run_id;
  std::chrono::milliseconds grace{5000};  // between SIGTERM and SIGKILL
  bool prefix_output = true;              // "[rank N] " before every line of each worker
};

// Starts nproc_per_node copies of argv (argv[0] resolved through PATH), supervises them and
// returns the launcher's exit code: 0 when every worker exited 0; 1 after a failure (Note [one
// failure stops the job]); 130/143 after SIGINT/SIGTERM; 127 when argv[0] cannot be run
// ("tandem-run: cannot run 'prog': No such file or directory", nothing left running). Throws
// ValueError for bad options (counts < 1, node_rank outside [0, nnodes), a port outside
// 1..65535, an empty argv) and DistError when no free port or pipe can be had.
int launch(const LaunchOptions& options, const std::vector<std::string>& argv);

// A free TCP port on 127.0.0.1 (bind port 0, read it, close). Another process may take it
// before it is used; the store then fails to bind with an error that names it.
int free_port();

// mp.spawn. In a worker (the environment holds a launcher's contract, launched_by_launcher()
// in env.h) runs fn(rank, world_size) from that contract and returns 0, or prints
// "rank R: error: what" to stderr and returns 1 when fn throws. Otherwise re-executes this
// program (/proc/self/exe, the same argv) nprocs times as a standalone one-node job -- only
// options.run_id, grace and prefix_output are used -- and supervises the workers exactly like
// launch(), returning its exit code. The program calls it first thing, before touching CUDA:
//
//   int main() { return spawn(2, [](int rank, int world) { ... }); }
int spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
          LaunchOptions options = {});

}  // namespace tandem::parallel::distributed
