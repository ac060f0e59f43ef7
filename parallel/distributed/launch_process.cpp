#include "parallel/distributed/launch_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace tandem::parallel::distributed::detail {

namespace {

// The kernel's signal mask is 64 bits; glibc's sigset_t is larger and its sigprocmask refuses
// to block the two signals it keeps for itself. The raw call blocks them all, as glibc's own
// posix_spawn does around its vfork.
constexpr size_t kKernelSigsetBytes = 8;

int raw_sigmask(int how, const sigset_t* set, sigset_t* old) {
  return static_cast<int>(::syscall(SYS_rt_sigprocmask, how, set, old, kKernelSigsetBytes));
}

// Note [line-buffered workers]. False (and nothing open) where the system has no
// pseudo-terminals.
bool open_pty(int& master, int& slave) {
  master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return false;
  char name[128];
  if (::grantpt(master) != 0 || ::unlockpt(master) != 0 ||
      ::ptsname_r(master, name, sizeof name) != 0) {
    ::close(master);
    return false;
  }
  // O_NOCTTY: a launcher without a controlling terminal (under Slurm, after setsid) must not
  // acquire its worker's.
  slave = ::open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
  termios mode{};
  if (slave < 0 || ::tcgetattr(slave, &mode) != 0) {
    if (slave >= 0) ::close(slave);
    ::close(master);
    return false;
  }
  ::cfmakeraw(&mode);  // bytes as written: no "\n" -> "\r\n", no echo
  ::tcsetattr(slave, TCSANOW, &mode);
  winsize size{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0) ::ioctl(slave, TIOCSWINSZ, &size);
  return true;
}

void close_all(std::initializer_list<int> fds) {
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
}

// Where execvp would look: the program itself when it names a path, else each PATH entry.
std::vector<std::string> exec_candidates(const WorkerSpec& spec) {
  if (!spec.search_path || spec.program.find('/') != std::string::npos) return {spec.program};
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "/bin:/usr/bin";
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = dirs.find(':', start);
    const std::string dir = dirs.substr(start, end == std::string::npos ? end : end - start);
    out.push_back(dir.empty() ? spec.program : dir + "/" + spec.program);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// What the child does between vfork and exec, all of it prepared by the parent.
struct ChildPlan {
  const std::vector<char*>& paths;  // where to try the program, in order
  char* const* argv;
  char* const* envp;
  int out = -1, err = -1;  // become the child's stdout and stderr (-1: inherited)
  const std::vector<int>* reset_to_default;
  pid_t launcher;
};

// vfork, then only system calls in the child (it borrows this process's memory and stack until
// exec: no allocation, no locks, no handler of ours may run). Returns the child's pid, or -1;
// `failure` is the errno of a failed fork or exec (0 when the program runs).
[[gnu::noinline]] pid_t fork_exec(const ChildPlan& plan, int& failure) {
  sigset_t all, saved_mask, none;
  sigfillset(&all);
  sigemptyset(&none);
  raw_sigmask(SIG_BLOCK, &all, &saved_mask);
  volatile int child_errno = 0;  // written by the child, which shares this frame until exec
  const pid_t child = ::vfork();
  if (child == 0) {
    ::setpgid(0, 0);
    for (int sig = 1; sig < NSIG; ++sig) {
      struct sigaction current {};
      if (::sigaction(sig, nullptr, &current) != 0) continue;
      bool reset = current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN;
      for (int s : *plan.reset_to_default) reset = reset || s == sig;
      if (!reset) continue;
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(sig, &dfl, nullptr);
    }
    for (const auto& [fd, target] :
         {std::pair{plan.out, STDOUT_FILENO}, std::pair{plan.err, STDERR_FILENO}}) {
      if (fd < 0) continue;
      if (fd == target)
        ::fcntl(fd, F_SETFD, 0);  // dup2 onto itself would keep O_CLOEXEC
      else
        ::dup2(fd, target);
    }
    // Note [workers die with the launcher].
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != plan.launcher) ::_exit(127);
    raw_sigmask(SIG_SETMASK, &none, nullptr);
    int error = ENOENT;
    for (char* path : plan.paths) {
      ::execve(path, plan.argv, plan.envp);
      // execvp's rules: a directory without the program, or with one we may not run, is not
      // the end of the search; what else fails is.
      if (errno == EACCES) {
        error = EACCES;
      } else if (errno != ENOENT && errno != ENOTDIR) {
        error = errno;
        break;
      }
    }
    child_errno = error;
    ::_exit(127);
  }
  const int fork_errno = errno;
  raw_sigmask(SIG_SETMASK, &saved_mask, nullptr);
  failure = child < 0 ? fork_errno : child_errno;
  return child;
}

}  // namespace

int start_worker_process(const WorkerSpec& spec, pid_t& pid, WorkerOutput& output) {
  // Everything the child needs is made here, before the fork: between vfork and exec the child
  // borrows the launcher's memory and makes system calls only (no allocation, no locks).
  std::vector<std::string> argv = spec.argv, env = spec.env;
  std::vector<std::string> paths = exec_candidates(spec);
  std::vector<char*> cargv = c_strings(argv), cenv = c_strings(env), cpaths = c_strings(paths);
  cpaths.pop_back();

  int out_read = -1, out_write = -1, err[2] = {-1, -1};
  if (spec.capture_output) {
    if (!open_pty(out_read, out_write)) {
      int out[2];
      if (::pipe2(out, O_CLOEXEC) != 0) {
        const int saved = errno;
        TANDEM_THROW(Dist,
                     "launch: cannot create a pipe for a worker's stdout: ", std::strerror(saved));
      }
      out_read = out[0];
      out_write = out[1];
    }
    if (::pipe2(err, O_CLOEXEC) != 0) {
      const int saved = errno;
      close_all({out_read, out_write});
      TANDEM_THROW(Dist,
                   "launch: cannot create a pipe for a worker's stderr: ", std::strerror(saved));
    }
  }

  ChildPlan plan{cpaths,
                 cargv.data(),
                 cenv.data(),
                 spec.capture_output ? out_write : -1,
                 spec.capture_output ? err[1] : -1,
                 &spec.reset_to_default,
                 ::getpid()};
  int failure = 0;
  const pid_t child = fork_exec(plan, failure);
  close_all({out_write, err[1]});

  if (failure != 0) {
    if (child > 0) ::waitpid(child, nullptr, 0);
    close_all({out_read, err[0]});
    return failure;
  }
  pid = child;
  output.out = out_read;
  output.err = err[0];
  for (int fd : {output.out, output.err})
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return 0;
}

}  // namespace tandem::parallel::distributed::detail
