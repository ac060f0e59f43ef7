// Store's string helpers, PrefixStore and the barrier over any Store (store.h). The TCP store
// itself: the wire format in store_protocol.h, the server in store_server.cpp, the client and
// TCPStore's methods in store_client.cpp.
#include "parallel/distributed/store.h"

#include <algorithm>

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
