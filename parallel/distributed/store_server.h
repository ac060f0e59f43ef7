#pragma once
// The TCP store's server (store.h): its state, declared here because TCPStore's constructor and
// destructor (store_client.cpp) own one. The connections, Note [store limits] and Note
// [disconnect tracking] are in store_server.cpp; the requests and Note [store admission] in
// store_requests.cpp. Internal: only the store's own files include it.
#include <deque>
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
    std::string peer;                  // "10.0.0.2:41234", for the log
    Clock::time_point hello_deadline;  // closed when not admitted by then
    Bytes in;                          // at most one request frame still arriving
    Bytes out;                         // at most one reply still leaving
    size_t out_pos = 0;
    bool admitted = false;
    int rank = -1;
    bool session = false;  // the rank's registered session (Note [disconnect tracking])
    bool closing = false;  // rejected: close once the reply is flushed
    bool dead = false;     // to be closed by the loop
    Waiter waiter;
  };

  enum class Parse { kDone, kIncomplete, kBad };
  enum LogKind { kLogRefused, kLogEvicted, kLogNoHello, kLogDropped, kLogGone, kLogKinds };

  // Binds host:want_port (0: a free port, `port` then says which) and starts the thread; a port
  // that is taken is a DistError naming it.
  Server(const std::string& host, uint16_t want_port, const TCPStoreOptions& options);
  ~Server();  // wakes the thread, joins it, closes every socket

  int listen_fd = -1;
  int wake[2] = {-1, -1};
  int reserve_fd = -1;  // spent to accept and refuse a connection when descriptors run out
  uint16_t port = 0;
  std::string job_id;
  Milliseconds hello_timeout;
  size_t max_conns = 0;
  std::thread thread;

  // Owned by the server thread.
  std::unordered_map<std::string, Bytes> data;
  std::map<uint64_t, Conn> conns;  // map: references stay valid while others are added
  std::unordered_map<std::string, std::set<uint64_t>> watchers;
  std::deque<uint64_t> pending;  // connections not yet admitted, oldest first (may hold stale ids)
  std::map<int, uint64_t> sessions;  // rank -> its session connection
  std::set<int> gone;                // ranks whose session ended without a goodbye
  uint64_t next_id = 0;
  Clock::time_point accept_paused_until{};
  struct LogLimit {
    Clock::time_point last{};
    int held = 0;
  } logs[kLogKinds];

  void run();
  void accept_all(Clock::time_point now);
  bool refuse_without_fd(Clock::time_point now);
  bool make_room();
  void read_from(uint64_t id, Conn& c);
  void parse(uint64_t id, Conn& c);
  Parse hello(uint64_t id, Conn& c, store_wire::Reader& r);
  Parse handle(uint64_t id, Conn& c, store_wire::Reader& r);
  static bool read_keys(store_wire::Reader& r, std::vector<std::string>& keys);
  void set_key(const std::string& key, Bytes value);
  void try_answer(uint64_t id, Conn& c);
  void unwatch(uint64_t id, Conn& c);
  void expire_waiters(Clock::time_point now);
  void expire_hellos(Clock::time_point now);
  const Conn* oldest_pending();
  void flush(Conn& c);
  void drop(Conn& c, const std::string& why);
  void close_dead();
  void log(LogKind kind, const std::string& message);
};

}  // namespace tandem::parallel::distributed
