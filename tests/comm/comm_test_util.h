// Helpers for the communication tests: a temporary directory, and N ranks run as threads
// of this process, each with its own Gloo communicator over one file store.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <filesystem>
#include <functional>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_communicator.h"
#include "comm/store.h"

namespace moetrain::testing {

// A fresh directory under the temp dir, removed at the end of the scope.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("moetrain_comm_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string str() const { return path_.string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Short enough that a bug fails the test instead of stalling ctest.
inline CommOptions test_options(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  CommOptions o;
  o.timeout = timeout;
  o.gloo_host = "127.0.0.1";
  return o;
}

// Runs `body` on `n` ranks, one thread each. Every rank connects its own communicator
// through one file store; an exception on a rank fails the test naming the rank. The
// communicators are destroyed only after every rank's body returned.
inline void run_ranks(int n, const std::function<void(Communicator&)>& body, CommOptions opt = test_options()) {
  TempDir dir;
  std::vector<std::string> errors(n);
  std::latch done(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm;
      try {
        auto store = Store::open(dir.str(), r, opt.timeout);
        comm = GlooCommunicator::connect(store, r, n, opt);
        body(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
      done.arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << n;
}

}  // namespace moetrain::testing
