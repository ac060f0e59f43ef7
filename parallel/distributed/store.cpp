// Store's string helpers, address resolution and the bind rule, PrefixStore and the barrier
// over any Store (store.h). The TCP store
// itself: the wire format in store_protocol.h, the server in store_server.cpp, the client and
// TCPStore's methods in store_client.cpp.
#include "parallel/distributed/store.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>

#include "core/error.h"
#include "parallel/distributed/store_protocol.h"

namespace tandem::parallel::distributed {

using store_wire::Clock;
using store_wire::seconds_text;

std::string Store::get_string(const std::string& key) {
  Bytes v = get(key);
  return std::string(v.begin(), v.end());
}

std::string store_disconnected_key(int rank) {
  return "tandem/disconnected/" + std::to_string(rank);
}

// ---- addresses ------------------------------------------------------------------------------

store_wire::Endpoint store_wire::resolve_endpoint(const std::string& host, uint16_t port) {
  const std::string name = unbracket(host);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(name.c_str(), nullptr, &hints, &res);
  TANDEM_CHECK(rc == 0 && res != nullptr, Dist, "store: cannot resolve host '", host,
               "': ", rc == 0 ? "no address" : ::gai_strerror(rc));
  const addrinfo* pick = nullptr;
  for (int family : {AF_INET, AF_INET6}) {
    for (const addrinfo* a = res; a != nullptr && pick == nullptr; a = a->ai_next)
      if (a->ai_family == family) pick = a;
  }
  if (pick == nullptr) {
    ::freeaddrinfo(res);
    TANDEM_THROW(Dist, "store: host '", host, "' has no IPv4 or IPv6 address");
  }
  Endpoint e;
  std::memcpy(&e.addr, pick->ai_addr, pick->ai_addrlen);
  e.len = pick->ai_addrlen;
  e.family = pick->ai_family;
  ::freeaddrinfo(res);
  char ip[INET6_ADDRSTRLEN] = "";
  if (e.family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&e.addr);
    a->sin_port = htons(port);
    ::inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    e.loopback = (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&e.addr);
    a->sin6_port = htons(port);
    ::inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    e.loopback = IN6_IS_ADDR_LOOPBACK(&a->sin6_addr) ||
                 (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127);
  }
  e.ip = ip;
  return e;
}

namespace {

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// The names that land on loopback through /etc/hosts rather than DNS: localhost and the
// machine's own name (as `hostname` or `hostname -f` prints it). Only these are resolved by the
// check, so reading the environment never waits for a name server.
bool local_name(const std::string& name) {
  const std::string n = lower(name);
  if (n == "localhost" || (n.size() > 10 && n.compare(n.size() - 10, 10, ".localhost") == 0))
    return true;
  char buf[256] = "";
  if (::gethostname(buf, sizeof buf - 1) != 0) return false;
  const std::string own = lower(buf);
  const std::string own_short = own.substr(0, own.find('.'));
  return !own.empty() && (n == own || n.substr(0, n.find('.')) == own_short);
}

}  // namespace

void check_store_address(const std::string& host, int world_size, int local_world_size,
                         const std::string& what) {
  if (local_world_size <= 0 || world_size <= local_world_size) return;
  const std::string name = store_wire::unbracket(host);
  in6_addr any;
  if (::inet_pton(AF_INET, name.c_str(), &any) == 1 ||
      ::inet_pton(AF_INET6, name.c_str(), &any) == 1)
    return;  // numeric: taken at its word
  if (!local_name(name)) return;
  store_wire::Endpoint e;
  try {
    e = store_wire::resolve_endpoint(host, 0);
  } catch (const DistError&) {
    return;  // the store says so, where it is used
  }
  TANDEM_CHECK(!e.loopback, Dist, what, " resolves to ", e.ip,
               ", a loopback address, but the job spans several nodes (world size ", world_size,
               ", ", local_world_size,
               " per node): ranks on other nodes cannot reach rank 0's store there; "
               "set MASTER_ADDR to an address of rank 0's node that the other nodes can reach "
               "(`hostname -I` lists this node's), not a name that /etc/hosts maps to loopback "
               "(Debian and Ubuntu map the machine's own name to 127.0.1.1)");
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

}  // namespace tandem::parallel::distributed
