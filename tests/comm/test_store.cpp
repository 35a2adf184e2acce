// Rendezvous stores: file, TCP and memory; waits that time out; an earlier run's keys.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "comm/launcher.h"
#include "comm/tcp_store.h"
#include "comm_test_util.h"

namespace moetrain {
namespace {

using testing::TempDir;
using namespace std::chrono_literals;

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<char>& v) { return {v.begin(), v.end()}; }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CommStore, FileStoreSetGetAndPrefixes) {
  TempDir dir;
  auto a = Store::open("file:" + dir.str(), 0, 2s);
  auto b = Store::open(dir.str(), 1, 2s);  // a second handle on the same directory
  a->set("k", bytes("v1"));
  a->prefixed("world")->set("k", bytes("v2"));
  EXPECT_EQ(text(b->get("k")), "v1");
  EXPECT_EQ(text(b->prefixed("world")->get("k")), "v2");
  b->prefixed("world")->prefixed("ep")->set("k", bytes("v3"));
  EXPECT_EQ(text(a->get("world/ep/k")), "v3") << "prefixes nest";
  EXPECT_NE(a->prefixed("world")->description().find("prefix world"), std::string::npos);
}

TEST(CommStore, WaitingForAMissingKeyTimesOutNamingIt) {
  TempDir dir;
  auto s = Store::open(dir.str(), 0, 1s);
  auto start = std::chrono::steady_clock::now();
  std::string e = error_of([&] { s->get("never"); });
  EXPECT_NE(e.find("never"), std::string::npos) << e;
  EXPECT_NE(e.find(dir.str()), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(CommStore, AnEarlierRunsKeysAreAnError) {
  TempDir dir;
  Store::open(dir.str(), 0, 1s)->set("joined/0", bytes("1"));
  std::string e = error_of([&] { Store::open(dir.str(), 0, 1s)->set("joined/0", bytes("1")); });
  EXPECT_NE(e.find("key 'joined/0' is already set"), std::string::npos) << e;
  EXPECT_NE(e.find("fresh directory"), std::string::npos) << e;
}

TEST(CommStore, BadSpecsAreNamed) {
  EXPECT_NE(error_of([] { Store::open("bogus://x", 0, 1s); }).find("store 'bogus://x': unknown kind"),
            std::string::npos);
  EXPECT_NE(error_of([] { Store::open("tcp://localhost", 0, 1s); }).find("expected HOST:PORT"), std::string::npos);
  EXPECT_NE(error_of([] { Store::open("tcp://localhost:99999", 0, 1s); }).find("port '99999'"), std::string::npos);
}

TEST(CommStore, MemoryStoreIsSharedByItsHolders) {
  auto s = Store::open("memory", 0, 1s);
  std::thread t([&] { s->prefixed("p")->set("x", bytes("42")); });
  EXPECT_EQ(text(s->get("p/x")), "42");
  t.join();
}

TEST(CommTcpStore, ServerAndClientsExchangeKeys) {
  TcpStore server("127.0.0.1", 0, /*serve=*/true, 5s);
  ASSERT_GT(server.port(), 0);
  std::thread client([&] {
    TcpStore c("127.0.0.1", server.port(), false, 5s);
    c.set("from-client", bytes(std::string(100000, 'x')));
    EXPECT_EQ(text(c.get("from-server")), "hello");
  });
  server.set("from-server", bytes("hello"));
  EXPECT_EQ(server.get("from-client").size(), 100000u);
  client.join();
  std::string e = error_of([&] { server.set("from-server", bytes("again")); });
  EXPECT_NE(e.find("already set"), std::string::npos) << e;
}

TEST(CommTcpStore, MissingKeyAndMissingServerTimeOut) {
  TcpStore server("127.0.0.1", 0, true, 1s);
  auto start = std::chrono::steady_clock::now();
  EXPECT_NE(error_of([&] { server.get("nobody"); }).find("key 'nobody' not set within 1 s"), std::string::npos);
  int port = free_tcp_port();  // nobody listens there
  std::string e = error_of([&] { TcpStore c("127.0.0.1", port, false, 500ms); });
  EXPECT_NE(e.find("cannot connect"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 6s);
}

// The whole path for jobs without a shared directory: tcp:// store, Gloo rendezvous.
TEST(CommTcpStore, GlooCommunicatorsRendezvousThroughIt) {
  const int P = 3;
  const std::string spec = "tcp://127.0.0.1:" + std::to_string(free_tcp_port());
  std::vector<std::string> errors(P);
  std::vector<double> sums(P);
  std::latch done(P);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto store = Store::open(spec, r, 10s);
        auto comm = GlooCommunicator::connect(store, r, P, testing::test_options());
        Tensor t = Tensor::from_vector<double>({1.0 + r}, {1});
        comm->all_reduce(t);
        sums[r] = t.item();
        done.arrive_and_wait();  // rank 0's server outlives every client's use of it
      } catch (const std::exception& e) {
        errors[r] = e.what();
        done.count_down();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], 6.0) << "rank " << r;
  }
}

}  // namespace
}  // namespace moetrain
