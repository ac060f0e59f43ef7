#include "parallel/distributed/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
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
#include <mutex>
#include <random>
#include <sstream>

#include "core/error.h"
#include "parallel/distributed/env.h"

extern char** environ;

namespace tandem::parallel::distributed {

namespace {

using Clock = std::chrono::steady_clock;

// Writes everything, retrying on EINTR; gives up silently when the reader is gone (the
// launcher must keep supervising even if nobody reads its output any more).
void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

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

// The self-pipe and the handlers, for the duration of one supervision; restores what was
// there before. SIGPIPE is ignored meanwhile so that a closed stdout (`tandem-run ... | head`)
// does not kill the launcher and orphan the workers.
class SignalScope {
 public:
  SignalScope() {
    int fds[2];
    TANDEM_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, Dist,
                 "launch: cannot create a pipe: ", std::strerror(errno));
    read_fd_ = fds[0];
    g_wake_write = fds[1];
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < 2; ++i) ::sigaction(kForwarded[i], &sa, &old_[i]);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    ::sigaction(SIGCHLD, &sa, &old_[2]);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, &old_[3]);
  }
  ~SignalScope() {
    for (size_t i = 0; i < 2; ++i) ::sigaction(kForwarded[i], &old_[i], nullptr);
    ::sigaction(SIGCHLD, &old_[2], nullptr);
    ::sigaction(SIGPIPE, &old_[3], nullptr);
    ::close(g_wake_write);
    ::close(read_fd_);
    g_wake_write = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int fd() const { return read_fd_; }
  // What a worker resets to the default before exec: the signals this scope changed, except
  // those the launcher itself was started with ignored, which the worker keeps ignoring as any
  // child would.
  sigset_t worker_defaults() const {
    sigset_t set;
    sigemptyset(&set);
    const int sigs[4] = {kForwarded[0], kForwarded[1], SIGCHLD, SIGPIPE};
    for (size_t i = 0; i < 4; ++i)
      if (old_[i].sa_handler != SIG_IGN) sigaddset(&set, sigs[i]);
    return set;
  }
  // The signals that arrived since the last call, in order.
  std::vector<int> take() {
    std::vector<int> sigs;
    unsigned char buf[64];
    ssize_t n;
    while ((n = ::read(read_fd_, buf, sizeof buf)) > 0) sigs.insert(sigs.end(), buf, buf + n);
    return sigs;
  }

  static constexpr int kForwarded[2] = {SIGINT, SIGTERM};

 private:
  int read_fd_ = -1;
  struct sigaction old_[4]{};
};

// One worker stream through a pipe: relays complete lines, each with the rank's prefix.
struct Relay {
  int fd = -1;  // read end, non-blocking; -1 once closed
  int target = STDOUT_FILENO;
  std::string prefix;
  std::string pending;  // bytes after the last '\n'

  // Reads whatever is there now; at EOF flushes a last partial line and closes.
  void pump() {
    char buf[65536];
    while (fd >= 0) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        pending.append(buf, static_cast<size_t>(n));
        emit_lines();
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && errno == EAGAIN) {
        return;
      } else {
        close();  // EOF or a read error
      }
    }
  }
  void close() {
    if (fd < 0) return;
    ::close(fd);
    fd = -1;
    if (!pending.empty()) {
      const std::string text = prefix + pending + "\n";
      write_all(target, text.data(), text.size());
      pending.clear();
    }
  }

 private:
  // One write() for all the complete lines of a read, so lines of different workers interleave
  // only at line boundaries. A line longer than 64 KiB is cut, so that a worker printing
  // without newlines cannot grow the buffer without bound.
  void emit_lines() {
    std::string text;
    size_t start = 0, nl;
    while ((nl = pending.find('\n', start)) != std::string::npos) {
      text.append(prefix).append(pending, start, nl + 1 - start);
      start = nl + 1;
    }
    pending.erase(0, start);
    if (pending.size() > 65536) {
      text.append(prefix).append(pending).append("\n");
      pending.clear();
    }
    if (!text.empty()) write_all(target, text.data(), text.size());
  }
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  Relay out, err;
};

std::string random_hex() {
  std::random_device rd;
  std::ostringstream os;
  os << std::hex << std::setfill('0');
  for (int i = 0; i < 2; ++i) os << std::setw(8) << static_cast<uint32_t>(rd());
  return os.str();
}

// KEY=value entries of this process's environment with the contract put over them.
std::vector<std::string> worker_environment(const LaunchOptions& o, int rank, int local_rank,
                                            const std::string& job_id) {
  const std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TANDEM_JOB_ID", job_id}};
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& [k, v] : set) replaced = replaced || key == k;
    if (!replaced) env.push_back(entry);
  }
  for (const auto& [k, v] : set) env.push_back(k + "=" + v);
  for (const char* key : {"OMP_NUM_THREADS", "NCCL_NVLS_ENABLE"})
    if (!std::getenv(key)) env.push_back(std::string(key) + (key[0] == 'O' ? "=1" : "=0"));
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Starts one worker in its own process group (pgid = its pid), its stdout and stderr on fresh
// pipes when prefixing. Returns the posix_spawn error (0 on success); exec errors are among
// them, since glibc reports them from the child before the call returns.
int start_worker(Worker& w, const std::string& program, bool search_path,
                 std::vector<std::string> argv, std::vector<std::string> env, bool prefix,
                 const sigset_t& defaults) {
  int out[2] = {-1, -1}, err[2] = {-1, -1};
  if (prefix) {
    const bool ok = ::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0;
    if (!ok) {
      const int saved = errno;
      for (int fd : {out[0], out[1]})
        if (fd >= 0) ::close(fd);
      TANDEM_THROW(Dist, "launch: cannot create a pipe for rank ", w.rank, ": ",
                   std::strerror(saved));
    }
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (prefix) {
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
  }
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  // The launcher's own dispositions (its handlers, SIGPIPE ignored) are not the worker's.
  posix_spawnattr_setsigdefault(&attr, &defaults);

  std::vector<char*> cargv = c_strings(argv), cenv = c_strings(env);
  pid_t pid = -1;
  const int rc =
      search_path
          ? ::posix_spawnp(&pid, program.c_str(), &actions, &attr, cargv.data(), cenv.data())
          : ::posix_spawn(&pid, program.c_str(), &actions, &attr, cargv.data(), cenv.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (prefix) {
    ::close(out[1]);
    ::close(err[1]);
  }
  if (rc != 0) {
    if (prefix) {
      ::close(out[0]);
      ::close(err[0]);
    }
    return rc;
  }
  w.pid = pid;
  w.running = true;
  if (prefix) {
    const std::string tag = "[rank " + std::to_string(w.rank) + "] ";
    w.out = Relay{out[0], STDOUT_FILENO, tag, {}};
    w.err = Relay{err[0], STDERR_FILENO, tag, {}};
    for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  return 0;
}

std::mutex g_one_launch;

// launch() and spawn(): start, supervise, stop. Note [one failure stops the job].
int run_job(LaunchOptions o, const std::string& program, bool search_path,
            const std::vector<std::string>& argv) {
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
  if (o.standalone) {
    o.master_addr = "127.0.0.1";
    o.master_port = free_port();
  }
  const int world = o.nproc_per_node * o.nnodes;
  std::string job_id = o.run_id;
  if (job_id.empty())
    job_id = o.nnodes > 1
                 ? o.master_addr + ":" + std::to_string(o.master_port) + ":" + std::to_string(world)
                 : random_hex();

  SignalScope signals;  // before the first worker: its SIGCHLD must not be missed
  std::vector<Worker> workers(static_cast<size_t>(o.nproc_per_node));
  bool stopping = false, killed = false;
  int result = 0;
  Clock::time_point kill_at;
  auto signal_groups = [&](int sig) {
    for (const Worker& w : workers)
      if (w.running) ::kill(-w.pid, sig);
  };
  auto begin_stop = [&](int sig) {
    signal_groups(sig);
    stopping = true;
    kill_at = Clock::now() + o.grace;
  };
  auto count_running = [&] {
    int n = 0;
    for (const Worker& w : workers) n += w.running ? 1 : 0;
    return n;
  };

  for (int local = 0; local < o.nproc_per_node; ++local) {
    Worker& w = workers[static_cast<size_t>(local)];
    w.rank = o.node_rank * o.nproc_per_node + local;
    int rc = 0;
    try {
      rc = start_worker(w, program, search_path, argv, worker_environment(o, w.rank, local, job_id),
                        o.prefix_output, signals.worker_defaults());
    } catch (...) {
      // Out of pipes (or memory) half way: the workers already started must not outlive us.
      for (Worker& started : workers)
        if (started.running) {
          ::kill(-started.pid, SIGKILL);
          ::waitpid(started.pid, nullptr, 0);
        }
      throw;
    }
    if (rc != 0) {
      say("cannot run '" + argv[0] + "': " + std::strerror(rc));
      result = 127;
      begin_stop(SIGTERM);  // the ones already started
      break;
    }
  }

  std::vector<pollfd> fds;
  std::vector<Relay*> relays;
  while (true) {
    for (Worker& w : workers) {
      if (!w.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(w.pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w.running = false;
      if (r < 0) continue;  // reaped elsewhere: nothing to report
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (ok || stopping) continue;
      // Its last words (the error that made it exit) come before the launcher's line.
      w.out.pump();
      w.err.pump();
      std::string how = WIFEXITED(status)
                            ? "exited with code " + std::to_string(WEXITSTATUS(status))
                            : "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
                                  signal_name(WTERMSIG(status)) + ")";
      say("rank " + std::to_string(w.rank) + " (pid " + std::to_string(w.pid) + ") " + how +
          "; stopping the other " + std::to_string(count_running()) + " worker(s)");
      result = 1;
      ::kill(-w.pid, SIGTERM);  // what it started, if anything is left of its group
      begin_stop(SIGTERM);
    }
    if (count_running() == 0) break;

    const auto now = Clock::now();
    if (stopping && !killed && now >= kill_at) {
      signal_groups(SIGKILL);
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

    for (int sig : signals.take()) {
      if (sig != SIGINT && sig != SIGTERM) continue;  // SIGCHLD: the reap above handles it
      if (stopping) {
        // A second Ctrl-C while stopping: no more grace.
        signal_groups(SIGKILL);
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
  // Nothing is left behind: whatever the workers started in their groups goes too.
  if (stopping)
    for (const Worker& w : workers)
      if (w.pid > 0) ::kill(-w.pid, SIGKILL);
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

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(fd >= 0, Dist, "free_port: cannot create a socket: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int saved = errno;
  ::close(fd);
  TANDEM_CHECK(ok, Dist, "free_port: cannot bind 127.0.0.1:0: ", std::strerror(saved));
  return ntohs(addr.sin_port);
}

int launch(const LaunchOptions& options, const std::vector<std::string>& argv) {
  return run_job(options, argv.empty() ? std::string() : argv[0], /*search_path=*/true, argv);
}

int spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
          LaunchOptions options) {
  if (launched_by_launcher()) {
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
  TANDEM_CHECK(nprocs >= 1, Value, "spawn: nprocs must be >= 1, got ", nprocs);
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
  return run_job(options, exe, /*search_path=*/false, argv);
}

}  // namespace tandem::parallel::distributed
