#pragma once
// Store: the small key-value service the processes of one job meet through.
//
// Rank 0 hosts a TCPStore server (a thread of its own); every rank, rank 0 included, talks to
// it as a client. It carries what the processes must agree on before any collective can run:
// the NCCL unique id, Gloo's pair addresses, barriers, each rank's progress (for the error
// message when one goes silent) and the abort flag. It is PyTorch's TCPStore, with two
// differences (Note [store admission] in store_server.cpp):
//   - it listens only on the address it is given, not on every interface;
//   - every client sends the job id in its hello; a client of another job (a stray process, a
//     second job started on the same port) is refused with a DistError on *its* side, and the
//     server's data is untouched.
//
// Disconnect tracking: when a client that said hello with a rank >= 0 closes its connection
// without saying goodbye (the destructor does; a crash, a kill or an exit without unwinding
// does not), the server sets store_disconnected_key(rank) = "1". Every other rank can then
// name the dead rank in its error message instead of waiting for it until a timeout.
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
  void set(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key);

  Milliseconds timeout() const { return timeout_; }
  void set_timeout(Milliseconds t) { timeout_ = t; }

 protected:
  Milliseconds timeout_{std::chrono::seconds(300)};
};

struct TCPStoreOptions {
  bool is_master = false;      // host the server here (rank 0)
  int rank = -1;               // for error messages ("rank 1"); -1: unknown
  Milliseconds timeout{std::chrono::seconds(300)};  // every wait, and connecting to the server
  // Only clients that present the same job id are admitted (Note [store admission]).
  std::string job_id;
};

// The TCP store. The master binds host:port (port 0: a free port, see port()) before the
// constructor returns, so a port that is taken is a DistError naming it at once; clients retry
// connecting until the timeout (the master may start later), then DistError "nothing listening
// at host:port". host is a name or numeric address; "localhost" resolves as usual.
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
  using Store::set;
  using Store::wait;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }  // the bound port (useful when 0 was asked for)
  std::string address() const;             // "host:port"

 private:
  struct Server;  // store_server.h
  struct Client;  // store_client.cpp
  std::string host_;
  uint16_t port_;
  TCPStoreOptions options_;
  std::unique_ptr<Server> server_;  // master only
  std::unique_ptr<Client> client_;
};

// "tandem/disconnected/<rank>": set by the server when that rank's connection drops without a
// goodbye (see the TCPStore comment above).
std::string store_disconnected_key(int rank);

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
