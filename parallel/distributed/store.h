#pragma once
// Store: the small key-value service the processes of one job meet through.
//
// Rank 0 hosts a TCPStore server (a thread of its own); every rank, rank 0 included, talks to
// it as a client. It carries what the processes must agree on before any collective can run:
// the NCCL unique id, Gloo's pair addresses, barriers, each rank's progress (for the error
// message when one goes silent) and the abort flag. It is PyTorch's TCPStore, with two
// differences (Note [store admission] in store_requests.cpp):
//   - it listens only on the address it is given, not on every interface;
//   - every client sends the job id in its hello; a client of another job (a stray process, a
//     second job started on the same port) is refused with a DistError on *its* side, and the
//     server's data is untouched.
//
// Disconnect tracking (Note [disconnect tracking] in store_server.cpp): each client with a rank
// >= 0 holds one session connection that carries no requests; when it ends without a goodbye
// (the destructor says one; a crash, a kill or an exit without unwinding does not), the server
// marks the rank: disconnected_ranks() names it, and store_disconnected_key(rank) = "1". Every
// other rank can then name the dead rank in its error message instead of waiting for it until
// a timeout. A second client with the rank of a live one is refused (two processes with the
// same RANK).
//
// Limits (Note [store limits]): a connection must say hello within hello_timeout, the server
// holds at most max_connections, and a client that pipelines requests or sends one over
// kMaxRequest is dropped; none of it can make the server spin or grow without bound.
//
// Threads: a TCPStore may be shared by the threads of a process. Each request takes a
// connection of its own from a small pool (one more is opened when all are busy), so a thread
// blocked in get or wait does not hold up the others.
//
// Every blocking call has a deadline (the store's timeout unless given) and its error names
// the address, this rank and the key it was waiting for:
//   "store 127.0.0.1:29500 (rank 1): timed out after 30 s waiting for key 'nccl/id'"
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tandem::parallel::distributed {

using Bytes = std::vector<uint8_t>;
using Milliseconds = std::chrono::milliseconds;

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value (overwrites).
  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits until key exists (up to timeout()), then returns its value. TimeoutError otherwise.
  virtual Bytes get(const std::string& key) = 0;
  // Adds delta to the integer stored at key (a missing key counts as 0) and returns the new
  // value; atomic across clients. The value is stored as its decimal text.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists; never blocks.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists. TimeoutError naming the first missing key after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, Milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }
  // Removes key; true when it existed.
  virtual bool delete_key(const std::string& key) = 0;

  // Convenience forms over set/get with strings.
  void set(const std::string& key, const std::string& value) {
    set(key, Bytes(value.begin(), value.end()));
  }
  std::string get_string(const std::string& key);

  Milliseconds timeout() const { return timeout_; }
  void set_timeout(Milliseconds t) { timeout_ = t; }

  // The ranks whose connection to the store ended without a goodbye, ascending (the rule: Note
  // [disconnect tracking] in store_server.cpp). Store-wide: a PrefixStore asks the store under it.
  // A store that does not track connections knows of none.
  virtual std::vector<int> disconnected_ranks() { return {}; }

 protected:
  Milliseconds timeout_{std::chrono::seconds(300)};
};

struct TCPStoreOptions {
  bool is_master = false;                           // host the server here (rank 0)
  int rank = -1;                                    // for error messages ("rank 1"); -1: unknown
  Milliseconds timeout{std::chrono::seconds(300)};  // every wait, and connecting to the server
  // Only clients that present the same job id are admitted (Note [store admission]).
  std::string job_id;
  // The job's shape, 0 when unknown: a job that spans nodes (world_size > local_world_size) may
  // not reach the store through a name that resolves to loopback (check_store_address), and the
  // connection cap grows with the world size.
  int world_size = 0;
  int local_world_size = 0;
  // Master only: a connection that has not completed its hello this long after it was accepted
  // is closed.
  Milliseconds hello_timeout{std::chrono::seconds(5)};
  // Master only: the most connections the server holds at once (0: 64 + 8 per rank, or 4096 when
  // the world size is unknown); never more than the file-descriptor limit less a reserve (a
  // quarter of it, or 256) for the rest of the process.
  int max_connections = 0;
};

// The TCP store. The master binds host:port (port 0: a free port, see port()) before the
// constructor returns, so a port that is taken is a DistError naming it at once; clients retry
// connecting until the timeout (the master may start later), then DistError "nothing listening
// at host:port". host is a name or a numeric address, IPv4 or IPv6 ("::1" or "[::1]"); a name
// resolves to its first IPv4 address, else its first IPv6 one (Note [the store's address]).
class TCPStore : public Store {
 public:
  TCPStore(std::string host, uint16_t port, TCPStoreOptions options);
  ~TCPStore() override;  // closes the client; the master stops its server thread
  TCPStore(const TCPStore&) = delete;
  TCPStore& operator=(const TCPStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool delete_key(const std::string& key) override;
  std::vector<int> disconnected_ranks() override;
  using Store::set;
  using Store::wait;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }  // the bound port (useful when 0 was asked for)
  std::string address() const;             // "host:port", "[::1]:port"

 private:
  friend class TCPStoreServer;
  struct Server;  // store_server.h
  struct Client;  // store_client.cpp
  std::string host_;
  uint16_t port_;
  TCPStoreOptions options_;
  std::unique_ptr<Server> server_;  // master only
  std::unique_ptr<Client> client_;
};

// The store's server alone, with no client in this process: what tandem-run --standalone hosts
// for its workers (Note [the launcher hosts the store] in launch.cpp). It binds host:port (0: a
// free port, port() says which) before the constructor returns and serves until destroyed.
// options: job_id, world_size, local_world_size, hello_timeout and max_connections, as for a
// master TCPStore (is_master and rank are not read).
class TCPStoreServer {
 public:
  TCPStoreServer(const std::string& host, uint16_t port, const TCPStoreOptions& options);
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  uint16_t port() const;

 private:
  std::unique_ptr<TCPStore::Server> server_;
};

// "tandem/disconnected/<rank>": set by the server when that rank's session drops without a
// goodbye (see the TCPStore comment above). At the root of the key space: through a PrefixStore,
// ask disconnected_ranks() instead.
std::string store_disconnected_key(int rank);

// The bind rule (Note [the store's address] in store_server.cpp). When the job spans several
// nodes (world_size > local_world_size > 0), localhost or the machine's own name resolving to a
// loopback address is a DistError naming the address and the fix: Debian and Ubuntu map the
// machine's own name to 127.0.1.1, so MASTER_ADDR=$(hostname) would put the store where no other
// node reaches it. A numeric address is taken at its word; other names are not looked up here
// (no wait for a name server); a name that does not resolve is left to the store to report.
// `what` names the host in the message ("MASTER_ADDR=node0", "store host 'node0'").
void check_store_address(const std::string& host, int world_size, int local_world_size,
                         const std::string& what);

// Every key of `store` under "prefix/": lets independent users (a process group, a barrier,
// Gloo's rendezvous) share one store without their keys colliding.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override;
  bool delete_key(const std::string& key) override;
  // Store-wide, not under the prefix: the store below answers.
  std::vector<int> disconnected_ranks() override { return store_->disconnected_ranks(); }
  using Store::set;
  using Store::wait;
  const std::shared_ptr<Store>& base() const { return store_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::string prefix_;
  std::shared_ptr<Store> store_;
};

// A barrier of `world_size` ranks over the store, named `name` (each use needs a new name, e.g.
// with a counter): every rank adds 1 to "<name>/arrived" and waits for "<name>/done", which the
// last to arrive sets. TimeoutError after `timeout` naming the barrier and how many of
// world_size had arrived.
void store_barrier(Store& store, const std::string& name, int world_size, Milliseconds timeout);

}  // namespace tandem::parallel::distributed
