#pragma once
// The TCP store's wire format and the helpers its server (store_server.cpp), its client
// (store_client.cpp) and the barrier (store.cpp) share. Internal: only the store's own files
// include it; the contract is store.h.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "core/error.h"
#include "parallel/distributed/store.h"

namespace tandem::parallel::distributed::store_wire {

using Clock = std::chrono::steady_clock;

// ---- the wire format ---------------------------------------------------------------------
//
// A message is a command byte and its fields; a reply is a tag byte and its fields. Integers are
// little-endian, strings and values a u32 length and the bytes. One request is in flight per
// connection at a time, so replies need no ids. The hello and its bounds: Note [store
// admission] in store_server.cpp.

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

// ---- shared helpers ------------------------------------------------------------------------

// "0.3", "2", "1.25": timeouts are printed in seconds, without trailing zeros.
inline std::string seconds_text(Milliseconds t) {
  if (t.count() % 1000 == 0) return std::to_string(t.count() / 1000);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", t.count() / 1000.0);
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  return s;
}

inline sockaddr_in resolve_ipv4(const std::string& host, uint16_t port) {
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

// A poll() timeout that ends just after `deadline` (0 once it has passed).
inline int poll_ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left + 1, 0, 1 << 30));
}

}  // namespace tandem::parallel::distributed::store_wire
