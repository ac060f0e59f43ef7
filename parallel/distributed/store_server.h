#pragma once
// The TCP store's server (store.h): its state, declared here because TCPStore's constructor and
// destructor (store_client.cpp) own one. The code, Note [store admission] and the disconnect
// tracking are in store_server.cpp. Internal: only the store's own files include it.
#include <map>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "parallel/distributed/store_protocol.h"

namespace tandem::parallel::distributed {

struct TCPStore::Server {
  using Clock = store_wire::Clock;

  // A get/wait whose keys are missing, parked on its connection until they appear or its
  // deadline passes.
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

  // Binds host:want_port (0: a free port, `port` then says which) and starts the thread; a port
  // that is taken is a DistError naming it.
  Server(const std::string& host, uint16_t want_port, std::string job);
  ~Server();  // wakes the thread, joins it, closes every socket

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

  void run();
  void accept_all();
  void read_from(uint64_t id, Conn& c);
  Parse hello(Conn& c, store_wire::Reader& r);
  Parse handle(uint64_t id, Conn& c, store_wire::Reader& r);
  static bool read_keys(store_wire::Reader& r, std::vector<std::string>& keys);
  void set_key(const std::string& key, Bytes value);
  void try_answer(uint64_t id, Conn& c);
  void unwatch(uint64_t id, Conn& c);
  void expire_waiters(Clock::time_point now);
  void flush(Conn& c);
  void close_dead();
};

}  // namespace tandem::parallel::distributed
