// The TCP store in one process: the master's server thread, clients in threads, a forked child
// for a rank that dies, raw sockets for strangers.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "parallel/distributed/store.h"

using namespace tandem;
using namespace tandem::parallel::distributed;
using tandem::test::contains;
using tandem::test::error_message;
using namespace std::chrono_literals;

namespace {

const std::string kHost = "127.0.0.1";
const std::string kJob = "job-under-test";

std::unique_ptr<TCPStore> make_master(uint16_t port = 0, Milliseconds timeout = 2s) {
  return std::make_unique<TCPStore>(kHost, port, TCPStoreOptions{true, 0, timeout, kJob});
}

std::unique_ptr<TCPStore> make_client(const TCPStore& master, int rank, Milliseconds timeout = 2s,
                                      std::string job = kJob) {
  return std::make_unique<TCPStore>(kHost, master.port(),
                                    TCPStoreOptions{false, rank, timeout, std::move(job)});
}

std::string prefix(const TCPStore& s, int rank) {
  return "store " + s.address() + " (rank " + std::to_string(rank) + ")";
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Runs f on a thread of its own. Catch2's assertions are not thread-safe, so the thread only
// records what went wrong and the test checks it on the main thread.
class Worker {
 public:
  template <typename F>
  explicit Worker(F f)
      : thread_([this, f] {
          try {
            f();
          } catch (const std::exception& e) {
            error_ = e.what();
          }
        }) {}
  Worker(const Worker&) = delete;
  // "" when f returned; the message of what it threw otherwise.
  std::string join() {
    thread_.join();
    return error_;
  }

 private:
  std::string error_;  // before thread_: written by the thread
  std::thread thread_;
};

// Connects a plain socket to the store, writes `bytes` and closes: a stranger on the port.
void raw_send(uint16_t port, const std::vector<uint8_t>& bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  if (!bytes.empty()) ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  ::close(fd);
}

}  // namespace

TEST_CASE("store: set, get, add, check, delete_key", "[dist]") {
  auto master = make_master();
  REQUIRE(master->port() != 0);
  REQUIRE(master->address() == kHost + ":" + std::to_string(master->port()));
  auto client = make_client(*master, 1);

  client->set("greeting", std::string("hello"));
  REQUIRE(master->get_string("greeting") == "hello");
  master->set("greeting", std::string("again"));  // overwrites
  REQUIRE(client->get_string("greeting") == "again");

  REQUIRE(client->add("counter", 5) == 5);  // a missing key counts as 0
  REQUIRE(master->add("counter", -7) == -2);
  REQUIRE(client->get_string("counter") == "-2");  // decimal text
  REQUIRE(client->add("counter", 0) == -2);
  auto msg = error_message<DistError>([&] { client->add("greeting", 1); });
  REQUIRE(contains(msg, "the value of key 'greeting' is not an integer"));

  REQUIRE(client->check({"greeting", "counter"}));
  REQUIRE_FALSE(client->check({"greeting", "absent"}));
  REQUIRE(client->delete_key("greeting"));
  REQUIRE_FALSE(client->delete_key("greeting"));
  REQUIRE_FALSE(master->check({"greeting"}));

  // An empty value and a large one (several socket buffers) round-trip exactly.
  client->set("empty", Bytes{});
  REQUIRE(master->get("empty").empty());
  std::mt19937 gen(1234);
  Bytes big(3 * 1024 * 1024 + 17);
  for (auto& b : big) b = static_cast<uint8_t>(gen());
  client->set("big", big);
  REQUIRE(master->get("big") == big);
}

TEST_CASE("store: host names resolve, and the master listens only on its address", "[dist]") {
  TCPStore master("localhost", 0, TCPStoreOptions{true, 0, 2s, kJob});
  TCPStore client("localhost", master.port(), TCPStoreOptions{false, 1, 2s, kJob});
  client.set("k", std::string("v"));
  REQUIRE(master.get_string("k") == "v");
  REQUIRE(master.address() == "localhost:" + std::to_string(master.port()));
  // Bound to 127.0.0.1 only: another loopback address of the same port finds nobody.
  auto msg = error_message<DistError>([&] {
    TCPStore("127.0.0.2", master.port(), TCPStoreOptions{false, 2, 200ms, kJob});
  });
  REQUIRE(contains(msg, "nothing listening at 127.0.0.2:"));
}

TEST_CASE("store: concurrent adds from threads sum right", "[dist]") {
  auto master = make_master();
  auto shared = make_client(*master, 1);  // one store used by several threads at once
  constexpr int kThreads = 4, kAdds = 50;
  std::deque<Worker> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto own = make_client(*master, 2 + t);
      for (int i = 0; i < kAdds; ++i) {
        own->add("sum", 1);
        shared->add("sum", 2);
      }
    });
  }
  for (auto& t : threads) REQUIRE(t.join() == "");
  REQUIRE(master->add("sum", 0) == kThreads * kAdds * 3);
}

TEST_CASE("store: get and wait block until another thread sets the key", "[dist]") {
  auto master = make_master();
  auto client = make_client(*master, 1);
  auto start = std::chrono::steady_clock::now();
  Worker setter([&] {
    std::this_thread::sleep_for(100ms);
    client->set("late", std::string("here"));
    std::this_thread::sleep_for(50ms);
    client->set("later", std::string("too"));
  });
  // The master's store is used by this thread only; `client` by the setter only, except that
  // the setter's sets go through while this thread is blocked on the same server.
  REQUIRE(master->get_string("late") == "here");
  REQUIRE(seconds_since(start) >= 0.09);
  master->wait({"late", "later"});
  REQUIRE(setter.join() == "");

  // One store shared by a blocked thread and a setting thread: the waiter does not hold the
  // setter up (each request has its own connection).
  std::string got;
  Worker waiter([&] { got = client->get_string("shared"); });
  std::this_thread::sleep_for(50ms);
  client->set("shared", std::string("ok"));
  REQUIRE(waiter.join() == "");
  REQUIRE(got == "ok");
}

TEST_CASE("store: a wait past its timeout names the key, address and rank", "[dist]") {
  auto master = make_master();
  auto client = make_client(*master, 3, 200ms);
  auto start = std::chrono::steady_clock::now();
  auto msg = error_message<TimeoutError>([&] { client->get("nccl/id"); });
  REQUIRE(contains(msg, prefix(*client, 3) + ": timed out after 0.2 s waiting for key 'nccl/id'"));
  REQUIRE(seconds_since(start) < 1.5);

  master->set("present", std::string("1"));
  msg = error_message<TimeoutError>([&] { client->wait({"present", "missing"}, 150ms); });
  REQUIRE(contains(msg, "timed out after 0.15 s waiting for key 'missing'"));

  // The connection survives its timeouts.
  client->set("after", std::string("fine"));
  REQUIRE(master->get_string("after") == "fine");
  client->set_timeout(1s);
  Worker setter([&] {
    std::this_thread::sleep_for(50ms);
    master->set("nccl/id", std::string("x"));
  });
  REQUIRE(client->get_string("nccl/id") == "x");
  REQUIRE(setter.join() == "");
}

TEST_CASE("store: PrefixStore keeps users apart", "[dist]") {
  auto master = make_master();
  std::shared_ptr<Store> base = make_client(*master, 1);
  PrefixStore a("pg0", base), b("pg1", base);
  a.set("x", std::string("A"));
  b.set("x", std::string("B"));
  REQUIRE(a.get_string("x") == "A");
  REQUIRE(b.get_string("x") == "B");
  REQUIRE(base->get_string("pg0/x") == "A");
  REQUIRE(a.add("n", 2) == 2);
  REQUIRE_FALSE(b.check({"n"}));
  REQUIRE(a.check({"x", "n"}));
  a.wait({"x", "n"}, 100ms);
  auto msg = error_message<TimeoutError>([&] { b.wait({"n"}, 100ms); });
  REQUIRE(contains(msg, "waiting for key 'pg1/n'"));
  REQUIRE(b.delete_key("x"));
  REQUIRE(a.get_string("x") == "A");
  REQUIRE(a.timeout() == base->timeout());
}

TEST_CASE("store: store_barrier", "[dist]") {
  auto master = make_master();
  constexpr int kWorld = 3;
  std::vector<int64_t> seen(kWorld, -1);
  std::deque<Worker> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto s = make_client(*master, r + 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(30 * r));
      store_barrier(*s, "barrier/0", kWorld, 2s);
      seen[r] = s->add("barrier/0/arrived", 0);
    });
  }
  for (auto& t : threads) REQUIRE(t.join() == "");
  for (int64_t n : seen) REQUIRE(n == kWorld);  // nobody left before the last one arrived

  // Two of three arrive: both time out with the count.
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto s = make_client(*master, r + 1);
      store_barrier(*s, "barrier/1", 3, 200ms);
    });
  }
  for (auto& t : threads) {
    REQUIRE(contains(t.join(),
                     "store barrier 'barrier/1': timed out after 0.2 s with 2 of 3 ranks arrived"));
  }
  auto msg = error_message<DistError>([&] { store_barrier(*master, "barrier/0", 2, 1s); });
  REQUIRE(contains(msg, "store barrier 'barrier/0': 4 arrivals for a world of 2"));
}

TEST_CASE("store: a client of another job is refused and changes nothing", "[dist]") {
  auto master = make_master();
  master->set("nccl/id", std::string("ours"));
  auto msg = error_message<DistError>([&] { make_client(*master, 7, 2s, "other-job"); });
  REQUIRE(contains(
      msg, prefix(*master, 7) +
               ": refused: the server belongs to another job "
               "(job id 'other-job' here, server's differs); is another job using this port?"));
  REQUIRE_FALSE(contains(msg, kJob));  // the server's id is not given away
  REQUIRE(master->get_string("nccl/id") == "ours");
  std::this_thread::sleep_for(50ms);
  REQUIRE_FALSE(master->check({store_disconnected_key(7)}));  // a refusal is no disconnect
}

TEST_CASE("store: a second master on a taken port fails at once", "[dist]") {
  auto master = make_master();
  auto start = std::chrono::steady_clock::now();
  auto msg = error_message<DistError>([&] { make_master(master->port()); });
  REQUIRE(contains(msg, "store: cannot listen on " + master->address() +
                            ": Address already in use (is another job using this port?)"));
  REQUIRE(seconds_since(start) < 0.5);
  master->set("still", std::string("serving"));
  REQUIRE(master->get_string("still") == "serving");
}

TEST_CASE("store: a client with nothing to connect to gives up at its timeout", "[dist]") {
  uint16_t port;
  {
    auto gone = make_master();  // take a free port, then free it
    port = gone->port();
  }
  auto start = std::chrono::steady_clock::now();
  auto msg = error_message<DistError>([&] {
    TCPStore(kHost, port, TCPStoreOptions{false, 2, 300ms, kJob});
  });
  double elapsed = seconds_since(start);
  REQUIRE(contains(msg, "store: nothing listening at " + kHost + ":" + std::to_string(port) +
                            " (rank 2) after 0.3 s; is MASTER_ADDR/MASTER_PORT right and is "
                            "rank 0 running?"));
  REQUIRE(elapsed >= 0.25);
  REQUIRE(elapsed < 1.5);
}

TEST_CASE("store: a client that starts before the master connects when it comes", "[dist]") {
  uint16_t port;
  {
    auto gone = make_master();
    port = gone->port();
  }
  std::unique_ptr<TCPStore> master;
  Worker late([&] {
    std::this_thread::sleep_for(150ms);
    master = make_master(port);
    master->set("k", std::string("v"));
  });
  TCPStore client(kHost, port, TCPStoreOptions{false, 1, 2s, kJob});
  REQUIRE(client.get_string("k") == "v");
  REQUIRE(late.join() == "");
}

TEST_CASE("store: losing the master mid-call is a clear error", "[dist]") {
  auto master = make_master();
  auto client = make_client(*master, 1);
  client->set("k", std::string("v"));
  Worker killer([&] {
    std::this_thread::sleep_for(100ms);
    master.reset();
  });
  auto msg = error_message<DistError>([&] { client->get("never"); });
  REQUIRE(killer.join() == "");
  REQUIRE(contains(msg, prefix(*client, 1) + ": connection lost while waiting for key 'never' "
                                             "(rank 0, which hosts the store, may have exited)"));
}

TEST_CASE("store: a rank that dies without goodbye is reported disconnected", "[dist]") {
  auto master = make_master();
  {
    auto polite = make_client(*master, 6);  // says bye in its destructor
    polite->set("x", std::string("1"));
  }
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // A process that exits without unwinding: its sockets close, no bye is sent.
    int code = 0;
    try {
      auto* dying = new TCPStore(kHost, master->port(), TCPStoreOptions{false, 5, 2s, kJob});
      dying->set("child", std::string("alive"));
    } catch (...) {
      code = 1;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  REQUIRE(master->get_string("child") == "alive");
  master->wait({store_disconnected_key(5)}, 2s);
  REQUIRE(master->get_string("tandem/disconnected/5") == "1");
  REQUIRE_FALSE(master->check({store_disconnected_key(6)}));
}

TEST_CASE("store: strangers on the port do not disturb the server", "[dist]") {
  auto master = make_master();
  auto client = make_client(*master, 1);
  client->set("before", std::string("1"));
  std::string got;
  Worker waiter([&] { got = client->get_string("after"); });

  std::mt19937 gen(99);
  Bytes noise(64 * 1024);
  for (auto& b : noise) b = static_cast<uint8_t>(gen());
  raw_send(master->port(), noise);
  raw_send(master->port(), {});                // connects and leaves
  raw_send(master->port(), Bytes(200, 0x01));  // a hello's first byte, then junk
  Bytes huge{0x01};
  huge.insert(huge.end(), 64, 0xff);  // absurd lengths
  raw_send(master->port(), huge);
  Bytes text = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P', '/', '1', '.', '1', '\r', '\n'};
  raw_send(master->port(), text);

  master->set("after", std::string("2"));
  REQUIRE(waiter.join() == "");
  REQUIRE(got == "2");
  REQUIRE(master->get_string("before") == "1");
  REQUIRE(client->add("n", 1) == 1);
  REQUIRE_FALSE(master->check({store_disconnected_key(-1)}));
}

TEST_CASE("store: a rank whose request timed out on its side is not reported disconnected",
          "[dist]") {
  // The store's process stops answering for a while (SIGSTOP here; a loaded machine in life): a
  // request runs past its deadline, and the client closes that connection, out of step with the
  // server, without a goodbye. The rank itself is alive and carries on once the store answers.
  int port_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    try {
      TCPStore master(kHost, 0, TCPStoreOptions{true, 0, 2s, kJob});
      uint16_t p = master.port();
      if (::write(port_pipe[1], &p, sizeof p) != sizeof p) ::_exit(1);
      for (;;) ::pause();
    } catch (...) {
    }
    ::_exit(1);
  }
  struct Reaper {
    pid_t pid;
    ~Reaper() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reaper{pid};
  uint16_t port = 0;
  REQUIRE(::read(port_pipe[0], &port, sizeof port) == sizeof port);
  TCPStore client(kHost, port, TCPStoreOptions{false, 4, 300ms, kJob});
  client.set("before", std::string("1"));
  ::kill(pid, SIGSTOP);
  int stopped = 0;
  REQUIRE(::waitpid(pid, &stopped, WUNTRACED) == pid);
  REQUIRE(WIFSTOPPED(stopped));
  auto msg = error_message<TimeoutError>([&] { client.check({"before"}); });
  ::kill(pid, SIGCONT);
  REQUIRE(contains(msg, "timed out after 0.3 s checking key 'before'"));
  client.set_timeout(2s);
  client.set("after", std::string("1"));
  std::this_thread::sleep_for(200ms);
  REQUIRE_FALSE(client.check({store_disconnected_key(4)}));
  REQUIRE(client.disconnected_ranks().empty());
}

TEST_CASE("store: a second process claiming a live rank is refused, and its exit marks nothing",
          "[dist]") {
  auto master = make_master();
  auto rank5 = make_client(*master, 5);
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Another process with the same rank (RANK set twice), which then exits without unwinding.
    std::string said = "admitted";
    try {
      auto* twin = new TCPStore(kHost, master->port(), TCPStoreOptions{false, 5, 2s, kJob});
      twin->set("twin", std::string("here"));
    } catch (const std::exception& e) {
      said = e.what();
    }
    if (::write(pipe_fds[1], said.data(), said.size()) < 0) ::_exit(2);
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;)
    said.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  INFO(said);
  REQUIRE(contains(said, prefix(*master, 5) +
                             ": refused: rank 5 is already connected to this store (from " + kHost +
                             ":"));
  REQUIRE(contains(said, "is RANK the same in two processes?"));
  std::this_thread::sleep_for(200ms);
  REQUIRE_FALSE(master->check({store_disconnected_key(5)}));
  REQUIRE(master->disconnected_ranks().empty());
  rank5->set("still", std::string("rank 5"));
  REQUIRE(master->get_string("still") == "rank 5");
  // Once rank 5 has said goodbye, its rank is free again.
  rank5.reset();
  auto again = make_client(*master, 5);
  again->set("again", std::string("1"));
}

TEST_CASE("store: disconnected_ranks answers in one request, through any PrefixStore", "[dist]") {
  auto master = make_master();
  std::shared_ptr<Store> base = make_client(*master, 1);
  PrefixStore group("group/3", std::make_shared<PrefixStore>("default_pg", base));
  REQUIRE(group.disconnected_ranks().empty());
  for (int r : {7, 2}) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      try {
        new TCPStore(kHost, master->port(), TCPStoreOptions{false, r, 2s, kJob});
      } catch (...) {
        ::_exit(1);
      }
      ::_exit(0);  // no goodbye
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    master->wait({store_disconnected_key(r)}, 2s);
  }
  { auto polite = make_client(*master, 3); }
  REQUIRE(master->disconnected_ranks() == std::vector<int>{2, 7});
  REQUIRE(base->disconnected_ranks() == std::vector<int>{2, 7});
  REQUIRE(group.disconnected_ranks() == std::vector<int>{2, 7});
  // The per-rank keys stay, at the root of the key space, for a rank that waits for one.
  REQUIRE(base->get_string(store_disconnected_key(7)) == "1");
  REQUIRE_FALSE(group.check({store_disconnected_key(7)}));
}

TEST_CASE("store: IPv6 addresses work", "[dist]") {
  {
    int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (fd >= 0) ::close(fd);
    if (!ok) {
      WARN("no IPv6 loopback on this machine: skipped");
      return;
    }
  }
  TCPStore master("::1", 0, TCPStoreOptions{true, 0, 2s, kJob});
  REQUIRE(master.address() == "[::1]:" + std::to_string(master.port()));
  TCPStore client("[::1]", master.port(), TCPStoreOptions{false, 1, 2s, kJob});
  client.set("k", std::string("over IPv6"));
  REQUIRE(master.get_string("k") == "over IPv6");
  REQUIRE(client.add("n", 3) == 3);
  // Bound to ::1 only: the IPv4 loopback on the same port finds nobody.
  auto msg = error_message<DistError>([&] {
    TCPStore(kHost, master.port(), TCPStoreOptions{false, 2, 200ms, kJob});
  });
  REQUIRE(contains(msg, "nothing listening at 127.0.0.1:"));
}

TEST_CASE("store: a job across nodes may not bind or reach its store through a loopback name",
          "[dist]") {
  TCPStoreOptions o{true, 0, 2s, kJob};
  o.world_size = 4;
  o.local_world_size = 2;
  auto msg = error_message<DistError>([&] { TCPStore("localhost", 0, o); });
  REQUIRE(contains(
      msg,
      "store host 'localhost' resolves to 127.0.0.1, a loopback address, but the job spans "
      "several nodes (world size 4, 2 per node)"));
  REQUIRE(contains(msg, "set MASTER_ADDR to an address of rank 0's node"));
  TCPStore numeric(kHost, 0, o);  // a numeric address is taken at its word
  o.local_world_size = 4;
  TCPStore one_node("localhost", 0, o);
  REQUIRE(one_node.port() != 0);
}
