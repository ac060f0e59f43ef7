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
// and returns 1. Each worker runs in its own process group, so whatever the worker started
// dies with it, and Ctrl-C in a terminal reaches the launcher alone, which forwards it. A
// worker's pid is signalled only while the launcher has not reaped it (Note [reaped workers
// are never signalled] in launch.cpp): a reused pid is never hit.
//
// Signals (Note [signals to the launcher] in launch.cpp): SIGINT, SIGTERM, SIGHUP and SIGQUIT
// go to every worker's process group, then the same grace and SIGKILL, and the launcher
// returns 128 + the signal (130, 143, 129, 131), as torchrun does; a second one while
// stopping kills at once. SIGUSR1 and SIGUSR2 go to every worker's process group and the job
// goes on (Slurm's --signal, "checkpoint now"). A signal the launcher was started with ignored
// (nohup) stays ignored, in the workers too. A launcher killed outright (SIGKILL, the OOM
// killer) takes its workers with it: each worker has SIGKILL as its parent-death signal (Note
// [workers die with the launcher] in launch_process.h).
//
// Output: with prefix_output, each worker's stdout and stderr come back to the launcher, which
// relays whole lines, each as "[rank N] line", to its own stdout and stderr; a last line
// without '\n' is flushed at EOF. The worker's stdout is a pseudo-terminal, so that C stdio,
// iostreams and Python line-buffer it and the ranks' lines arrive as they are printed, not at
// exit (Note [line-buffered workers] in launch_process.h; isatty(1) is true in a worker, as
// under mpirun); its stderr is a pipe. Without prefix_output, workers write to the launcher's
// streams directly. The relay itself is launch_relay.h.
//
// Workers are started with vfork and exec: the launcher's memory is never duplicated and the
// child makes only system calls before exec, so calling these from a process that already
// uses CUDA or threads is safe. One launch()/spawn() at a time per process (they install
// signal handlers for their duration and restore them on return).
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
  // A single-node job whose store the launcher serves itself on a free port of 127.0.0.1
  // (master_addr and master_port are ignored; needs nnodes == 1; Note [the launcher hosts the
  // store] in launch.cpp).
  bool standalone = false;
  // TANDEM_JOB_ID for the workers; empty: random hex on one node, "<addr>:<port>:<world>" when
  // nnodes > 1 (every node's launcher derives the same one).
  std::string run_id;
  std::chrono::milliseconds grace{5000};  // between SIGTERM and SIGKILL
  bool prefix_output = true;              // "[rank N] " before every line of each worker
};

// Starts nproc_per_node copies of argv (argv[0] resolved through PATH), supervises them and
// returns the launcher's exit code: 0 when every worker exited 0; 1 after a failure (Note [one
// failure stops the job]); 128 + the signal after SIGINT, SIGTERM, SIGHUP or SIGQUIT; 127 when
// argv[0] cannot be run ("tandem-run: cannot run 'prog': No such file or directory", nothing
// left running). Throws
// ValueError for bad options (counts < 1, node_rank outside [0, nnodes), a port outside
// 1..65535, an empty argv) and DistError when no free port or pipe can be had.
int launch(const LaunchOptions& options, const std::vector<std::string>& argv);

// A free TCP port on 127.0.0.1 (bind port 0, read it, close). Another process may take it
// before it is used; the store then fails to bind with an error that names it. A launcher
// that needs a port for certain hosts the store itself (LaunchOptions::standalone).
int free_port();

// mp.spawn: re-executes this program (/proc/self/exe, the same argv) nprocs times as a
// standalone one-node job -- only options.run_id, grace and prefix_output are used --
// supervises the workers exactly like launch() and returns its exit code. In each of those
// workers it runs fn(rank, world_size) from the contract and returns 0, or prints
// "rank R: error: what" to stderr and returns 1 when fn throws. The program calls it first
// thing, before touching CUDA:
//
//   int main() { return spawn(2, [](int rank, int world) { ... }); }
//
// Inside another launcher's environment (Note [spawn inside a launcher] in launch.cpp): a job
// of one process (srun -n1, mpirun -np 1, torchrun --nproc-per-node 1) still gets nprocs
// ranks; a rank of a launched job of exactly nprocs runs fn as that rank (the launcher has
// started them); a rank of a job of another size is a DistError naming the launcher's
// variables. ValueError when nprocs < 1.
int spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
          LaunchOptions options = {});

}  // namespace tandem::parallel::distributed
