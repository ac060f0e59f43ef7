#pragma once
// The launcher's part that touches processes: start one worker so that it dies with its
// launcher, and give it a stdout that is line-buffered. launch.cpp supervises; this starts.
//
// Note [workers die with the launcher]: a launcher killed outright (SIGKILL, the OOM killer)
// cannot stop its workers, which would keep the GPUs and the store's port. Each worker asks the
// kernel, between fork and exec, for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG),
// then compares getppid() with the launcher's pid taken before the fork: a launcher that died
// before the prctl has already handed the child to another parent, and the child exits instead
// of running. The signal follows the death of the *thread* that started the worker, which is
// the one that supervises it until it exits. What a worker starts itself is its own business
// (the signal is not inherited across fork); its process group goes when the launcher stops
// the job, not when the launcher is killed.
//
// Note [line-buffered workers]: C stdio (and C++ iostreams, and Python) buffer stdout by blocks
// when it is a pipe, so through a pipe all of one rank's lines would arrive at its exit. A
// worker's stdout is therefore the slave side of a pseudo-terminal in raw mode (no "\r\n", no
// echo), which stdio line-buffers, as OpenMPI's mpirun does; stderr stays a pipe (it is
// unbuffered anyway, and progress bars drawn on a terminal stay off). Where no pseudo-terminal
// can be had, stdout is a pipe. The launcher reads the master side; a read error (EIO, the
// last slave closed) is its end of file.
#include <sys/types.h>

#include <string>
#include <vector>

namespace tandem::parallel::distributed::detail {

// The read ends a worker's output comes back through (-1 where it writes to the launcher's
// own streams).
struct WorkerOutput {
  int out = -1;  // master of a pseudo-terminal (or a pipe's read end)
  int err = -1;  // a pipe's read end
};

struct WorkerSpec {
  std::string program;  // run as is when search_path is false or it contains '/'
  bool search_path = true;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // KEY=value
  bool capture_output = true;    // false: the worker inherits the launcher's stdout and stderr
  // Signals the launcher ignores for itself (SIGPIPE) that the worker gets with their default
  // action; every signal with a handler gets its default action too, as exec would do, and
  // every other ignored one stays ignored.
  std::vector<int> reset_to_default;
};

// Starts the worker in its own process group (pgid = its pid) with a SIGKILL parent-death
// signal. Returns 0 and sets pid and output, or the errno that made the start fail (the exec's
// among them: "No such file or directory"), nothing left running then. Throws DistError when
// no pipe can be had.
int start_worker_process(const WorkerSpec& spec, pid_t& pid, WorkerOutput& output);

}  // namespace tandem::parallel::distributed::detail
