#include "parallel/dist/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "core/error.h"

namespace tandem::parallel::dist {

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

std::string Store::get_string(const std::string& key) {
  Bytes v = get(key);
  return std::string(v.begin(), v.end());
}

std::string store_disconnected_key(int rank) {
  return "tandem/disconnected/" + std::to_string(rank);
}

namespace {

using Clock = std::chrono::steady_clock;

// ---- the wire format ---------------------------------------------------------------------
//
// A message is a command byte and its fields; a reply is a tag byte and its fields. Integers are
// little-endian, strings and values a u32 length and the bytes. One request is in flight per
// connection at a time, so replies need no ids.

constexpr uint32_t kMagic = 0x746e646d;  // "tndm"
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxKey = 4096;
constexpr size_t kMaxJobId = 4096;
constexpr size_t kMaxValue = size_t{64} << 20;
constexpr uint32_t kMaxKeys = 1 << 16;  // in one check/wait

enum Command : uint8_t { kHello = 1, kSet, kGet, kAdd, kCheck, kWait, kDelete, kBye };
// hello:  magic u32, version u32, job id, rank i32 -> accept | reject(reason u8)
// set:    key, value                               -> ok
// get:    key, timeout_ms u64                      -> value(bytes) | timeout(missing key)
// add:    key, delta i64                           -> int(i64) | error(message)
// check:  n u32, n keys                            -> bool(u8)
// wait:   n u32, n keys, timeout_ms u64            -> ok | timeout(missing key)
// delete: key                                      -> bool(u8)
// bye:                                             -> ok
enum ReplyTag : uint8_t {
  kReplyOk = 1,
  kReplyValue,
  kReplyInt,
  kReplyBool,
  kReplyTimeout,
  kReplyAccept,
  kReplyReject,
  kReplyError
};
enum RejectReason : uint8_t { kRejectJob = 1, kRejectVersion = 2 };

class Writer {
 public:
  explicit Writer(Bytes& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(v); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  template <typename C>
  void bytes(const C& s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void str(const std::string& s) { bytes(s); }

 private:
  Bytes& out_;
};

// Reads fields from a buffer that may hold only part of a message. Every read returns false
// when the bytes are not all there yet, or when a length is over its bound (then bad() is true:
// the stream is not ours and the connection must be closed).
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool u8(uint8_t& v) {
    if (n_ - pos_ < 1) return false;
    v = p_[pos_++];
    return true;
  }
  bool u32(uint32_t& v) {
    if (n_ - pos_ < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{p_[pos_++]} << (8 * i);
    return true;
  }
  bool u64(uint64_t& v) {
    if (n_ - pos_ < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{p_[pos_++]} << (8 * i);
    return true;
  }
  template <typename C>
  bool bytes(C& out, size_t max) {
    size_t start = pos_;
    uint32_t len = 0;
    if (!u32(len)) return false;
    if (len > max) return fail();
    if (n_ - pos_ < len) {
      pos_ = start;
      return false;
    }
    out.assign(p_ + pos_, p_ + pos_ + len);
    pos_ += len;
    return true;
  }
  bool fail() {
    bad_ = true;
    return false;
  }
  bool bad() const { return bad_; }
  size_t pos() const { return pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  bool bad_ = false;
};

// "0.3", "2", "1.25": timeouts are printed in seconds, without trailing zeros.
std::string seconds_text(Milliseconds t) {
  if (t.count() % 1000 == 0) return std::to_string(t.count() / 1000);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", t.count() / 1000.0);
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  return s;
}

sockaddr_in resolve_ipv4(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  TANDEM_CHECK(rc == 0 && res != nullptr, Dist, "store: cannot resolve host '", host,
               "': ", rc == 0 ? "no IPv4 address" : ::gai_strerror(rc));
  sockaddr_in addr = *reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(port);
  return addr;
}

void set_nonblocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

int poll_ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left + 1, 0, 1 << 30));
}

}  // namespace

// ---- server --------------------------------------------------------------------------------
//
// One thread, one poll() over the listening socket, a wake-up pipe and every connection. All
// sockets are non-blocking and every connection has an input and an output buffer, so a slow
// reader or a half-sent message never stalls the others. A get/wait whose keys are missing
// becomes the connection's waiter: it is answered when the key is set or when its deadline
// (sent by the client) passes, and meanwhile the server serves everyone else.

namespace {

struct Waiter {
  bool active = false;
  bool is_get = false;
  std::vector<std::string> keys;
  std::string watch_key;  // the missing key it is registered under in `watchers`
  Clock::time_point deadline;
};

struct Conn {
  int fd = -1;
  Bytes in;
  size_t in_pos = 0;
  Bytes out;
  size_t out_pos = 0;
  bool admitted = false;
  int rank = -1;
  bool said_bye = false;
  bool closing = false;  // rejected: close once the reply is flushed
  bool dead = false;     // to be closed by the loop
  Waiter waiter;
};

enum class Parse { kDone, kIncomplete, kBad };

// A pre-hello connection that sent this much without completing a hello is not one of ours.
constexpr size_t kMaxHelloBytes = 64 + kMaxJobId;

}  // namespace

struct TCPStore::Server {
  int listen_fd = -1;
  int wake[2] = {-1, -1};
  uint16_t port = 0;
  std::string job_id;
  std::thread thread;

  // Owned by the server thread.
  std::unordered_map<std::string, Bytes> data;
  std::map<uint64_t, Conn> conns;  // map: references stay valid while others are added
  std::unordered_map<std::string, std::set<uint64_t>> watchers;
  uint64_t next_id = 0;

  Server(const std::string& host, uint16_t want_port, std::string job) : job_id(std::move(job)) {
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

  ~Server() {
    char byte = 0;
    if (::write(wake[1], &byte, 1) < 0) TANDEM_LOG_ERROR("store: cannot wake the server thread");
    if (thread.joinable()) thread.join();
    for (auto& [id, c] : conns) ::close(c.fd);
    ::close(listen_fd);
    ::close(wake[0]);
    ::close(wake[1]);
  }

  void run() {
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

  void accept_all() {
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

  void read_from(uint64_t id, Conn& c) {
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

  Parse hello(Conn& c, Reader& r) {
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

  Parse handle(uint64_t id, Conn& c, Reader& r) {
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

  static bool read_keys(Reader& r, std::vector<std::string>& keys) {
    uint32_t n = 0;
    if (!r.u32(n)) return false;
    if (n > kMaxKeys) return r.fail();
    keys.resize(n);
    for (auto& k : keys)
      if (!r.bytes(k, kMaxKey)) return false;
    return true;
  }

  void set_key(const std::string& key, Bytes value) {
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
  void try_answer(uint64_t id, Conn& c) {
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

  void unwatch(uint64_t id, Conn& c) {
    if (c.waiter.watch_key.empty()) return;
    auto it = watchers.find(c.waiter.watch_key);
    if (it != watchers.end()) {
      it->second.erase(id);
      if (it->second.empty()) watchers.erase(it);
    }
    c.waiter.watch_key.clear();
  }

  void expire_waiters(Clock::time_point now) {
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

  void flush(Conn& c) {
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
  void close_dead() {
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
};

// ---- client --------------------------------------------------------------------------------
//
// A pool of connections, each carrying one request at a time: a thread takes an idle
// connection (or opens one more) for the length of its request, so a thread blocked in a long
// get or wait never holds up the other threads of the process. Most processes only ever open
// one. The lock guards the pool only, never a request.

namespace {

// Replies to a get/wait come from the server by its deadline; past this much more the client
// stops believing the server is alive.
constexpr Milliseconds kReplyGrace{2000};
constexpr Milliseconds kRetryEvery{75};

struct Connection {
  int fd = -1;
  bool broken = false;  // out of step with the server: close, never reuse
  Connection() = default;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() {
    if (fd >= 0) ::close(fd);
  }
};

// One connect attempt bounded by `deadline`; -1 when nothing accepted it.
int connect_once(const sockaddr_in& addr, Clock::time_point deadline) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = 0;
    socklen_t len = sizeof(err);
    pollfd p{fd, POLLOUT, 0};
    if (errno != EINPROGRESS || ::poll(&p, 1, poll_ms_until(deadline)) <= 0 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// One request/response on a connection, every byte before `deadline`; a transport failure
// throws the error the store's contract names and marks the connection broken.
class Call {
 public:
  Call(Connection& c, const std::string& where, std::string what, Milliseconds shown,
       Clock::time_point deadline)
      : c_(c), where_(where), what_(std::move(what)), shown_(shown), deadline_(deadline) {}

  void send(const Bytes& msg) {
    size_t off = 0;
    while (off < msg.size()) {
      ssize_t n = ::send(c_.fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_for(POLLOUT);
      } else {
        lost();
      }
    }
  }
  uint8_t u8() {
    uint8_t b[1];
    recv_exact(b, 1);
    return b[0];
  }
  uint64_t u64() {
    uint8_t b[8];
    recv_exact(b, 8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{b[i]} << (8 * i);
    return v;
  }
  Bytes bytes(size_t max) {
    uint8_t b[4];
    recv_exact(b, 4);
    uint32_t len = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t{b[3]} << 24);
    if (len > max) protocol_error();
    Bytes out(len);
    recv_exact(out.data(), len);
    return out;
  }
  std::string str() {
    Bytes b = bytes(kMaxValue);
    return std::string(b.begin(), b.end());
  }
  // Reads the reply tag; a server-side error reply becomes a DistError, the connection intact.
  uint8_t tag() {
    uint8_t t = u8();
    if (t == kReplyError) TANDEM_THROW(Dist, where_, ": ", str());
    return t;
  }
  [[noreturn]] void protocol_error() {
    c_.broken = true;
    TANDEM_THROW(Dist, where_, ": unexpected reply while ", what_, " (not a tandem store?)");
  }

 private:
  void recv_exact(uint8_t* p, size_t n) {
    while (n > 0) {
      ssize_t got = ::recv(c_.fd, p, n, 0);
      if (got > 0) {
        p += got;
        n -= static_cast<size_t>(got);
      } else if (got < 0 && errno == EINTR) {
        continue;
      } else if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_for(POLLIN);
      } else {
        lost();
      }
    }
  }
  void wait_for(short events) {
    pollfd p{c_.fd, events, 0};
    int rc;
    do {
      rc = ::poll(&p, 1, poll_ms_until(deadline_));
    } while (rc < 0 && errno == EINTR);
    if (rc == 0 && Clock::now() >= deadline_) {
      c_.broken = true;
      TANDEM_THROW(Timeout, where_, ": timed out after ", seconds_text(shown_), " s ", what_);
    }
    if (rc < 0) lost();
  }
  [[noreturn]] void lost() {
    c_.broken = true;
    TANDEM_THROW(Dist, where_, ": connection lost while ", what_,
                 " (rank 0, which hosts the store, may have exited)");
  }

  Connection& c_;
  const std::string& where_;
  std::string what_;
  Milliseconds shown_;
  Clock::time_point deadline_;
};

// "key 'a'", "keys 'a', 'b'"
std::string keys_text(const std::vector<std::string>& keys) {
  std::string s = keys.size() == 1 ? "key " : "keys ";
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  return s;
}

void check_key(const std::string& key) {
  TANDEM_CHECK(key.size() <= kMaxKey, Value, "store: key of ", key.size(),
               " bytes is over the limit of ", kMaxKey);
}

}  // namespace

struct TCPStore::Client {
  std::string where;  // "store host:port (rank R)", the start of every message
  TCPStoreOptions options;
  sockaddr_in addr;
  std::mutex mu;  // guards `idle`
  std::vector<std::unique_ptr<Connection>> idle;

  Client(const std::string& host, uint16_t port, TCPStoreOptions opts)
      : options(std::move(opts)), addr(resolve_ipv4(host, port)) {
    std::string rank = options.rank >= 0 ? std::to_string(options.rank) : "unknown";
    std::string address = host + ":" + std::to_string(port);
    where = "store " + address + " (rank " + rank + ")";
    // The master may start after us: retry until the timeout.
    Clock::time_point deadline = Clock::now() + options.timeout;
    for (;;) {
      int fd = connect_once(addr, deadline);
      if (fd >= 0) {
        idle.push_back(hello(fd, deadline));
        return;
      }
      auto now = Clock::now();
      TANDEM_CHECK(now < deadline, Dist, "store: nothing listening at ", address, " (rank ", rank,
                   ") after ", seconds_text(options.timeout),
                   " s; is MASTER_ADDR/MASTER_PORT right and is rank 0 running?");
      std::this_thread::sleep_for(std::min<Clock::duration>(kRetryEvery, deadline - now));
    }
  }

  ~Client() {
    for (auto& c : idle) {
      try {
        Bytes msg{kBye};
        Call call(*c, where, "saying goodbye", Milliseconds(500), Clock::now() + Milliseconds(500));
        call.send(msg);
        call.u8();  // the ack: the server has read the bye before we close
      } catch (const Error&) {
        // The server is gone or slow; closing is all that is left.
      }
    }
  }

  std::unique_ptr<Connection> hello(int fd, Clock::time_point deadline) {
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    Call call(*c, where, "waiting for the store's answer to our hello", options.timeout, deadline);
    Bytes msg;
    Writer w(msg);
    w.u8(kHello);
    w.u32(kMagic);
    w.u32(kVersion);
    w.str(options.job_id);
    w.u32(static_cast<uint32_t>(options.rank));
    call.send(msg);
    uint8_t t = call.u8();
    if (t == kReplyAccept) return c;
    if (t != kReplyReject) call.protocol_error();
    c->broken = true;
    TANDEM_CHECK(call.u8() != kRejectJob, Dist, where,
                 ": refused: the server belongs to another job (job id '", options.job_id,
                 "' here, server's differs); is another job using this port?");
    TANDEM_THROW(Dist, where,
                 ": refused: the server speaks another version of the store "
                 "protocol (",
                 kVersion, " here); is another job using this port?");
  }

  // An idle connection, or a new one: the server was up when we first connected, so a refusal
  // now means it went away.
  std::unique_ptr<Connection> take(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        auto c = std::move(idle.back());
        idle.pop_back();
        return c;
      }
    }
    Clock::time_point deadline = Clock::now() + options.timeout;
    int fd = connect_once(addr, deadline);
    TANDEM_CHECK(fd >= 0, Dist, where, ": connection lost while ", what,
                 " (rank 0, which hosts the store, may have exited)");
    return hello(fd, deadline);
  }

  // Runs f(Call&) on a pooled connection; the connection goes back unless it broke.
  template <typename F>
  auto request(const std::string& what, Milliseconds shown, Milliseconds wait, F&& f) {
    struct Lease {
      Client& cl;
      std::unique_ptr<Connection> c;
      ~Lease() {
        if (c && !c->broken) {
          std::lock_guard<std::mutex> lock(cl.mu);
          cl.idle.push_back(std::move(c));
        }
      }
    } lease{*this, take(what)};
    Call call(*lease.c, where, what, shown, Clock::now() + wait);
    return f(call);
  }
};

TCPStore::TCPStore(std::string host, uint16_t port, TCPStoreOptions options)
    : host_(std::move(host)), port_(port), options_(std::move(options)) {
  timeout_ = options_.timeout;
  if (options_.is_master) {
    server_ = std::make_unique<Server>(host_, port_, options_.job_id);
    port_ = server_->port;
  }
  client_ = std::make_unique<Client>(host_, port_, options_);
}

TCPStore::~TCPStore() {
  client_.reset();  // says bye first, so our own server does not report us disconnected
  server_.reset();
}

std::string TCPStore::address() const {
  return host_ + ":" + std::to_string(port_);
}

void TCPStore::set(const std::string& key, const Bytes& value) {
  check_key(key);
  TANDEM_CHECK(value.size() <= kMaxValue, Value, "store: value of ", value.size(),
               " bytes for key '", key, "' is over the limit of ", kMaxValue);
  Bytes msg;
  Writer w(msg);
  w.u8(kSet);
  w.str(key);
  w.bytes(value);
  client_->request("setting key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyOk) call.protocol_error();
  });
}

Bytes TCPStore::get(const std::string& key) {
  check_key(key);
  Bytes msg;
  Writer w(msg);
  w.u8(kGet);
  w.str(key);
  w.u64(static_cast<uint64_t>(timeout().count()));
  std::string what = "waiting for " + keys_text({key});
  return client_->request(what, timeout(), timeout() + kReplyGrace, [&](Call& call) {
    call.send(msg);
    uint8_t t = call.tag();
    if (t == kReplyValue) return call.bytes(kMaxValue);
    if (t != kReplyTimeout) call.protocol_error();
    call.str();
    TANDEM_THROW(Timeout, client_->where, ": timed out after ", seconds_text(timeout()), " s ",
                 what);
  });
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  check_key(key);
  Bytes msg;
  Writer w(msg);
  w.u8(kAdd);
  w.str(key);
  w.u64(static_cast<uint64_t>(delta));
  return client_->request("adding to key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyInt) call.protocol_error();
    return static_cast<int64_t>(call.u64());
  });
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  TANDEM_CHECK(keys.size() <= kMaxKeys, Value, "store: check of ", keys.size(), " keys");
  Bytes msg;
  Writer w(msg);
  w.u8(kCheck);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) {
    check_key(k);
    w.str(k);
  }
  std::string what = "checking " + keys_text(keys);
  return client_->request(what, timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyBool) call.protocol_error();
    return call.u8() != 0;
  });
}

void TCPStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  if (keys.empty()) return;
  TANDEM_CHECK(keys.size() <= kMaxKeys, Value, "store: wait for ", keys.size(), " keys");
  Bytes msg;
  Writer w(msg);
  w.u8(kWait);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) {
    check_key(k);
    w.str(k);
  }
  w.u64(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
  client_->request("waiting for " + keys_text(keys), timeout, timeout + kReplyGrace,
                   [&](Call& call) {
                     call.send(msg);
                     uint8_t t = call.tag();
                     if (t == kReplyOk) return;
                     if (t != kReplyTimeout) call.protocol_error();
                     std::string missing = call.str();
                     TANDEM_THROW(Timeout, client_->where, ": timed out after ",
                                  seconds_text(timeout), " s waiting for key '", missing, "'");
                   });
}

bool TCPStore::delete_key(const std::string& key) {
  check_key(key);
  Bytes msg;
  Writer w(msg);
  w.u8(kDelete);
  w.str(key);
  return client_->request("deleting key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyBool) call.protocol_error();
    return call.u8() != 0;
  });
}

// ---- PrefixStore, barrier ------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : prefix_(std::move(prefix)), store_(std::move(store)) {
  TANDEM_CHECK(store_ != nullptr, Value, "PrefixStore '", prefix_, "': null store");
  timeout_ = store_->timeout();
}

void PrefixStore::set(const std::string& k, const Bytes& value) {
  store_->set(key(k), value);
}
Bytes PrefixStore::get(const std::string& k) {
  return store_->get(key(k));
}
int64_t PrefixStore::add(const std::string& k, int64_t delta) {
  return store_->add(key(k), delta);
}
bool PrefixStore::delete_key(const std::string& k) {
  return store_->delete_key(key(k));
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  for (auto& k : keys) full.push_back(key(k));
  return store_->check(full);
}

void PrefixStore::wait(const std::vector<std::string>& keys, Milliseconds timeout) {
  std::vector<std::string> full;
  for (auto& k : keys) full.push_back(key(k));
  store_->wait(full, timeout);
}

void store_barrier(Store& store, const std::string& name, int world_size, Milliseconds timeout) {
  auto start = Clock::now();
  int64_t arrived = store.add(name + "/arrived", 1);
  TANDEM_CHECK(arrived <= world_size, Dist, "store barrier '", name, "': ", arrived,
               " arrivals for a world of ", world_size, " (each barrier needs a new name)");
  if (arrived == world_size) store.set(name + "/done", "1");
  auto left = timeout - std::chrono::duration_cast<Milliseconds>(Clock::now() - start);
  try {
    store.wait({name + "/done"}, std::max(left, Milliseconds(0)));
  } catch (const TimeoutError&) {
    int64_t now = store.add(name + "/arrived", 0);
    TANDEM_THROW(Timeout, "store barrier '", name, "': timed out after ", seconds_text(timeout),
                 " s with ", now, " of ", world_size, " ranks arrived");
  }
}

}  // namespace tandem::parallel::dist
