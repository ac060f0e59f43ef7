// The TCP store's client: the connection pool every rank talks to the server through, and the
// TCPStore methods (store.h). The wire format is in store_protocol.h, the server in
// store_server.cpp.
//
// A pool of connections, each carrying one request at a time: a thread takes an idle
// connection (or opens one more) for the length of its request, so a thread blocked in a long
// get or wait never holds up the other threads of the process. Most processes only ever open
// one. The lock guards the pool only, never a request.
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "parallel/distributed/store.h"
#include "parallel/distributed/store_protocol.h"
#include "parallel/distributed/store_server.h"

namespace tandem::parallel::distributed {

using namespace store_wire;

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

// The server closed a connection before answering its hello (at its cap, Note [store limits]):
// the client tries again until its deadline.
struct ClosedEarly {};

// One connect attempt bounded by `deadline`; -1 when nothing accepted it.
int connect_once(const Endpoint& addr, Clock::time_point deadline) {
  int fd = ::socket(addr.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr.addr), addr.len) != 0) {
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
  uint32_t u32() {
    uint8_t b[4];
    recv_exact(b, 4);
    return b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t{b[3]} << 24);
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
  // A lost connection throws ClosedEarly instead of the DistError (for the hello).
  void closed_early_is_retried() { closed_early_ = true; }
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
    if (closed_early_) throw ClosedEarly{};
    TANDEM_THROW(Dist, where_, ": connection lost while ", what_,
                 " (rank 0, which hosts the store, may have exited)");
  }

  Connection& c_;
  const std::string& where_;
  std::string what_;
  Milliseconds shown_;
  Clock::time_point deadline_;
  bool closed_early_ = false;
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
  std::string where;    // "store host:port (rank R)", the start of every message
  std::string address;  // "host:port"
  TCPStoreOptions options;
  Endpoint addr;
  std::unique_ptr<Connection> session;  // Note [disconnect tracking]: hello and bye only
  std::mutex mu;                        // guards `idle`
  std::vector<std::unique_ptr<Connection>> idle;

  Client(const std::string& host, uint16_t port, TCPStoreOptions opts)
      : address(host_port(host, port)),
        options(std::move(opts)),
        addr(resolve_endpoint(host, port)) {
    std::string rank = options.rank >= 0 ? std::to_string(options.rank) : "unknown";
    where = "store " + address + " (rank " + rank + ")";
    // The master may start after us: retry until the timeout.
    session = open(kRoleSession, Clock::now() + options.timeout, true, "connecting");
  }

  ~Client() {
    // Plain connections just close; the goodbye on the session is what tells the server that
    // this rank leaves in good order.
    if (!session || session->broken) return;
    try {
      Bytes msg;
      Writer w = begin_frame(msg);
      w.u8(kBye);
      end_frame(msg);
      Call call(*session, where, "saying goodbye", Milliseconds(500),
                Clock::now() + Milliseconds(500));
      call.send(msg);
      call.u8();  // the ack: the server has read the bye before we close
    } catch (const Error&) {
      // The server is gone or slow; closing is all that is left.
    }
  }

  // A connection that said hello and was accepted. `first`: the server may not be up yet, so
  // a refused connect is retried too; later, a refused connect means the server went away. A
  // connection the server closes before answering (its cap) is retried until the deadline.
  std::unique_ptr<Connection> open(Role role, Clock::time_point deadline, bool first,
                                   const std::string& what) {
    int closed_early = 0;
    for (;;) {
      int fd = connect_once(addr, deadline);
      if (fd >= 0) {
        std::unique_ptr<Connection> c;
        try {
          c = hello(fd, role, deadline);
        } catch (const TimeoutError&) {
          if (closed_early == 0) throw;  // else the deadline ran out between refusals
        }
        if (c) return c;
        ++closed_early;
      } else {
        TANDEM_CHECK(first || closed_early > 0, Dist, where, ": connection lost while ", what,
                     " (rank 0, which hosts the store, may have exited)");
      }
      auto now = Clock::now();
      if (now >= deadline) {
        TANDEM_CHECK(closed_early == 0, Dist, where,
                     ": the server closed the connection before answering our hello (",
                     closed_early, " tries in ", seconds_text(options.timeout),
                     " s); it may be at its connection cap (too many clients, or a flood of "
                     "connections on its port)");
        TANDEM_THROW(Dist, "store: nothing listening at ", address, " (rank ",
                     options.rank >= 0 ? std::to_string(options.rank) : "unknown", ") after ",
                     seconds_text(options.timeout),
                     " s; is MASTER_ADDR/MASTER_PORT right and is rank 0 running?");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(kRetryEvery, deadline - now));
    }
  }

  // nullptr when the server closed the connection before answering.
  std::unique_ptr<Connection> hello(int fd, Role role, Clock::time_point deadline) {
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    Call call(*c, where, "waiting for the store's answer to our hello", options.timeout, deadline);
    call.closed_early_is_retried();
    Bytes msg;
    Writer w(msg);
    w.u8(kHello);
    w.u32(kMagic);
    w.u32(kVersion);
    w.str(options.job_id);
    w.u32(static_cast<uint32_t>(options.rank));
    w.u8(role);
    uint8_t t = 0;
    try {
      call.send(msg);
      t = call.u8();
    } catch (const ClosedEarly&) {
      return nullptr;
    }
    if (t == kReplyAccept) return c;
    if (t != kReplyReject) call.protocol_error();
    c->broken = true;
    uint8_t reason = 0;
    std::string from;
    try {
      reason = call.u8();
      if (reason == kRejectRankTaken) from = call.str();
    } catch (const ClosedEarly&) {
      call.protocol_error();
    }
    TANDEM_CHECK(reason != kRejectJob, Dist, where,
                 ": refused: the server belongs to another job (job id '", options.job_id,
                 "' here, server's differs); is another job using this port?");
    TANDEM_CHECK(reason != kRejectRankTaken, Dist, where, ": refused: rank ", options.rank,
                 " is already connected to this store (from ", from,
                 "); is RANK the same in two processes?");
    TANDEM_THROW(Dist, where,
                 ": refused: the server speaks another version of the store "
                 "protocol (",
                 kVersion, " here); is another job using this port?");
  }

  // An idle connection, or a new one.
  std::unique_ptr<Connection> take(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!idle.empty()) {
        auto c = std::move(idle.back());
        idle.pop_back();
        return c;
      }
    }
    return open(kRolePlain, Clock::now() + options.timeout, false, what);
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
  check_store_address(host_, options_.world_size, options_.local_world_size,
                      "store host '" + host_ + "'");
  if (options_.is_master) {
    server_ = std::make_unique<Server>(host_, port_, options_);
    port_ = server_->port;
  }
  client_ = std::make_unique<Client>(host_, port_, options_);
}

TCPStore::~TCPStore() {
  client_.reset();  // says bye first, so our own server does not report us disconnected
  server_.reset();
}

TCPStoreServer::TCPStoreServer(const std::string& host, uint16_t port, const TCPStoreOptions& options) {
  check_store_address(host, options.world_size, options.local_world_size, "store host '" + host + "'");
  server_ = std::make_unique<TCPStore::Server>(host, port, options);
}

TCPStoreServer::~TCPStoreServer() = default;

uint16_t TCPStoreServer::port() const {
  return server_->port;
}

std::string TCPStore::address() const {
  return host_port(host_, port_);
}

void TCPStore::set(const std::string& key, const Bytes& value) {
  check_key(key);
  TANDEM_CHECK(value.size() <= kMaxValue, Value, "store: value of ", value.size(),
               " bytes for key '", key, "' is over the limit of ", kMaxValue);
  Bytes msg;
  Writer w = begin_frame(msg);
  w.u8(kSet);
  w.str(key);
  w.bytes(value);
  end_frame(msg);
  client_->request("setting key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyOk) call.protocol_error();
  });
}

Bytes TCPStore::get(const std::string& key) {
  check_key(key);
  Bytes msg;
  Writer w = begin_frame(msg);
  w.u8(kGet);
  w.str(key);
  w.u64(static_cast<uint64_t>(timeout().count()));
  std::string what = "waiting for " + keys_text({key});
  end_frame(msg);
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
  Writer w = begin_frame(msg);
  w.u8(kAdd);
  w.str(key);
  w.u64(static_cast<uint64_t>(delta));
  end_frame(msg);
  return client_->request("adding to key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyInt) call.protocol_error();
    return static_cast<int64_t>(call.u64());
  });
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  TANDEM_CHECK(keys.size() <= kMaxKeys, Value, "store: check of ", keys.size(), " keys");
  Bytes msg;
  Writer w = begin_frame(msg);
  w.u8(kCheck);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) {
    check_key(k);
    w.str(k);
  }
  std::string what = "checking " + keys_text(keys);
  end_frame(msg);
  TANDEM_CHECK(msg.size() - 4 <= kMaxRequest, Value, "store: a check of ", keys.size(), " keys is ",
               msg.size() - 4, " bytes, over the limit of ", kMaxRequest);
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
  Writer w = begin_frame(msg);
  w.u8(kWait);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (auto& k : keys) {
    check_key(k);
    w.str(k);
  }
  w.u64(static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0)));
  end_frame(msg);
  TANDEM_CHECK(msg.size() - 4 <= kMaxRequest, Value, "store: a wait for ", keys.size(), " keys is ",
               msg.size() - 4, " bytes, over the limit of ", kMaxRequest);
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
  Writer w = begin_frame(msg);
  w.u8(kDelete);
  w.str(key);
  end_frame(msg);
  return client_->request("deleting key '" + key + "'", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyBool) call.protocol_error();
    return call.u8() != 0;
  });
}

std::vector<int> TCPStore::disconnected_ranks() {
  Bytes msg;
  Writer w = begin_frame(msg);
  w.u8(kDisconnected);
  end_frame(msg);
  return client_->request("asking which ranks left", timeout(), timeout(), [&](Call& call) {
    call.send(msg);
    if (call.tag() != kReplyRanks) call.protocol_error();
    uint32_t n = call.u32();
    if (n > (1u << 24)) call.protocol_error();
    std::vector<int> ranks;
    for (uint32_t i = 0; i < n; ++i) ranks.push_back(static_cast<int32_t>(call.u32()));
    return ranks;
  });
}

}  // namespace tandem::parallel::distributed
