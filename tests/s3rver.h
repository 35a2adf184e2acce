// A real S3-compatible server for the tests of the remote checkpoint tier: s3rver (Node.js,
// installed by scripts/fetch-s3rver) started on a free localhost port, its data in a
// scratch folder, stopped (SIGTERM to the process we started) at the end. It answers the
// S3 protocol as a server does (it checks the SigV4 header's form and access key, not the
// signature itself).
//
//   S3rver s3(dir / "s3");  if (!s3.ok()) GTEST_SKIP() << s3.why();
//   s3.env()  "AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=S3RVER ..." for a command
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "comm/launcher.h"
#include "engine/checkpoint/s3_client.h"

namespace moetrain::testing {

class S3rver {
 public:
  static constexpr const char* kBucket = "moetrain-test";

  // Starts the server (port 0: a free one) with the bucket kBucket.
  explicit S3rver(std::string data_dir, int port = 0) : data_dir_(std::move(data_dir)) {
    const char* cache = std::getenv("MOETRAIN_S3RVER_CACHE");
    const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "/root";
    main_ = (cache ? std::string(cache) : home + "/.cache/moetrain/s3rver") + "/node_modules/s3rver/bin/s3rver.js";
    if (!std::filesystem::exists(main_)) {
      why_ = "s3rver is not installed (" + main_ + "): run scripts/fetch-s3rver";
      return;
    }
    port_ = port > 0 ? port : free_tcp_port();
    start();
  }
  ~S3rver() { stop(); }
  S3rver(const S3rver&) = delete;
  S3rver& operator=(const S3rver&) = delete;

  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  int port() const { return port_; }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // The variables a moetrain command needs to reach it (a shell prefix).
  std::string env() const {
    return "AWS_ENDPOINT_URL=" + endpoint() + " AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1 ";
  }
  S3Options options() const {
    S3Options o;
    o.endpoint = endpoint();
    o.access_key = "S3RVER";
    o.secret_key = "S3RVER";
    o.max_attempts = 3;
    o.backoff_s = 0.05;
    return o;
  }

  // Starts it (again, on the same port and data) / stops it: a server that goes away.
  void start() {
    std::filesystem::create_directories(data_dir_);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int null = ::open("/dev/null", O_WRONLY);  // its "listening on" line
      if (null >= 0) ::dup2(null, 1);
      const std::string port = std::to_string(port_);
      ::execlp("node", "node", main_.c_str(), "-d", data_dir_.c_str(), "-a", "127.0.0.1", "-p", port.c_str(),
               "--silent", "--configure-bucket", kBucket, static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Ready when it answers.
    S3Options o = options();
    o.max_attempts = 1;
    o.connect_timeout_s = 1;
    for (int i = 0; i < 300; ++i) {
      try {
        S3Client(o).list(kBucket, "");
        return;
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        why_ = "s3rver (" + main_ + ") exited at start";
        return;
      }
    }
    why_ = "s3rver did not answer on " + endpoint() + " within 15 s";
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  std::string data_dir_, main_, why_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace moetrain::testing
