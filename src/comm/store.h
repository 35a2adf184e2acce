// Store: the key-value table where the ranks of a job meet before they can talk to each
// other. Each rank publishes its transport address (and NCCL's unique id) under a key and
// reads the others'. Keys are written once; reads wait for the key, up to a timeout.
//
// Kinds, by spec:
//   "file:DIR" or "DIR"      files in a directory every rank can reach (gloo's FileStore).
//                            One directory per run: keys of an earlier run are an error.
//   "redis://HOST[:PORT]"    a Redis server (gloo's RedisStore; port 6379 by default).
//   "tcp://HOST:PORT"        a small server that rank 0 starts on PORT (TcpStore).
//   "memory"                 this process only (gloo's HashStore): one rank, or tests that
//                            run ranks as threads sharing one Store object.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gloo::rendezvous {
class Store;
}

namespace moetrain {

struct LaunchEnv;

class Store {
 public:
  // `rank` matters only for "tcp://" (rank 0 serves). `timeout` bounds every wait.
  static std::shared_ptr<Store> open(const std::string& spec, int rank, std::chrono::milliseconds timeout);

  // A view of the same table whose keys all start with `prefix` + "/": each communicator
  // and each rendezvous gets its own key space.
  std::shared_ptr<Store> prefixed(const std::string& prefix) const;

  // Errors name the key and the store (an existing key: "already set").
  void set(const std::string& key, const std::vector<char>& value);
  // Waits for the key up to the timeout, then returns its value.
  std::vector<char> get(const std::string& key);
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  // "file store /tmp/x", "redis store host:6379 (prefix world/ep)": for messages.
  std::string description() const;
  std::chrono::milliseconds timeout() const { return timeout_; }

  // gloo's view of this store (same prefix, errors and timeout), for gloo's rendezvous.
  gloo::rendezvous::Store& gloo_view();

  ~Store();

 private:
  struct Backend;
  class GlooView;
  Store(std::shared_ptr<Backend> backend, std::string prefix, std::chrono::milliseconds timeout);
  std::string full_key(const std::string& key) const;

  std::shared_ptr<Backend> backend_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<GlooView> view_;
};

// The store spec a job uses when none is configured:
//   1. MOETRAIN_STORE (env.store) when set (`moetrain launch` sets a fresh directory);
//   2. "memory" for a job of one rank;
//   3. "tcp://MASTER_ADDR:PORT" when the launcher gave MASTER_ADDR and MASTER_PORT, with
//      PORT = MASTER_PORT + 1 under torchrun (its agent's own store holds MASTER_PORT);
//   4. a file store under the temp directory named after env.run_id when every rank runs
//      on this machine;
//   otherwise an Error saying what to set.
std::string default_store_spec(const LaunchEnv& env);

// "host:port" (or "[v6]:port") -> (host, port); without a port, `default_port` when it is
// > 0, else an error. Errors begin with `what` ("store 'tcp://x'", "--rdzv-endpoint 'x'").
std::pair<std::string, int> split_host_port(const std::string& what, const std::string& text, int default_port);

}  // namespace moetrain
