// The TCP store's server, its side of the protocol (store_protocol.h): the hello that admits a
// client or turns it away (Note [store admission]), the requests (set, get, add, check, wait,
// delete, ...) against the keys, and the waiters -- gets and waits whose keys are missing, answered
// when a key is set or their deadline passes. The connections themselves are store_server.cpp's.
#include <algorithm>
#include <charconv>
#include <cstring>

#include "core/error.h"
#include "parallel/distributed/store_server.h"

namespace tandem::parallel::distributed {

using namespace store_wire;

// Note [store admission]
// A store port is a well-known number (29500 by default), so a second job started on the same
// machine, or a stale process of an earlier one, may connect to our server. Unlike PyTorch's
// TCPStore (which admits every connection) we do not let it in: the first message on every
// connection is a hello carrying a magic number, the protocol version, the job id (env.h says
// where it comes from), the client's rank and its role (session or plain, Note [disconnect
// tracking]). The server answers accept or reject before it reads anything else:
//   - wrong magic (not a tandem client: a port scanner, a browser, random bytes): the connection
//     is closed without a reply;
//   - another protocol version or another job id: a reject, then the connection is closed. The
//     data is never touched, and the client throws a DistError that names the reason (but not
//     the server's job id: it is not the client's business);
//   - a session for a rank that already has a live one: a reject naming the address it is
//     connected from (two processes with the same RANK);
//   - otherwise accepted.
// The job id is not a secret: it is derived from the address, port and world size, or it is the
// launcher's job id, which other users of the machine can see. Admission keeps apart jobs that
// meet by accident; it is no defence against someone who means harm: anyone who can reach the
// port and knows (or guesses) the id can read and write every key, and hold connections up to the
// cap (Note [store limits]). Put the store on an address only the job's machines can reach.
TCPStore::Server::Parse TCPStore::Server::hello(uint64_t id, Conn& c, Reader& r) {
  uint8_t cmd = 0, role = 0;
  uint32_t magic = 0, version = 0, rank = 0;
  std::string job;
  if (!r.u8(cmd)) return Parse::kIncomplete;
  if (cmd != kHello) return Parse::kBad;
  if (!r.u32(magic)) return Parse::kIncomplete;
  if (magic != kMagic) return Parse::kBad;
  if (!r.u32(version)) return Parse::kIncomplete;
  Writer w(c.out);
  if (version != kVersion) {  // before the rest: another version's hello may be laid out otherwise
    w.u8(kReplyReject);
    w.u8(kRejectVersion);
    c.closing = true;
    return Parse::kDone;
  }
  if (!r.bytes(job, kMaxJobId) || !r.u32(rank) || !r.u8(role))
    return r.bad() ? Parse::kBad : Parse::kIncomplete;
  if (job != job_id) {
    w.u8(kReplyReject);
    w.u8(kRejectJob);
    c.closing = true;
    return Parse::kDone;
  }
  c.rank = static_cast<int32_t>(rank);
  if (role == kRoleSession && c.rank >= 0) {
    auto held = sessions.find(c.rank);
    if (held != sessions.end()) {
      w.u8(kReplyReject);
      w.u8(kRejectRankTaken);
      w.str(conns.at(held->second).peer);
      c.closing = true;
      return Parse::kDone;
    }
    sessions[c.rank] = id;
    c.session = true;
  }
  c.admitted = true;
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
    case kDisconnected: {
      w.u8(kReplyRanks);
      w.u32(static_cast<uint32_t>(gone.size()));
      for (int rank : gone) w.u32(static_cast<uint32_t>(rank));
      return Parse::kDone;
    }
    case kBye:
      if (c.session) {  // the rank leaves in good order: its place is free at once
        sessions.erase(c.rank);
        c.session = false;
      }
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

}  // namespace tandem::parallel::distributed
