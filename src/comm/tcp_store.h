// TcpStore: a rendezvous store over plain TCP, for jobs that span machines with no shared
// directory and no Redis server. Rank 0 runs the server (a thread holding a map of keys)
// on a port every rank knows (MASTER_PORT); every rank, rank 0 included, is a client.
//
// Only what rendezvous needs: set a key once, read it, wait for keys by polling. The
// server lives as long as rank 0's TcpStore, so rank 0 keeps it until the job ends.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace moetrain {

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

  // The port the server listens on (useful with port 0: any free port).
  int port() const { return port_; }

 private:
  class Server;
  // Sends one request and reads the reply's status byte and value; false: key absent.
  bool request(char op, const std::string& key, const std::vector<char>* value, std::vector<char>* out);

  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Server> server_;
  std::mutex mu_;  // one request at a time on the connection
  int fd_ = -1;
};

}  // namespace moetrain
