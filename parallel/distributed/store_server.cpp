// The TCP store's server: the thread rank 0 runs (store.h), its connections and their limits
// (Note [store limits]), where it listens (Note [the store's address]) and the disconnect marks
// of ranks that vanish (Note [disconnect tracking]). What it does with a connection's messages
// -- the admission of clients (Note [store admission]), the requests, the waiters -- is in
// store_requests.cpp.
//
// One thread, one poll() over the listening socket, a wake-up pipe and every connection. All
// sockets are non-blocking and every connection has an input and an output buffer, so a slow
// reader or a half-sent message never stalls the others. A get/wait whose keys are missing
// becomes the connection's waiter: it is answered when the key is set or when its deadline
// (sent by the client) passes, and meanwhile the server serves everyone else.
#include "parallel/distributed/store_server.h"

#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace tandem::parallel::distributed {

using namespace store_wire;

namespace {

// A pre-hello connection that sent this much without completing a hello is not one of ours.
constexpr size_t kMaxHelloBytes = 64 + kMaxJobId;
// Out of descriptors with none in reserve, or out of kernel memory: stop accepting this long.
constexpr Milliseconds kAcceptPause{100};

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

std::string peer_text(const sockaddr_storage& ss) {
  char ip[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    port = ntohs(a->sin6_port);
  }
  return host_port(ip, port);
}

}  // namespace

// Note [the store's address]
// The server listens on the one address its host resolves to — never on every interface, so a
// store on 127.0.0.1 cannot be reached from another machine at all. A name resolves to its first
// IPv4 address when it has one, else to its first IPv6 address; numeric IPv6 addresses ("::1",
// also written "[::1]") work for the server and the clients alike. A job that spans several
// nodes cannot meet on a loopback address, and the usual way to land there by accident is
// MASTER_ADDR=$(hostname) on Debian or Ubuntu, whose /etc/hosts maps the machine's own name to
// 127.0.1.1: the store would listen where no other node can reach it, and the remote ranks would
// time out minutes later. So when the world spans nodes a name that resolves to loopback is a
// DistError at once, naming the address and the fix (check_store_address, used by the store and
// by read_dist_env). A numeric loopback address is taken at its word: that is how several
// "nodes" share one machine in tests.
TCPStore::Server::Server(const std::string& host, uint16_t want_port,
                         const TCPStoreOptions& options)
    : job_id(options.job_id), hello_timeout(options.hello_timeout) {
  Endpoint e = resolve_endpoint(host, want_port);
  std::string where = host_port(host, want_port);
  listen_fd = ::socket(e.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(listen_fd >= 0, Dist, "store: socket(): ", std::strerror(errno));
  // SO_REUSEADDR only lets us rebind a port whose old connections linger in TIME_WAIT; a
  // port with a live listener still fails with EADDRINUSE below.
  int one = 1;
  ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (e.family == AF_INET6) ::setsockopt(listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
  if (::bind(listen_fd, reinterpret_cast<sockaddr*>(&e.addr), e.len) != 0 ||
      ::listen(listen_fd, 1024) != 0) {
    int err = errno;
    ::close(listen_fd);
    TANDEM_CHECK(err != EADDRINUSE, Dist, "store: cannot listen on ", where, ": ",
                 std::strerror(err), " (is another job using this port?)");
    TANDEM_THROW(Dist, "store: cannot listen on ", where, ": ", std::strerror(err));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  set_nonblocking(listen_fd);
  // The cap (Note [store limits]): well above what the job needs, well below the descriptors the
  // rest of rank 0's process (NCCL, CUDA, files) needs.
  size_t want = options.max_connections > 0 ? static_cast<size_t>(options.max_connections)
                : options.world_size > 0    ? 64 + 8 * static_cast<size_t>(options.world_size)
                                            : 4096;
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY) {
    const size_t soft = fds.rlim_cur;
    const size_t keep = std::max<size_t>(soft / 4, std::min<size_t>(256, soft / 2));
    want = std::min(want, std::max<size_t>(16, soft - keep));
  }
  max_conns = want;
  reserve_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    int err = errno;
    ::close(listen_fd);
    if (reserve_fd >= 0) ::close(reserve_fd);
    TANDEM_THROW(Dist, "store: pipe(): ", std::strerror(err));
  }
  thread = std::thread([this] { run(); });
}

TCPStore::Server::~Server() {
  char byte = 0;
  if (::write(wake[1], &byte, 1) < 0) TANDEM_LOG_ERROR("store: cannot wake the server thread");
  if (thread.joinable()) thread.join();
  for (auto& [id, c] : conns) ::close(c.fd);
  ::close(listen_fd);
  if (reserve_fd >= 0) ::close(reserve_fd);
  ::close(wake[0]);
  ::close(wake[1]);
}

void TCPStore::Server::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  for (;;) {
    Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    fds.assign({{wake[0], POLLIN, 0}, {listen_fd, static_cast<short>(accepting ? POLLIN : 0), 0}});
    ids.clear();
    Clock::time_point next = accepting ? Clock::time_point::max() : accept_paused_until;
    for (auto& [id, c] : conns) {
      short ev = (c.closing ? 0 : POLLIN) | (c.out_pos < c.out.size() ? POLLOUT : 0);
      fds.push_back({c.fd, ev, 0});
      ids.push_back(id);
      if (c.waiter.active) next = std::min(next, c.waiter.deadline);
    }
    if (const Conn* oldest = oldest_pending()) next = std::min(next, oldest->hello_deadline);
    int timeout = next == Clock::time_point::max() ? -1 : poll_ms_until(next);
    if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
      TANDEM_LOG_ERROR("store: poll(): ", std::strerror(errno), "; server stopped");
      return;
    }
    if (fds[0].revents) return;  // the destructor asks us to stop
    if (fds[1].revents & POLLIN) accept_all(Clock::now());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = conns.find(ids[i]);
      if (it == conns.end() || it->second.dead) continue;
      short re = fds[i + 2].revents;
      if (re & (POLLIN | POLLHUP | POLLERR)) read_from(ids[i], it->second);
      if ((re & POLLOUT) && !it->second.dead) flush(it->second);
    }
    now = Clock::now();
    expire_waiters(now);
    expire_hellos(now);
    close_dead();
  }
}

// Note [store limits]
// The store's port is open to whoever can reach the address, so one client — a stray script, a
// port scanner, a bug — must not be able to take the server, or rank 0's process, down with it:
//   - hello deadline: a connection that has not completed its hello within hello_timeout (5 s
//     by default) of being accepted is closed. Admitted connections may idle for ever: a rank's
//     session connection does (Note [disconnect tracking]).
//   - connection cap: at most max_connections at once (64 + 8 per rank by default, 4096 when the
//     world size is unknown; never more than the descriptor limit less a quarter of it, or 256,
//     so NCCL, CUDA and files keep theirs). At the cap, a newcomer takes the place of the oldest
//     connection that has not said hello; when every place is held by an admitted client the
//     newcomer is refused and closed. Both are logged with the peer's address (at most one line
//     a second of each kind, with a count).
//   - one request at a time: after the hello every request is a frame whose length is known
//     before its body arrives, so a request is parsed once, when it is complete, however many
//     pieces it comes in; a frame over kMaxRequest is refused unread. A request that arrives
//     before the reply to the previous one has left (pipelining — our client never does) drops
//     the connection, so a connection holds at most one request coming and one reply going.
//   - out of descriptors: accept() fails with EMFILE while the connection stays queued, so the
//     listening socket stays readable and a naive loop spins. The server keeps one descriptor
//     in reserve: it frees it, accepts the connection, closes it (logged), and takes the
//     reserve back; when even that fails it stops accepting for 100 ms.
// Memory is bounded per connection: one that has not said hello holds at most a hello (~4 KiB)
// and what one recv() brings; an admitted one at most one request and one reply (~2 x kMaxValue).
// What this does not do: stop a client that knows the job id (it is not a secret, Note [store
// admission]) from holding admitted connections up to the cap, or from writing keys.
void TCPStore::Server::accept_all(Clock::time_point now) {
  for (int i = 0; i < 256; ++i) {  // bounded: a storm of connects must not starve the rest
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd =
        ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && refuse_without_fd(now)) continue;
      if (errno == ENOBUFS || errno == ENOMEM) accept_paused_until = now + kAcceptPause;
      return;  // EAGAIN: nobody else is waiting
    }
    std::string peer = peer_text(ss);
    if (conns.size() >= max_conns && !make_room()) {
      log(kLogRefused, "refused a connection from " + peer + ": " + std::to_string(max_conns) +
                           " connections open (the cap; TCPStoreOptions::max_connections)");
      ::close(fd);
      continue;
    }
    int one = 1, idle_s = 10, interval_s = 5, probes = 3;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A node that loses power sends no FIN: keepalive probes turn its silence into a closed
    // connection (and a disconnect mark) after ~25 s instead of never.
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
    uint64_t id = next_id++;
    Conn& c = conns[id];
    c.fd = fd;
    c.peer = std::move(peer);
    c.hello_deadline = now + hello_timeout;
    pending.push_back(id);
  }
}

// Out of descriptors: spend the reserve on accepting one connection, refuse it, take the reserve
// back. False when that did not work (then accepting pauses).
bool TCPStore::Server::refuse_without_fd(Clock::time_point now) {
  int fd = -1;
  if (reserve_fd >= 0) {
    ::close(reserve_fd);
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd >= 0) {
      log(kLogRefused, "refused a connection from " + peer_text(ss) +
                           ": this process is out of file descriptors (ulimit -n)");
      ::close(fd);
    }
    reserve_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  if (fd >= 0 && reserve_fd >= 0) return true;
  accept_paused_until = now + kAcceptPause;
  return false;
}

const TCPStore::Server::Conn* TCPStore::Server::oldest_pending() {
  while (!pending.empty()) {
    auto it = conns.find(pending.front());
    if (it != conns.end() && !it->second.admitted && !it->second.dead && !it->second.closing)
      return &it->second;
    pending.pop_front();
  }
  return nullptr;
}

// At the cap: closes the oldest connection that has not said hello. False when there is none.
bool TCPStore::Server::make_room() {
  if (oldest_pending() == nullptr) return false;
  auto it = conns.find(pending.front());
  pending.pop_front();
  log(kLogEvicted, "closed the connection from " + it->second.peer +
                       ", which had not said hello, to make room (" + std::to_string(max_conns) +
                       " connections open, the cap)");
  ::close(it->second.fd);
  conns.erase(it);
  return true;
}

void TCPStore::Server::expire_hellos(Clock::time_point now) {
  for (const Conn* c; (c = oldest_pending()) != nullptr && c->hello_deadline <= now;) {
    Conn& late = conns.at(pending.front());
    pending.pop_front();
    log(kLogNoHello, "closed the connection from " + late.peer + ": no hello within " +
                         seconds_text(hello_timeout) + " s");
    late.dead = true;
  }
}

void TCPStore::Server::read_from(uint64_t id, Conn& c) {
  uint8_t buf[64 * 1024];
  // Bounded per round, so one fast sender cannot keep the others waiting; poll() brings us back.
  for (int round = 0; round < 16 && !c.dead && !c.closing; ++round) {
    ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      parse(id, c);
      if (static_cast<size_t>(n) < sizeof(buf)) break;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    c.dead = true;  // EOF or a reset: what arrived before it (a bye) is handled already
  }
  if (!c.dead) flush(c);
}

// Handles every complete message in c.in and keeps the unread tail (the start of one still
// arriving). A frame is looked at only once it is all here (Note [store limits]).
void TCPStore::Server::parse(uint64_t id, Conn& c) {
  size_t pos = 0;
  while (!c.dead && !c.closing && pos < c.in.size()) {
    const uint8_t* p = c.in.data() + pos;
    const size_t n = c.in.size() - pos;
    if (!c.admitted) {
      Reader r(p, n);
      Parse res = hello(id, c, r);
      if (res == Parse::kIncomplete && n <= kMaxHelloBytes) break;
      if (res != Parse::kDone) {
        drop(c, "not a tandem client (its first bytes are no hello)");
        break;
      }
      pos += r.pos();
      continue;
    }
    if (n < 4) break;
    const size_t len = p[0] | (p[1] << 8) | (p[2] << 16) | (size_t{p[3]} << 24);
    if (len > kMaxRequest) {
      drop(c, "a request of " + std::to_string(len) + " bytes, over the limit of " +
                  std::to_string(kMaxRequest));
      break;
    }
    if (n < 4 + len) break;  // the rest is on its way
    if (!c.out.empty()) flush(c);
    if (c.dead) break;
    if (c.waiter.active || !c.out.empty()) {
      drop(c, "it sent a request before reading the reply to its last one");
      break;
    }
    Reader r(p + 4, len);
    if (handle(id, c, r) != Parse::kDone || r.pos() != len) {
      drop(c, "a malformed request");
      break;
    }
    pos += 4 + len;
  }
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(std::min(pos, c.in.size())));
}

void TCPStore::Server::flush(Conn& c) {
  while (c.out_pos < c.out.size()) {
    ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_pos += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;  // the rest goes when poll says POLLOUT
    } else {
      c.dead = true;
      return;
    }
  }
  c.out.clear();
  c.out_pos = 0;
  if (c.closing) c.dead = true;
}

void TCPStore::Server::drop(Conn& c, const std::string& why) {
  std::string who = c.rank >= 0 ? " (rank " + std::to_string(c.rank) + ")" : "";
  log(kLogDropped, "dropped the connection from " + c.peer + who + ": " + why);
  c.dead = true;
}

void TCPStore::Server::log(LogKind kind, const std::string& message) {
  LogLimit& l = logs[kind];
  Clock::time_point now = Clock::now();
  if (kind != kLogGone && now - l.last < std::chrono::seconds(1)) {
    ++l.held;
    return;
  }
  std::string more =
      l.held > 0 ? " (and " + std::to_string(l.held) + " more like it since the last such line)"
                 : "";
  std::fprintf(stderr, "tandem: store: %s%s\n", message.c_str(), more.c_str());
  std::fflush(stderr);
  l.last = now;
  l.held = 0;
}

// Note [disconnect tracking]
// Every TCPStore client opens one session connection at construction, which carries its hello
// and, at the end, its goodbye, and nothing else; requests go over plain connections from a pool.
// The rule: a rank is marked disconnected when, and only when, its session connection ends
// without a goodbye. That makes the mark trustworthy:
//   - no request runs on the session, so a client never closes it after a local timeout or a
//     reply out of step (it closes those plain connections, which the server does not track);
//   - a rank has at most one live session: a second process that claims the same rank is refused
//     at its hello (Note [store admission]), so its exit cannot mark the live one;
//   - a goodbye frees the rank; the destructor says it, and so does every orderly exit.
// What ends a session without a goodbye is the process ending without unwinding (a crash, a kill,
// _exit) or the network between it and rank 0 going away (keepalive notices within ~25 s).
// A mark is kept for the life of the store: the rank's key store_disconnected_key(rank) = "1"
// (for whoever waits for it) and a place in the answer to disconnected_ranks(), one request
// that names every marked rank.
void TCPStore::Server::close_dead() {
  // Publishing a mark may answer waiters on other connections (and mark them dead when their
  // sockets fail): loop until none is left.
  for (bool again = true; again;) {
    again = false;
    for (auto it = conns.begin(); it != conns.end();) {
      if (!it->second.dead) {
        ++it;
        continue;
      }
      Conn c = std::move(it->second);
      unwatch(it->first, c);
      it = conns.erase(it);
      ::close(c.fd);
      if (c.session) {
        sessions.erase(c.rank);
        gone.insert(c.rank);
        log(kLogGone,
            "rank " + std::to_string(c.rank) + " (from " + c.peer + ") left without a goodbye");
        set_key(store_disconnected_key(c.rank), Bytes{'1'});
        again = true;
        break;
      }
    }
  }
}

}  // namespace tandem::parallel::distributed
