// A real etcd (Debian's etcd-server) for the tests of the etcd rendezvous: on free
// localhost ports, its data in a directory of the test, killed and started again at will
// (it keeps its keys on disk across restarts, as a site's etcd does).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "comm/launcher.h"

namespace moetrain::testing {

class EtcdServer {
 public:
  explicit EtcdServer(const std::string& data_dir) : dir_(data_dir) {
    client_ = free_tcp_port();
    peer_ = free_tcp_port();
  }
  static bool available() { return ::access("/usr/bin/etcd", X_OK) == 0; }
  void start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string c = "http://127.0.0.1:" + std::to_string(client_);
      const std::string p = "http://127.0.0.1:" + std::to_string(peer_);
      const std::string log = dir_ + ".log";
      FILE* f = std::freopen(log.c_str(), "a", stderr);
      (void)f;
      std::freopen("/dev/null", "w", stdout);
      ::execl("/usr/bin/etcd", "etcd", "--data-dir", dir_.c_str(), "--listen-client-urls", c.c_str(),
              "--advertise-client-urls", c.c_str(), "--listen-peer-urls", p.c_str(), "--initial-advertise-peer-urls",
              p.c_str(), "--initial-cluster", ("default=" + p).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    pid_ = -1;
  }
  ~EtcdServer() { kill(); }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_); }

 private:
  std::string dir_;
  int client_ = 0, peer_ = 0;
  pid_t pid_ = -1;
};

}  // namespace moetrain::testing
