#include "parallel/distributed/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>

#include "core/error.h"
#include "parallel/distributed/env.h"
#include "parallel/distributed/launch_process.h"
#include "parallel/distributed/launch_relay.h"
#include "parallel/distributed/store.h"

extern char** environ;

namespace tandem::parallel::distributed {

namespace {

using Clock = std::chrono::steady_clock;

using detail::Relay;
using detail::write_all;

void say(const std::string& line) {
  const std::string text = "tandem-run: " + line + "\n";
  write_all(STDERR_FILENO, text.data(), text.size());
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    default:
      return "SIG" + std::to_string(sig);
  }
}

// Note [the self-pipe]: the signal handlers only write the signal number into a pipe, which
// the supervision loop polls next to the workers' output, so a SIGCHLD, a Ctrl-C and a line
// of output all wake the same poll() and are handled outside signal context.
int g_wake_write = -1;

void on_signal(int sig) {
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t w = ::write(g_wake_write, &byte, 1);
  errno = saved;
}

// Note [signals to the launcher]: what torchrun does with SIGINT, SIGTERM, SIGHUP (a closed
// ssh session) and SIGQUIT: send the same signal to every worker, SIGKILL after the grace,
// exit 128 + signal. SIGUSR1 and SIGUSR2 (Slurm's --signal, "checkpoint now") are sent on to
// every worker and the job goes on. A signal the launcher was started with ignored (nohup,
// a shell's `&`) stays ignored, and the workers inherit that.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
constexpr int kRelayedSignals[] = {SIGUSR1, SIGUSR2};

bool is_stop_signal(int sig) {
  return std::find(std::begin(kStopSignals), std::end(kStopSignals), sig) != std::end(kStopSignals);
}
bool is_relayed_signal(int sig) {
  return std::find(std::begin(kRelayedSignals), std::end(kRelayedSignals), sig) !=
         std::end(kRelayedSignals);
}

// The self-pipe and the handlers, for the duration of one supervision; restores what was
// there before. SIGPIPE is ignored meanwhile so that a closed stdout (`tandem-run ... | head`,
// a dropped ssh session) does not kill the launcher and orphan the workers.
class SignalScope {
 public:
  SignalScope() {
    int fds[2];
    TANDEM_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, Dist,
                 "launch: cannot create a pipe: ", std::strerror(errno));
    read_fd_ = fds[0];
    g_wake_write = fds[1];
    struct sigaction handle {};
    handle.sa_handler = on_signal;
    sigemptyset(&handle.sa_mask);
    handle.sa_flags = SA_RESTART;
    for (int sig : kStopSignals) install(sig, handle, /*unless_ignored=*/true);
    for (int sig : kRelayedSignals) install(sig, handle, /*unless_ignored=*/true);
    handle.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    install(SIGCHLD, handle, false);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    pipe_was_default_ = install(SIGPIPE, ignore, false) == SIG_DFL;
  }
  ~SignalScope() {
    for (const auto& [sig, old] : saved_) ::sigaction(sig, &old, nullptr);
    ::close(g_wake_write);
    ::close(read_fd_);
    g_wake_write = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int fd() const { return read_fd_; }
  // What a worker gets back with its default action besides the handled signals: SIGPIPE,
  // unless the launcher itself was started with it ignored.
  std::vector<int> worker_defaults() const {
    return pipe_was_default_ ? std::vector<int>{SIGPIPE} : std::vector<int>{};
  }
  // The signals that arrived since the last call, in order.
  std::vector<int> take() {
    std::vector<int> sigs;
    unsigned char buf[64];
    ssize_t n;
    while ((n = ::read(read_fd_, buf, sizeof buf)) > 0) sigs.insert(sigs.end(), buf, buf + n);
    return sigs;
  }

 private:
  // Returns the disposition that was there.
  sighandler_t install(int sig, const struct sigaction& sa, bool unless_ignored) {
    struct sigaction old {};
    ::sigaction(sig, nullptr, &old);
    if (unless_ignored && old.sa_handler == SIG_IGN) return SIG_IGN;
    ::sigaction(sig, &sa, &old);
    saved_.emplace_back(sig, old);
    return old.sa_handler;
  }

  int read_fd_ = -1;
  bool pipe_was_default_ = false;
  std::vector<std::pair<int, struct sigaction>> saved_;
};

// Note [reaped workers are never signalled]: a worker's pid is its process group's id, and
// both can be reused by an unrelated process once the worker is reaped. So an exit is only
// observed (waitid with WNOWAIT) and the worker stays a zombie -- its pid and group id held --
// until the job is over; every signal to a group is sent before its leader is reaped.
struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;  // started and not seen to exit
  bool reaped = false;   // its pid may belong to another process now: never signal it
  Relay out, err;

  bool signallable() const { return pid > 0 && !reaped; }
};

std::string random_hex() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << std::setfill('0');
  for (int i = 0; i < 2; ++i) os << std::setw(8) << static_cast<uint32_t>(rd());
  return os.str();
}

// The variable that marks spawn()'s own workers: the pid of the process that spawned them.
constexpr const char* kSpawnParentVar = "TANDEM_SPAWN_PARENT";

// KEY=value entries of this process's environment with the contract put over them (and
// `extra`, KEY=value entries of the caller's). TORCHELASTIC_USE_AGENT_STORE describes a
// torchrun agent around the launcher, not the launcher the workers have: it is dropped, or
// their store would move to MASTER_PORT + 1 (Note [under torchrun's own store] in env.cpp).
std::vector<std::string> worker_environment(const LaunchOptions& o, int rank, int local_rank,
                                            const std::string& job_id,
                                            const std::vector<std::string>& extra) {
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TANDEM_JOB_ID", job_id},
      {"TANDEM_STORE_HOSTED", o.standalone ? "1" : "0"}};
  for (const std::string& entry : extra) {
    const size_t eq = entry.find('=');
    set.emplace_back(entry.substr(0, eq), eq == std::string::npos ? "" : entry.substr(eq + 1));
  }
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    // A hosted store is at MASTER_PORT: a TANDEM_STORE_PORT inherited from outside would send
    // the workers elsewhere.
    bool replaced = key == "TORCHELASTIC_USE_AGENT_STORE" || key == "TANDEM_STORE_HOSTED" ||
                    (o.standalone && key == "TANDEM_STORE_PORT");
    for (const auto& [k, v] : set) replaced = replaced || key == k;
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  for (const char* key : {"OMP_NUM_THREADS", "NCCL_NVLS_ENABLE"})
    if (!std::getenv(key)) env.push_back(std::string(key) + (key[0] == 'O' ? "=1" : "=0"));
  return env;
}

std::mutex g_one_launch;

// launch() and spawn(): start, supervise, stop. Note [one failure stops the job].
int run_job(LaunchOptions o, const std::string& program, bool search_path,
            const std::vector<std::string>& argv, const std::vector<std::string>& extra_env = {}) {
  TANDEM_CHECK(o.nproc_per_node >= 1, Value, "launch: nproc_per_node must be >= 1, got ",
               o.nproc_per_node);
  TANDEM_CHECK(o.nnodes >= 1, Value, "launch: nnodes must be >= 1, got ", o.nnodes);
  TANDEM_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, Value, "launch: node_rank ", o.node_rank,
               " is not in [0, nnodes ", o.nnodes, ")");
  TANDEM_CHECK(!o.standalone || o.nnodes == 1, Value,
               "launch: standalone is one node, but nnodes is ", o.nnodes);
  TANDEM_CHECK(o.standalone || (o.master_port >= 1 && o.master_port <= 65535), Value,
               "launch: master_port ", o.master_port, " is not in 1..65535");
  TANDEM_CHECK(o.standalone || !o.master_addr.empty(), Value, "launch: master_addr is empty");
  TANDEM_CHECK(o.grace.count() >= 0, Value, "launch: grace must be >= 0 ms, got ", o.grace.count());
  TANDEM_CHECK(!argv.empty() && !argv[0].empty(), Value, "launch: no program to run");

  std::unique_lock<std::mutex> one(g_one_launch, std::try_to_lock);
  TANDEM_CHECK(one.owns_lock(), Value,
               "launch: another launch() or spawn() is running in this "
               "process");
  const int world = o.nproc_per_node * o.nnodes;
  std::string job_id = o.run_id;
  if (job_id.empty())
    job_id = o.nnodes > 1
                 ? o.master_addr + ":" + std::to_string(o.master_port) + ":" + std::to_string(world)
                 : random_hex();
  // Note [the launcher hosts the store]
  // A standalone job's store could be rank 0's, on a port the launcher picked with free_port():
  // but between the launcher closing that probe and rank 0 binding it, any other process on the
  // machine may be handed the same number (another job's store, or the local end of an outgoing
  // connection), and this job's ranks then meet a stranger or no one. So the launcher binds
  // port 0 itself and serves the store for the life of the job, as torchrun's agent does; the
  // workers learn it from TANDEM_STORE_HOSTED=1 and rank 0 connects like every other rank. A rank
  // that dies no longer takes the store with it: the others see it marked gone (Note
  // [disconnect tracking] in store_server.cpp) while the launcher stops them.
  std::unique_ptr<TCPStoreServer> hosted;
  if (o.standalone) {
    TCPStoreOptions so;
    so.job_id = job_id;
    so.world_size = world;
    so.local_world_size = o.nproc_per_node;
    o.master_addr = "127.0.0.1";
    hosted = std::make_unique<TCPStoreServer>(o.master_addr, 0, so);
    o.master_port = hosted->port();
  }

  SignalScope signals;  // before the first worker: its SIGCHLD must not be missed
  std::vector<Worker> workers(static_cast<size_t>(o.nproc_per_node));
  bool stopping = false, killed = false;
  int result = 0;
  Clock::time_point kill_at;
  // Only workers not yet seen to exit: Note [reaped workers are never signalled].
  auto signal_running = [&](int sig) {
    for (const Worker& w : workers)
      if (w.running) ::kill(-w.pid, sig);
  };
  auto begin_stop = [&](int sig) {
    signal_running(sig);
    stopping = true;
    kill_at = Clock::now() + o.grace;
  };
  auto count_running = [&] {
    int n = 0;
    for (const Worker& w : workers) n += w.running ? 1 : 0;
    return n;
  };
  auto reap_all = [&] {
    for (Worker& w : workers)
      if (w.signallable()) {
        while (::waitpid(w.pid, nullptr, 0) < 0 && errno == EINTR) {
        }
        w.reaped = true;
        w.running = false;
      }
  };

  detail::WorkerSpec spec;
  spec.program = program;
  spec.search_path = search_path;
  spec.argv = argv;
  spec.capture_output = o.prefix_output;
  spec.reset_to_default = signals.worker_defaults();
  for (int local = 0; local < o.nproc_per_node; ++local) {
    Worker& w = workers[static_cast<size_t>(local)];
    w.rank = o.node_rank * o.nproc_per_node + local;
    spec.env = worker_environment(o, w.rank, local, job_id, extra_env);
    detail::WorkerOutput output;
    int rc = 0;
    try {
      rc = detail::start_worker_process(spec, w.pid, output);
    } catch (...) {
      // Out of pipes (or memory) half way: the workers already started must not outlive us.
      for (Worker& started : workers)
        if (started.running) ::kill(-started.pid, SIGKILL);
      reap_all();
      throw;
    }
    if (rc != 0) {
      w.pid = -1;
      say("cannot run '" + argv[0] + "': " + std::strerror(rc));
      result = 127;
      begin_stop(SIGTERM);  // the ones already started
      break;
    }
    w.running = true;
    const std::string tag = "[rank " + std::to_string(w.rank) + "] ";
    w.out = Relay{output.out, STDOUT_FILENO, tag, {}};
    w.err = Relay{output.err, STDERR_FILENO, tag, {}};
  }

  std::vector<pollfd> fds;
  std::vector<Relay*> relays;
  while (true) {
    for (Worker& w : workers) {
      if (!w.running) continue;
      siginfo_t info{};
      const int r = ::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r == 0 && info.si_pid == 0) continue;  // still running
      w.running = false;
      if (r < 0) {
        w.reaped = true;  // reaped elsewhere: nothing to report, and not ours to signal
        continue;
      }
      const bool exited = info.si_code == CLD_EXITED;
      const bool ok = exited && info.si_status == 0;
      if (ok || stopping) continue;
      // Its last words (the error that made it exit) come before the launcher's line.
      w.out.pump();
      w.err.pump();
      std::string how = exited ? "exited with code " + std::to_string(info.si_status)
                               : "was killed by signal " + std::to_string(info.si_status) + " (" +
                                     signal_name(info.si_status) + ")";
      say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " + how +
          "; stopping the other " + std::to_string(count_running()) + " worker(s)");
      result = 1;
      ::kill(-w.pid, SIGTERM);  // what it started, if anything is left of its group
      begin_stop(SIGTERM);
    }
    if (count_running() == 0) break;

    const auto now = Clock::now();
    if (stopping && !killed && now >= kill_at) {
      signal_running(SIGKILL);
      killed = true;
    }
    int timeout_ms = 1000;  // a safety net only: SIGCHLD wakes the poll
    if (stopping && !killed)
      timeout_ms =
          static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(kill_at - now).count());

    fds.assign(1, pollfd{signals.fd(), POLLIN, 0});
    relays.assign(1, nullptr);
    for (Worker& w : workers)
      for (Relay* r : {&w.out, &w.err})
        if (r->fd >= 0) {
          fds.push_back(pollfd{r->fd, POLLIN, 0});
          relays.push_back(r);
        }
    if (::poll(fds.data(), fds.size(), std::max(timeout_ms, 0)) < 0 && errno != EINTR) break;

    // Note [signals to the launcher].
    for (int sig : signals.take()) {
      if (is_relayed_signal(sig)) {
        say("got " + signal_name(sig) + "; forwarding it to " + std::to_string(count_running()) +
            " worker(s)");
        signal_running(sig);
        continue;
      }
      if (!is_stop_signal(sig)) continue;  // SIGCHLD: the waitid above handles it
      if (stopping) {
        // A second Ctrl-C while stopping: no more grace.
        signal_running(SIGKILL);
        killed = true;
        continue;
      }
      say("got " + signal_name(sig) + "; stopping " + std::to_string(count_running()) +
          " worker(s)");
      result = 128 + sig;
      begin_stop(sig);
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents != 0) relays[i]->pump();
  }

  // Every worker has exited, so everything it wrote is in its pipes: drain and close them,
  // even if something it started still holds a write end.
  for (Worker& w : workers) {
    w.out.pump();
    w.err.pump();
    w.out.close();
    w.err.close();
  }
  // Nothing is left behind: whatever the workers started in their groups goes too, while
  // their leaders (zombies now) still hold the groups' ids. (Workers still running here are
  // those of a poll() that failed: the launcher gives up on them, they go too.)
  if (stopping || count_running() > 0)
    for (const Worker& w : workers)
      if (w.signallable()) ::kill(-w.pid, SIGKILL);
  reap_all();
  return result;
}

std::vector<std::string> own_argv() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  size_t start = 0;
  while (start < all.size()) {
    const size_t end = all.find('\0', start);
    argv.push_back(all.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return argv;
}

}  // namespace

// Note [free ports outside the ephemeral range]
// bind(port 0) and the local end of every outgoing connection draw from the same range
// (net.ipv4.ip_local_port_range, 32768-60999 by default), so a port found that way and let go is
// soon handed to someone else on a busy machine: a test suite whose jobs open hundreds of
// connections a second meets that within minutes. The kernel never picks a port below that range
// by itself, so free_port() tries random ports there first (a port some service listens on
// fails to bind and is skipped); only when the range starts too low to leave room does it fall
// back to port 0.
namespace {

bool bindable(int port, int& bound) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(fd >= 0, Dist, "free_port: cannot create a socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  bound = ntohs(addr.sin_port);
  return ok;
}

int ephemeral_low() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  return in >> low >> high ? low : 32768;
}

}  // namespace

int free_port() {
  constexpr int kLowest = 10000;  // above the well-known and most registered services
  const int low = ephemeral_low();
  if (low - kLowest >= 1000) {
    std::random_device rd;
    std::uniform_int_distribution<int> pick(kLowest, low - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      int bound = 0;
      if (bindable(pick(rd), bound)) return bound;
    }
  }
  int bound = 0;
  TANDEM_CHECK(bindable(0, bound), Dist, "free_port: cannot bind 127.0.0.1:0: ", std::strerror(errno));
  return bound;
}

int launch(const LaunchOptions& options, const std::vector<std::string>& argv) {
  return run_job(options, argv.empty() ? std::string() : argv[0], /*search_path=*/true, argv);
}

int spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
          LaunchOptions options) {
  TANDEM_CHECK(nprocs >= 1, Value, "spawn: nprocs must be >= 1, got ", nprocs);
  // Note [spawn inside a launcher]: a launcher's contract alone does not make this process one
  // of spawn's workers. srun -n1, mpirun -np 1 and torchrun --nproc-per-node 1 describe a job
  // of one process, and spawn(N) must still start N ranks there (their contract, put over the
  // outer one, comes first in env.h's order). Only the workers spawn started -- their parent's
  // pid in TANDEM_SPAWN_PARENT -- run fn at once. A rank of a launched job of exactly nprocs
  // runs fn as that rank (the launcher started what spawn would have); a rank of a job of
  // another size is refused.
  const char* parent = std::getenv(kSpawnParentVar);
  bool run_here = parent != nullptr && std::to_string(::getppid()) == parent;
  if (!run_here && launched_by_launcher()) {
    const DistEnv outer = read_dist_env();
    if (outer.world_size > 1) {
      const bool slurm = outer.source == "slurm", mpi = outer.source == "openmpi";
      const std::string rank_var = slurm ? "SLURM_PROCID" : mpi ? "OMPI_COMM_WORLD_RANK" : "RANK";
      const std::string size_var = slurm ? "SLURM_NTASKS"
                                   : mpi ? "OMPI_COMM_WORLD_SIZE"
                                         : "WORLD_SIZE";
      TANDEM_CHECK(outer.world_size == nprocs, Dist, "spawn(", nprocs,
                   "): this process is already rank ", outer.rank, " of ", outer.world_size, " (",
                   outer.source, ": ", rank_var, "=", outer.rank, ", ", size_var, "=",
                   outer.world_size, "); spawn(", nprocs,
                   ") starts its ranks itself in a job of one process, ",
                   "and is one of them only in a job of exactly ", nprocs, ": launch 1 or ", nprocs,
                   " processes (or none)");
      run_here = true;
    }
  }
  if (run_here) {
    const char* rank_var = std::getenv("RANK");
    std::string rank = rank_var ? rank_var : "?";
    try {
      const DistEnv env = read_dist_env();
      rank = std::to_string(env.rank);
      fn(env.rank, env.world_size);
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %s: error: %s\n", rank.c_str(), e.what());
      std::fflush(stderr);
      return 1;
    }
  }
  options.nproc_per_node = nprocs;
  options.nnodes = 1;
  options.node_rank = 0;
  options.standalone = true;
  // Re-executing the binary, never a bare fork(): the child starts clean, so a parent that
  // touched CUDA (or holds threads and locks) cannot hand a broken state to its workers.
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  TANDEM_CHECK(n > 0, Dist, "spawn: cannot read /proc/self/exe: ", std::strerror(errno));
  exe[n] = '\0';
  std::vector<std::string> argv = own_argv();
  if (argv.empty()) argv.push_back(exe);
  return run_job(options, exe, /*search_path=*/false, argv,
                 {std::string(kSpawnParentVar) + "=" + std::to_string(::getpid())});
}

}  // namespace tandem::parallel::distributed
