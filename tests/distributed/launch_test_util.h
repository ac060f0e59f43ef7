#pragma once
// Helpers of the launcher's tests: start a process with its output in files, wait for it with a
// deadline, and tell whether a pid is still alive.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "data/data_test_util.h"

extern char** environ;

namespace tandem::test::launch_util {

using Clock = std::chrono::steady_clock;

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

inline size_t count_of(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// A started process whose stdout and stderr go to files of a scratch directory.
struct Child {
  pid_t pid = -1;
  std::string out_path, err_path;
  Clock::time_point started;
};

struct Finished {
  int code = -1;  // exit code, or 128 + signal
  std::string out, err;
  double seconds = 0;
};

inline Child start(const std::vector<std::string>& args, const TempDir& dir,
                   const std::vector<std::string>& extra_env = {}) {
  static int serial = 0;
  Child c;
  c.out_path = dir.file("out" + std::to_string(serial));
  c.err_path = dir.file("err" + std::to_string(serial++));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, c.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, 2, c.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  // An entry of extra_env replaces the variable of the same name; a bare "NAME" unsets it.
  std::vector<std::string> argv = args, env;
  auto key_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    bool replaced = false;
    for (const std::string& x : extra_env) replaced = replaced || key_of(x) == key_of(entry);
    if (!replaced) env.push_back(entry);
  }
  for (const std::string& x : extra_env)
    if (x.find('=') != std::string::npos) env.push_back(x);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  for (auto& e : env) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  c.started = Clock::now();
  const int rc = posix_spawn(&c.pid, argv[0].c_str(), &actions, nullptr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE(rc == 0);
  return c;
}

inline Finished finish(const Child& c, double timeout_s = 15) {
  Finished f;
  int status = 0;
  while (true) {
    const pid_t r = waitpid(c.pid, &status, WNOHANG);
    REQUIRE(r >= 0);
    if (r == c.pid) break;
    if (Clock::now() - c.started > std::chrono::duration<double>(timeout_s)) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      FAIL("the process ran past " << timeout_s << " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  f.seconds = std::chrono::duration<double>(Clock::now() - c.started).count();
  f.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  f.out = read_text(c.out_path);
  f.err = read_text(c.err_path);
  return f;
}

// True while pid names a live process (a zombie waiting for its parent counts as gone).
inline bool alive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

// Waits up to 2 s for the process to be gone (the init process reaps orphans asynchronously).
inline bool gone_soon(pid_t pid) {
  for (int i = 0; i < 200 && alive(pid); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return !alive(pid);
}

inline void wait_for_file(const std::string& path) {
  for (int i = 0; i < 1000 && !std::filesystem::exists(path); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(std::filesystem::exists(path));
}

// The arguments that run one hidden test case of this binary as a program. Its stdout may be
// a terminal under the launcher (Note [line-buffered workers]), where Catch2 would colour it.
inline std::vector<std::string> catch_case(const std::string& name) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
#ifdef TANDEM_CATCH3
  return {self, name, "--colour-mode", "none"};
#else
  return {self, name, "--use-colour", "no"};
#endif
}

inline pid_t pid_in(const std::string& path) {
  return static_cast<pid_t>(std::stol(read_text(path)));
}

}  // namespace tandem::test::launch_util
