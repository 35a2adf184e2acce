// TcpStore: a rendezvous store over plain TCP, for jobs that span machines with no shared
// directory and no Redis server. Rank 0 runs the server (a thread holding a map of keys)
// on a port every rank knows (MASTER_PORT); every rank, rank 0 included, is a client.
//
// What rendezvous needs: set a key once, read it (waiting, or not), wait for keys by
// polling, and add to a counter atomically (the elastic agents' membership, comm/rendezvous.h).
// The server lives as long as rank 0's TcpStore, so rank 0 keeps it until the job ends; or
// it runs on its own (TcpStoreServer, `moetrain rdzv-server`), optionally keeping a journal
// so that a restarted server comes back with every key.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace moetrain {

// The server alone: a thread answering on `port` (0: any free port), all interfaces. With a
// journal path, every change is appended to that file and a server started on an existing
// journal begins with its keys (a store restarted under running agents loses nothing).
class TcpStoreServer {
 public:
  explicit TcpStoreServer(int port, const std::string& journal = "");
  ~TcpStoreServer();
  int port() const;
  size_t keys() const;  // how many keys it holds (for logs and tests)

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

class TcpStore : public gloo::rendezvous::Store {
 public:
  // serve: start the server on `port` (all interfaces) before connecting to host:port.
  // Connecting retries until `timeout`, since the server may start after the clients.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // Sets the key unless it is set; false when it was (the value there stays).
  bool set_once(const std::string& key, const std::vector<char>& data);
  // The value, or nullopt when the key is not set; does not wait.
  std::optional<std::vector<char>> try_get(const std::string& key);
  // Adds `delta` to the counter `key` (absent: 0), atomically over all clients; returns the sum.
  int64_t add(const std::string& key, int64_t delta);

  // After a lost connection, connect again (until the timeout) and repeat the request,
  // instead of failing at once: for clients of a server that may restart (the agents of an
  // elastic job). An add whose reply was lost may then count twice.
  void set_reconnect(bool on) { reconnect_ = on; }

  // The port the server listens on (useful with port 0: any free port).
  int port() const { return port_; }

 private:
  // Sends one request and reads the reply's status byte and value; false: key absent.
  bool request(char op, const std::string& key, const std::vector<char>* value, std::vector<char>* out);
  bool request_once(const std::string& msg, char* status, std::vector<char>* out);
  void connect();

  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TcpStoreServer> server_;
  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;
  bool reconnect_ = false;
};

}  // namespace moetrain
