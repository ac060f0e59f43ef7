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
// little-endian, strings and values a u32 length and the bytes. The hello goes as it is; every
// request after it is a frame: its length (u32) and then the message, so the server knows at once
// how much to wait for and parses each request once, however it arrives (Note [store limits] in
// store_server.cpp). One request is in flight per connection at a time, so replies need no ids.

constexpr uint32_t kMagic = 0x746e646d;  // "tndm"
constexpr uint32_t kVersion = 2;
constexpr size_t kMaxKey = 4096;
constexpr size_t kMaxJobId = 4096;
constexpr size_t kMaxValue = size_t{64} << 20;
constexpr uint32_t kMaxKeys = 1 << 16;  // in one check/wait
// The largest frame: a set of the largest value (a check or wait of many keys must fit too).
constexpr size_t kMaxRequest = kMaxValue + kMaxKey + 64;

enum Command : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kDelete,
  kBye,
  kDisconnected
};
// hello:        magic u32, version u32, job id, rank i32, role u8 -> accept | reject(reason u8
//                                                                    [, holder's address])
// set:          key, value                        -> ok
// get:          key, timeout_ms u64               -> value(bytes) | timeout(missing key)
// add:          key, delta i64                    -> int(i64) | error(message)
// check:        n u32, n keys                     -> bool(u8)
// wait:         n u32, n keys, timeout_ms u64     -> ok | timeout(missing key)
// delete:       key                               -> bool(u8)
// bye:                                            -> ok
// disconnected:                                   -> ranks(n u32, n i32)
enum ReplyTag : uint8_t {
  kReplyOk = 1,
  kReplyValue,
  kReplyInt,
  kReplyBool,
  kReplyTimeout,
  kReplyAccept,
  kReplyReject,
  kReplyError,
  kReplyRanks
};
// A reject of a rank that is taken carries the address the rank is connected from.
enum RejectReason : uint8_t { kRejectJob = 1, kRejectVersion = 2, kRejectRankTaken = 3 };
// The session connection of a rank is the one the server tracks (Note [disconnect tracking] in
// store_server.cpp); requests go over plain ones.
enum Role : uint8_t { kRolePlain = 0, kRoleSession = 1 };

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

// A request frame: begin() leaves room for the length, end() writes it.
inline Writer begin_frame(Bytes& out) {
  out.assign(4, 0);
  return Writer(out);
}
inline void end_frame(Bytes& out) {
  uint32_t n = static_cast<uint32_t>(out.size() - 4);
  for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
}

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

// A resolved store address: IPv4 when the host has one, else IPv6 (Note [the store's address]
// in store_server.cpp).
struct Endpoint {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
  std::string ip;  // numeric, for messages
  bool loopback = false;
};

// "[::1]" -> "::1": the bracketed form of an IPv6 address is accepted everywhere.
inline std::string unbracket(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    return host.substr(1, host.size() - 2);
  return host;
}

// Resolves host (a name or a numeric address, IPv4 or IPv6). Throws DistError when it cannot.
Endpoint resolve_endpoint(const std::string& host, uint16_t port);

// "10.0.0.1:29500", "[::1]:29500"
inline std::string host_port(const std::string& host, uint16_t port) {
  std::string h = unbracket(host);
  if (h.find(':') != std::string::npos) h = "[" + h + "]";
  return h + ":" + std::to_string(port);
}

// A poll() timeout that ends just after `deadline` (0 once it has passed).
inline int poll_ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left + 1, 0, 1 << 30));
}

}  // namespace tandem::parallel::distributed::store_wire
