// The elastic agents' rendezvous (comm/rendezvous.h) on its stores: the TCP store's add,
// set-once and journal (a restarted server keeps its keys), etcd's JSON gateway against a
// real etcd started here, and the protocol run by agents as threads: membership by join
// order, min/max nodes and the last call, spares and scale-up, failures counted, a silent
// member found by its beats, a finished job ending the spares.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "comm/etcd_store.h"
#include "comm/launcher.h"
#include "comm/rendezvous.h"
#include "comm/tcp_store.h"
#include "comm_test_util.h"
#include "etcd_server.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::TempDir;
using namespace std::chrono_literals;

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(CommTcpStore, AddIsAtomicOverClientsAndSetOnceKeepsTheFirstValue) {
  TcpStoreServer server(0);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      TcpStore c("127.0.0.1", server.port(), false, 5s);
      for (int i = 0; i < 50; ++i) c.add("count", 2);
    });
  }
  for (auto& t : ts) t.join();
  TcpStore c("127.0.0.1", server.port(), false, 5s);
  EXPECT_EQ(c.add("count", 0), 400);
  auto v = c.try_get("count");
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(std::string(v->begin(), v->end()), "400") << "a counter reads as its decimal text";
  EXPECT_FALSE(c.try_get("absent").has_value());
  EXPECT_TRUE(c.set_once("k", bytes("first")));
  EXPECT_FALSE(c.set_once("k", bytes("second")));
  EXPECT_EQ(c.get("k"), bytes("first"));
}

TEST(CommTcpStore, AServerRestartedOnItsJournalKeepsEveryKeyAndClientsReconnect) {
  TempDir dir;
  const std::string journal = dir.str() + "/journal";
  const int port = free_tcp_port();
  auto server = std::make_unique<TcpStoreServer>(port, journal);
  TcpStore c("127.0.0.1", port, false, 5s);
  c.set_reconnect(true);
  c.set("a", bytes("alpha"));
  c.add("n", 5);
  c.add("n", 2);
  server.reset();  // the server goes away
  std::thread back([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<TcpStoreServer>(port, journal);
  });
  EXPECT_EQ(c.add("n", 1), 8) << "the counter came back from the journal and the client reconnected";
  back.join();
  EXPECT_EQ(c.get("a"), bytes("alpha"));
  EXPECT_EQ(server->keys(), 2u);
  // Without reconnecting, a lost server is an error that says so.
  TcpStore plain("127.0.0.1", port, false, 1s);
  server.reset();
  const std::string e = testing::error_of([&] { plain.add("n", 1); });
  EXPECT_NE(e.find("lost the connection"), std::string::npos) << e;
}

TEST(CommEtcdStore, SetOnceAddAndGetThroughARealEtcdThatRestarts) {
  if (!testing::EtcdServer::available()) {
    GTEST_SKIP() << "SKIPPED LOUDLY: /usr/bin/etcd is missing (Debian's etcd-server; scripts/install-deps installs it)";
  }
  TempDir dir;
  testing::EtcdServer etcd(dir.str() + "/etcd");
  etcd.start();
  auto s = open_etcd_store(etcd.endpoint(), 20s);  // retries while etcd starts
  EXPECT_TRUE(s->set_once("moetrain/x", std::string("v\0w", 3)));
  EXPECT_FALSE(s->set_once("moetrain/x", "other"));
  EXPECT_EQ(s->get("moetrain/x"), std::string("v\0w", 3)) << "values are bytes";
  EXPECT_FALSE(s->get("moetrain/none").has_value());
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t) {
    ts.emplace_back([&] {
      auto c = open_etcd_store(etcd.endpoint(), 20s);
      for (int i = 0; i < 10; ++i) c->add("moetrain/n", 1);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(s->add("moetrain/n", 0), 30) << "compare-and-swap adds lose nothing";
  etcd.kill();
  std::thread back([&] {
    std::this_thread::sleep_for(500ms);
    etcd.start();
  });
  EXPECT_EQ(s->add("moetrain/n", 1), 31) << "etcd kept the key on disk; the client retried through the restart";
  back.join();
  EXPECT_EQ(base64_decode(base64_encode(std::string("\x00\xff\x10z", 4))), std::string("\x00\xff\x10z", 4));
  EXPECT_NE(testing::error_of([] { base64_decode("ab$c"); }).find("not in the alphabet"), std::string::npos);
}

// Agents as threads on one TCP store.
class RendezvousProtocol : public ::testing::Test {
 protected:
  RendezvousConfig config(int min_nodes, int max_nodes) {
    RendezvousConfig c;
    c.endpoint = "127.0.0.1:" + std::to_string(server_.port());
    c.run_id = "t";
    c.min_nodes = min_nodes;
    c.max_nodes = max_nodes;
    c.last_call = 300ms;
    c.join_timeout = 10s;
    c.keep_alive_timeout = 500ms;
    c.poll = 10ms;
    return c;
  }
  Rendezvous agent(const RendezvousConfig& c, const std::string& name, int nproc = 2) {
    NodeInfo n;
    n.host = name;
    n.addr = "127.0.0.1";
    n.nproc = nproc;
    n.store_port = 1000 + static_cast<int>(name.back());
    n.agent = name;
    return Rendezvous(c, open_rendezvous_store(c), n);
  }
  TcpStoreServer server_{0};
};

TEST_F(RendezvousProtocol, MaxNodesFormARoundAtOnceRankedByJoinOrder) {
  auto c = config(1, 3);
  std::vector<std::future<RoundAssignment>> fs;
  for (const char* name : {"a", "b", "c"}) {
    fs.push_back(std::async(std::launch::async, [this, c, name] { return agent(c, name).join(); }));
  }
  std::vector<RoundAssignment> as;
  for (auto& f : fs) as.push_back(f.get());
  std::vector<int> ranks;
  for (const auto& a : as) {
    EXPECT_EQ(a.round, 0);
    EXPECT_EQ(a.nnodes, 3);
    EXPECT_EQ(a.world_size(), 6);
    EXPECT_EQ(a.nodes[a.node_rank].agent, a.nodes[a.node_rank].host);
    EXPECT_EQ(a.rank_offset(), 2 * a.node_rank);
    ranks.push_back(a.node_rank);
    EXPECT_EQ(a.nodes, as[0].nodes) << "every agent sees the same members in the same order";
  }
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
}

TEST_F(RendezvousProtocol, MinNodesStartAfterTheLastCallAndALateNodeScalesUpTheNextRound) {
  auto c = config(2, 3);
  Rendezvous a = agent(c, "a"), b = agent(c, "b"), late = agent(c, "z");
  const auto t0 = std::chrono::steady_clock::now();
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  auto ra = b.join();
  auto rb = fa.get();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, c.last_call) << "two of at most three waited for the last call";
  EXPECT_EQ(ra.nnodes, 2);
  EXPECT_EQ(rb.nnodes, 2);
  // A third node arrives while round 0 runs: it ends the round to be taken in.
  auto fl = std::async(std::launch::async, [&] { return late.join(); });
  std::optional<RoundEnd> e;
  for (int i = 0; i < 500 && !(e = a.ended(0)); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->reason, "scale-up");
  EXPECT_NE(e->message.find("arrived after round 0 formed with 2 of at most 3"), std::string::npos) << e->message;
  auto fa1 = std::async(std::launch::async, [&] { return a.join(); });
  auto rb1 = b.join();
  auto rl = fl.get();
  auto ra1 = fa1.get();
  EXPECT_EQ(rl.round, 1);
  EXPECT_EQ(rl.nnodes, 3);
  EXPECT_EQ(ra1.nnodes, 3);
  EXPECT_EQ(rb1.failures, 0) << "a scale-up is not a failure";
}

TEST_F(RendezvousProtocol, FailuresAreCountedAndASpareLeavesWhenTheJobIsDone) {
  auto c = config(1, 1);
  Rendezvous a = agent(c, "a"), spare = agent(c, "s");
  auto r0 = a.join();
  ASSERT_EQ(r0.nnodes, 1);
  auto fs = std::async(std::launch::async, [&] { return spare.join(); });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(fs.wait_for(0ms), std::future_status::timeout) << "a full round keeps the spare waiting";
  RoundEnd e = a.end(0, "failure", "rank 1 died");
  EXPECT_EQ(e.reason, "failure");
  EXPECT_EQ(a.end(0, "scale-up", "later").message, "rank 1 died") << "the first to end a round says why";
  // Round 1: the spare and `a` race for the one place; the other waits.
  auto fa = std::async(std::launch::async, [&] { return a.join(); });
  for (int i = 0; i < 300 && fs.wait_for(0ms) != std::future_status::ready &&
                  fa.wait_for(0ms) != std::future_status::ready;
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  const bool spare_won = fs.wait_for(0ms) == std::future_status::ready;
  RoundAssignment r1 = spare_won ? fs.get() : fa.get();
  EXPECT_EQ(r1.round, 1);
  EXPECT_EQ(r1.failures, 1);
  (spare_won ? a : spare).end(1, "done", "finished");  // any agent may say so; here the waiting one's view
  RoundAssignment rest = spare_won ? fa.get() : fs.get();
  EXPECT_TRUE(rest.job_done) << "the job finished: the waiting agent has nothing to run";
}

TEST_F(RendezvousProtocol, AMemberThatStopsBeatingIsNamed) {
  auto c = config(2, 2);
  Rendezvous a = agent(c, "a"), b = agent(c, "b");
  auto fb = std::async(std::launch::async, [&] { return b.join(); });
  auto ra = a.join();
  auto rb = fb.get();
  std::optional<std::string> gone;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100 && !gone; ++i) {
    if (i < 20) {
      EXPECT_FALSE(b.beat(rb).has_value());  // b beats for a while, then falls silent
    }
    gone = a.beat(ra);
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(gone.has_value());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, c.keep_alive_timeout);
  EXPECT_NE(gone->find("node " + std::to_string(rb.node_rank) + " (b, agent b) has not beaten"), std::string::npos)
      << *gone;
}

TEST_F(RendezvousProtocol, TooFewNodesWithinTheJoinTimeoutIsAnErrorSayingWhatToCheck) {
  auto c = config(3, 3);
  c.join_timeout = 300ms;
  const std::string e = testing::error_of([&] { agent(c, "a").join(); });
  EXPECT_NE(e.find("only 1 of at least 3 nodes joined round 0"), std::string::npos) << e;
  EXPECT_NE(e.find("--rdzv-endpoint"), std::string::npos) << e;
  c.backend = "zookeeper";
  EXPECT_NE(testing::error_of([&] { open_rendezvous_store(c); }).find("--rdzv-backend 'zookeeper'"),
            std::string::npos);
}

}  // namespace
}  // namespace moetrain
