// The TCP store's server: the thread rank 0 runs (store.h), the admission of clients (Note
// [store admission]) and the disconnect keys of ranks that vanish (close_dead).
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
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "core/error.h"

namespace tandem::parallel::distributed {

using namespace store_wire;

namespace {

// A pre-hello connection that sent this much without completing a hello is not one of ours.
constexpr size_t kMaxHelloBytes = 64 + kMaxJobId;

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

}  // namespace

TCPStore::Server::Server(const std::string& host, uint16_t want_port, std::string job)
    : job_id(std::move(job)) {
  sockaddr_in addr = resolve_ipv4(host, want_port);
  std::string where = host + ":" + std::to_string(want_port);
  listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TANDEM_CHECK(listen_fd >= 0, Dist, "store: socket(): ", std::strerror(errno));
  // SO_REUSEADDR only lets us rebind a port whose old connections linger in TIME_WAIT; a
  // port with a live listener still fails with EADDRINUSE below.
  int one = 1;
  ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd, 1024) != 0) {
    int err = errno;
    ::close(listen_fd);
    TANDEM_CHECK(err != EADDRINUSE, Dist, "store: cannot listen on ", where, ": ",
                 std::strerror(err), " (is another job using this port?)");
    TANDEM_THROW(Dist, "store: cannot listen on ", where, ": ", std::strerror(err));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.sin_port);
  set_nonblocking(listen_fd);
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    int err = errno;
    ::close(listen_fd);
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
  ::close(wake[0]);
  ::close(wake[1]);
}

void TCPStore::Server::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  for (;;) {
    fds.assign({{wake[0], POLLIN, 0}, {listen_fd, POLLIN, 0}});
    ids.clear();
    Clock::time_point next = Clock::time_point::max();
    for (auto& [id, c] : conns) {
      short ev = (c.closing ? 0 : POLLIN) | (c.out_pos < c.out.size() ? POLLOUT : 0);
      fds.push_back({c.fd, ev, 0});
      ids.push_back(id);
      if (c.waiter.active) next = std::min(next, c.waiter.deadline);
    }
    int timeout = next == Clock::time_point::max() ? -1 : poll_ms_until(next);
    if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
      TANDEM_LOG_ERROR("store: poll(): ", std::strerror(errno), "; server stopped");
      return;
    }
    if (fds[0].revents) return;  // the destructor asks us to stop
    if (fds[1].revents & POLLIN) accept_all();
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = conns.find(ids[i]);
      if (it == conns.end() || it->second.dead) continue;
      short re = fds[i + 2].revents;
      if (re & (POLLIN | POLLHUP | POLLERR)) read_from(ids[i], it->second);
      if ((re & POLLOUT) && !it->second.dead) flush(it->second);
    }
    expire_waiters(Clock::now());
    close_dead();
  }
}

void TCPStore::Server::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a client that vanished before we accepted it
    int one = 1, idle_s = 10, interval_s = 5, probes = 3;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A node that loses power sends no FIN: keepalive probes turn its silence into a closed
    // connection (and a disconnect key) after ~25 s instead of never.
    ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
    ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
    conns[next_id++].fd = fd;
  }
}

void TCPStore::Server::read_from(uint64_t id, Conn& c) {
  uint8_t buf[64 * 1024];
  for (;;) {
    ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    c.dead = true;  // EOF or a reset: process what arrived (a bye), then close
    break;
  }
  while (!c.closing && c.in_pos < c.in.size()) {
    if (c.waiter.active) {  // our client never sends while it waits for a reply
      c.dead = true;
      break;
    }
    Reader r(c.in.data() + c.in_pos, c.in.size() - c.in_pos);
    Parse p = c.admitted ? handle(id, c, r) : hello(c, r);
    if (p == Parse::kIncomplete) {
      if (!c.admitted && c.in.size() - c.in_pos > kMaxHelloBytes) c.dead = true;
      break;
    }
    if (p == Parse::kBad) {
      c.dead = true;
      break;
    }
    c.in_pos += r.pos();
  }
  if (c.in_pos > 0) {  // keep only the unread tail: the start of a message still arriving
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<ptrdiff_t>(c.in_pos));
    c.in_pos = 0;
  }
  if (!c.dead) flush(c);
}

// Note [store admission]
// A store port is a well-known number (29500 by default), so a second job started on the same
// machine, or a stale process of an earlier one, may connect to our server. Unlike PyTorch's
// TCPStore we do not let it in: the first message on every connection is a hello carrying a
// magic number, the protocol version, the job id (env.h says where it comes from) and the
// client's rank. The server answers accept or reject before it reads anything else:
//   - wrong magic (not a tandem client: a port scanner, a browser, random bytes): the connection
//     is closed without a reply;
//   - another protocol version or another job id: a reject, then the connection is closed. The
//     data is never touched, and the client throws a DistError that names the reason (but not
//     the server's job id: it is not the client's business);
//   - otherwise accepted, and the rank is remembered for disconnect tracking (store.h).
// Every length on the wire is bounded (kMaxKey, kMaxValue), so a stray byte stream cannot make
// the server allocate without bound: a violation closes that one connection, nothing else.
TCPStore::Server::Parse TCPStore::Server::hello(Conn& c, Reader& r) {
  uint8_t cmd = 0;
  uint32_t magic = 0, version = 0, rank = 0;
  std::string job;
  if (!r.u8(cmd)) return Parse::kIncomplete;
  if (cmd != kHello) return Parse::kBad;
  if (!r.u32(magic)) return Parse::kIncomplete;
  if (magic != kMagic) return Parse::kBad;
  if (!r.u32(version) || !r.bytes(job, kMaxJobId) || !r.u32(rank))
    return r.bad() ? Parse::kBad : Parse::kIncomplete;
  Writer w(c.out);
  if (version != kVersion || job != job_id) {
    w.u8(kReplyReject);
    w.u8(version != kVersion ? kRejectVersion : kRejectJob);
    c.closing = true;
    return Parse::kDone;
  }
  c.admitted = true;
  c.rank = static_cast<int32_t>(rank);
  w.u8(kReplyAccept);
  return Parse::kDone;
}

TCPStore::Server::Parse TCPStore::Server::handle(uint64_t id, Conn& c, Reader& r) {
  auto incomplete = [&] { return r.bad() ? Parse::kBad : Parse::kIncomplete; };
  uint8_t cmd = 0;
  if (!r.u8(cmd)) return Parse::kIncomplete;
  Writer w(c.out);
  std::string key;
  switch (cmd) {
    case kSet: {
      Bytes value;
      if (!r.bytes(key, kMaxKey) || !r.bytes(value, kMaxValue)) return incomplete();
      w.u8(kReplyOk);
      set_key(key, std::move(value));
      return Parse::kDone;
    }
    case kGet:
    case kWait: {
      std::vector<std::string> keys;
      uint64_t timeout_ms = 0;
      if (cmd == kGet) {
        keys.emplace_back();
        if (!r.bytes(keys[0], kMaxKey)) return incomplete();
      } else if (!read_keys(r, keys)) {
        return incomplete();
      }
      if (!r.u64(timeout_ms)) return Parse::kIncomplete;
      timeout_ms = std::min<uint64_t>(timeout_ms, uint64_t{1} << 40);  // ~35 years
      c.waiter = {true, cmd == kGet, std::move(keys), "",
                  Clock::now() + Milliseconds(static_cast<int64_t>(timeout_ms))};
      try_answer(id, c);
      return Parse::kDone;
    }
    case kAdd: {
      uint64_t delta = 0;
      if (!r.bytes(key, kMaxKey) || !r.u64(delta)) return incomplete();
      int64_t now = 0;
      auto it = data.find(key);
      if (it != data.end()) {
        const char* b = reinterpret_cast<const char*>(it->second.data());
        auto [end, ec] = std::from_chars(b, b + it->second.size(), now);
        if (ec != std::errc() || end != b + it->second.size() || it->second.empty()) {
          w.u8(kReplyError);
          w.str("the value of key '" + key + "' is not an integer");
          return Parse::kDone;
        }
      }
      now += static_cast<int64_t>(delta);
      std::string text = std::to_string(now);
      w.u8(kReplyInt);
      w.u64(static_cast<uint64_t>(now));
      set_key(key, Bytes(text.begin(), text.end()));
      return Parse::kDone;
    }
    case kCheck: {
      std::vector<std::string> keys;
      if (!read_keys(r, keys)) return incomplete();
      w.u8(kReplyBool);
      w.u8(std::all_of(keys.begin(), keys.end(), [&](auto& k) { return data.count(k) > 0; }));
      return Parse::kDone;
    }
    case kDelete: {
      if (!r.bytes(key, kMaxKey)) return incomplete();
      w.u8(kReplyBool);
      w.u8(data.erase(key) > 0);
      return Parse::kDone;
    }
    case kBye:
      c.said_bye = true;
      w.u8(kReplyOk);
      return Parse::kDone;
    default:
      return Parse::kBad;
  }
}

bool TCPStore::Server::read_keys(Reader& r, std::vector<std::string>& keys) {
  uint32_t n = 0;
  if (!r.u32(n)) return false;
  if (n > kMaxKeys) return r.fail();
  keys.resize(n);
  for (auto& k : keys)
    if (!r.bytes(k, kMaxKey)) return false;
  return true;
}

void TCPStore::Server::set_key(const std::string& key, Bytes value) {
  data[key] = std::move(value);
  auto it = watchers.find(key);
  if (it == watchers.end()) return;
  std::set<uint64_t> ids = std::move(it->second);
  watchers.erase(it);
  for (uint64_t id : ids) {
    auto c = conns.find(id);
    if (c == conns.end() || !c->second.waiter.active) continue;
    c->second.waiter.watch_key.clear();  // it was registered under `key`, just removed
    try_answer(id, c->second);
    if (!c->second.dead) flush(c->second);
  }
}

// Answers the waiter when all its keys exist, else (re)registers it under the first missing.
void TCPStore::Server::try_answer(uint64_t id, Conn& c) {
  Waiter& wt = c.waiter;
  auto missing =
      std::find_if(wt.keys.begin(), wt.keys.end(), [&](auto& k) { return data.count(k) == 0; });
  if (missing != wt.keys.end()) {
    unwatch(id, c);
    wt.watch_key = *missing;
    watchers[*missing].insert(id);
    return;
  }
  unwatch(id, c);
  Writer w(c.out);
  if (wt.is_get) {
    w.u8(kReplyValue);
    w.bytes(data[wt.keys[0]]);
  } else {
    w.u8(kReplyOk);
  }
  wt = Waiter{};
}

void TCPStore::Server::unwatch(uint64_t id, Conn& c) {
  if (c.waiter.watch_key.empty()) return;
  auto it = watchers.find(c.waiter.watch_key);
  if (it != watchers.end()) {
    it->second.erase(id);
    if (it->second.empty()) watchers.erase(it);
  }
  c.waiter.watch_key.clear();
}

void TCPStore::Server::expire_waiters(Clock::time_point now) {
  for (auto& [id, c] : conns) {
    if (!c.waiter.active || c.waiter.deadline > now || c.dead) continue;
    std::string missing = c.waiter.watch_key;
    unwatch(id, c);
    c.waiter = Waiter{};
    Writer w(c.out);
    w.u8(kReplyTimeout);
    w.str(missing);
    flush(c);
  }
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

// Closing a rank's connection without a bye publishes the disconnect key, which may answer
// waiters on other connections (and mark them dead when their sockets fail): loop until none.
void TCPStore::Server::close_dead() {
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
      if (c.admitted && c.rank >= 0 && !c.said_bye) {
        set_key(store_disconnected_key(c.rank), Bytes{'1'});
        again = true;
        break;
      }
    }
  }
}

}  // namespace tandem::parallel::distributed
