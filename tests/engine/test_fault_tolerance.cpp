// Live fault tolerance, in pieces: the quorum rules (quorum.h) with a clock the test moves,
// the lighthouse server and its clients over real gRPC (lighthouse.h), and the
// ReplicaBridge's bounded wait on a dead peer. Whole runs of replica groups that fail and
// heal are in tests/chaos/test_chaos_replicas.cpp.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "comm/gloo_communicator.h"
#include "comm/launcher.h"
#include "comm/store.h"
#include "comm/tcp_store.h"
#include "engine/ft/lighthouse.h"
#include "engine/ft/quorum.h"
#include "engine/parallel/replica_bridge.h"

namespace moetrain {
namespace {

using namespace std::chrono_literals;
using Clock = QuorumState::Clock;

QuorumMember member(const std::string& id, int64_t step, uint64_t incarnation = 1) { return {id, incarnation, step, 2}; }

std::vector<std::string> ids(const Quorum& q) {
  std::vector<std::string> out;
  for (const auto& m : q.members) out.push_back(m.replica_id);
  return out;
}

TEST(QuorumRules, WaitsForMinReplicas) {
  QuorumState s({.min_replicas = 2, .join_timeout = 100ms, .heartbeat_timeout = 1000ms});
  const auto t = Clock::now();
  s.request(member("a", 0), t);
  std::string why;
  EXPECT_FALSE(s.try_form(t + 500ms, &why));
  EXPECT_NE(why.find("min_replicas 2"), std::string::npos) << why;
  s.request(member("b", 0), t + 500ms);
  const auto q = s.try_form(t + 500ms);
  ASSERT_TRUE(q);
  EXPECT_EQ(ids(*q), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(q->id, 1);
  EXPECT_FALSE(s.asking("a"));  // answered: a new round begins
}

TEST(QuorumRules, NeverFormsWithoutAMajorityOfTheAliveGroups) {
  QuorumState s({.min_replicas = 1, .join_timeout = 100ms, .heartbeat_timeout = 10s});
  const auto t = Clock::now();
  for (const char* id : {"a", "b", "c", "d"}) s.heartbeat(id, t);
  s.request(member("a", 3), t);
  s.request(member("b", 3), t);
  std::string why;
  EXPECT_FALSE(s.try_form(t + 5s, &why));  // 2 of 4 alive: the other half might be training
  EXPECT_NE(why.find("not a majority"), std::string::npos) << why;
  s.request(member("c", 3), t + 5s);
  EXPECT_TRUE(s.try_form(t + 5s + 100ms));  // 3 of 4, after the join timeout
}

TEST(QuorumRules, JoinTimeoutFastPathAndDeadGroups) {
  QuorumState s({.min_replicas = 1, .join_timeout = 100ms, .heartbeat_timeout = 1000ms});
  auto t = Clock::now();
  for (const char* id : {"a", "b", "c"}) s.request(member(id, 0), t);
  EXPECT_FALSE(s.try_form(t));  // a lighthouse's first quorum waits for groups it has not heard of yet
  ASSERT_TRUE(s.try_form(t + 100ms));
  t += 100ms;
  // The fast path: every member of the last quorum asks again, a newcomer that only
  // heartbeats does not hold it up.
  t += 10ms;
  s.heartbeat("d", t);
  for (const char* id : {"a", "b", "c"}) s.request(member(id, 1), t);
  auto q = s.try_form(t);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->id, 1);  // same groups, same incarnations: the same quorum (and communicator)
  EXPECT_EQ(q->max_step, 1);
  // d has gone silent past the heartbeat timeout; c stops asking but still heartbeats (it
  // failed a moment ago): a and b, 2 of the 3 alive, wait out the join timeout.
  t += 2s;
  s.heartbeat("c", t);
  s.request(member("a", 2), t);
  s.request(member("b", 2), t);
  EXPECT_EQ(s.alive(t), 3);
  EXPECT_FALSE(s.try_form(t + 99ms));
  q = s.try_form(t + 100ms);
  ASSERT_TRUE(q);
  EXPECT_EQ(ids(*q), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(q->id, 2);
  // Once c too is silent past the heartbeat timeout, a and b are every alive group: no wait.
  t += 2s;
  s.request(member("a", 3), t);
  s.request(member("b", 3), t);
  EXPECT_EQ(s.alive(t), 2);
  EXPECT_TRUE(s.try_form(t));
}

// A group left out of a quorum asks again at once, while the members are still training the
// step: the join timeout runs from the members' first request, so the next quorum waits for
// the last member and takes all three (timed from the left-out group's request, a join
// timeout shorter than a step left one group out of every quorum: seen under ASAN in the
// chaos test of a group joining mid-run). With every member silent, the round's first
// request starts it.
TEST(QuorumRules, AGroupLeftOutDoesNotStartTheJoinTimeout) {
  QuorumState s({.min_replicas = 1, .join_timeout = 500ms, .heartbeat_timeout = 10s});
  auto t = Clock::now();
  s.heartbeat("c", t);
  s.request(member("a", 0), t);
  s.request(member("b", 0), t);
  ASSERT_TRUE(s.try_form(t + 500ms));  // the first quorum: a and b (c only heartbeats)
  t += 500ms;
  s.request(member("c", 0), t);        // c, left out, asks at once
  t += 2s;                             // a and b train a step longer than the join timeout
  s.request(member("a", 1), t);
  EXPECT_FALSE(s.try_form(t + 100ms)) << "a alone of the members: b is still on its step";
  s.request(member("b", 1), t + 400ms);
  const auto q = s.try_form(t + 400ms);
  ASSERT_TRUE(q);
  EXPECT_EQ(ids(*q), (std::vector<std::string>{"a", "b", "c"}));
  // Every member silent past the heartbeat timeout: the round's first request starts the
  // clock (c and d ask, e only heartbeats).
  QuorumState gone({.min_replicas = 1, .join_timeout = 500ms, .heartbeat_timeout = 1s});
  t = Clock::now();
  gone.request(member("a", 0), t);
  gone.request(member("b", 0), t);
  ASSERT_TRUE(gone.try_form(t + 500ms));
  t += 5s;
  gone.heartbeat("e", t);
  gone.request(member("c", 0), t);
  gone.request(member("d", 0), t + 100ms);
  EXPECT_FALSE(gone.try_form(t + 400ms));
  const auto q2 = gone.try_form(t + 500ms);
  ASSERT_TRUE(q2);
  EXPECT_EQ(ids(*q2), (std::vector<std::string>{"c", "d"}));
}

TEST(QuorumRules, AfterALighthouseRestartThePlannedGroupsSetTheMajority) {
  // A restarted lighthouse has heard only from group a: a alone is every alive group, but not
  // more than half of the 3 the run plans, so it must not train apart from b and c.
  QuorumState s({.min_replicas = 1, .join_timeout = 100ms, .heartbeat_timeout = 5s});
  const auto t = Clock::now();
  s.request(member("a", 7), t, /*planned_groups=*/3);
  std::string why;
  EXPECT_FALSE(s.try_form(t + 1s, &why));
  EXPECT_NE(why.find("1 asking of 1 alive and 3 planned: not a majority"), std::string::npos) << why;
  s.request(member("b", 7), t + 1s, 3);
  EXPECT_TRUE(s.try_form(t + 1s + 100ms));  // 2 of 3 planned
}

TEST(QuorumRules, ANewIncarnationIsANewQuorum) {
  QuorumState s({.min_replicas = 1, .join_timeout = 0ms, .heartbeat_timeout = 1000ms});
  const auto t = Clock::now();
  s.request(member("a", 0, 7), t);
  s.request(member("b", 0, 9), t);
  EXPECT_EQ(s.try_form(t)->id, 1);
  s.request(member("a", 1, 7), t);
  s.request(member("b", 1, 10), t);  // b restarted, or its communicator broke
  EXPECT_EQ(s.try_form(t)->id, 2);
}

TEST(QuorumRules, GroupsBehindRecoverFromUpToDatePeersRoundRobin) {
  QuorumState s({.min_replicas = 1, .join_timeout = 0ms, .heartbeat_timeout = 1000ms});
  const auto t = Clock::now();
  s.request(member("g0", 5), t);
  s.request(member("g1", 0), t);
  s.request(member("g2", 5), t);
  s.request(member("g3", 3), t);
  s.request(member("g4", 0), t);
  const auto q = s.try_form(t);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->max_step, 5);
  EXPECT_EQ(q->recover_from, (std::vector<int>{-1, 0, -1, 2, 0}));
  EXPECT_EQ(q->recover_to(0), (std::vector<int>{1, 4}));
  EXPECT_EQ(q->recover_to(2), (std::vector<int>{3}));
  EXPECT_TRUE(q->recover_to(1).empty());
}

// ---------------------------------------------------------------------------------------
// The lighthouse over gRPC

LighthouseOptions local_lighthouse(int port = 0) {
  LighthouseOptions o;
  o.bind = "127.0.0.1";
  o.port = port;
  o.rules = {.min_replicas = 1, .join_timeout = 100ms, .heartbeat_timeout = 5s};
  return o;
}

// Once every client's heartbeat has reached the lighthouse (before that, a group asking
// alone makes a quorum of one with min_replicas 1: the others are not known to be alive).
void until_heard() { std::this_thread::sleep_for(250ms); }

// Each client asks from its own thread (a quorum call waits for the others).
std::vector<QuorumAnswer> ask_all(std::vector<std::unique_ptr<LighthouseClient>>& clients, int64_t step,
                                  std::chrono::milliseconds timeout = 5s) {
  std::vector<QuorumAnswer> out(clients.size());
  std::vector<std::string> errors(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      try {
        out[i] = clients[i]->quorum(1, step, 2, timeout);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < errors.size(); ++i) EXPECT_EQ(errors[i], "") << "client " << i;
  return out;
}

TEST(Lighthouse, GroupsGetOneQuorumAndAFailedGroupCostsOnlyTheJoinTimeout) {
  LighthouseServer server(local_lighthouse());
  const std::string addr = "127.0.0.1:" + std::to_string(server.port());
  std::vector<std::unique_ptr<LighthouseClient>> clients;
  for (const char* id : {"0", "1", "2"}) clients.push_back(std::make_unique<LighthouseClient>(addr, id, 50ms));
  until_heard();
  std::vector<QuorumAnswer> a = ask_all(clients, 4);
  const std::string first_prefix = a[0].store_prefix;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].quorum.id, a[0].quorum.id);
    EXPECT_EQ(a[i].index, static_cast<int>(i));
    EXPECT_EQ(a[i].quorum.members.size(), 3u);
    EXPECT_EQ(a[i].store, "tcp://127.0.0.1:" + std::to_string(server.store_port()));
    EXPECT_EQ(a[i].store_prefix, a[0].store_prefix);
  }
  // Group 2 dies; its heartbeats stay fresh for 5 s, yet the other two train on after the
  // 100 ms join timeout (the bound: under 0.5 s).
  clients.pop_back();
  const auto t0 = std::chrono::steady_clock::now();
  a = ask_all(clients, 5);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 0.5);
  EXPECT_GE(s, 0.09);
  EXPECT_EQ(a[0].quorum.members.size(), 2u);
  EXPECT_GT(a[0].quorum.id, 1);
  EXPECT_EQ(a[1].store_prefix, a[0].store_prefix);
  EXPECT_NE(a[0].store_prefix, first_prefix);  // new members: a new communicator
}

TEST(Lighthouse, AGroupJoiningMidRunIsToldToRecoverFromAnUpToDatePeer) {
  LighthouseServer server(local_lighthouse());
  const std::string addr = "127.0.0.1:" + std::to_string(server.port());
  std::vector<std::unique_ptr<LighthouseClient>> clients;
  clients.push_back(std::make_unique<LighthouseClient>(addr, "a", 50ms));
  clients.push_back(std::make_unique<LighthouseClient>(addr, "b", 50ms));
  until_heard();
  std::vector<QuorumAnswer> out(2);
  std::string errors;
  auto ask = [&](int i, int64_t step) {
    try {
      out[i] = clients[i]->quorum(1, step, 2, 5s);
    } catch (const std::exception& e) {
      errors += e.what();
    }
  };
  std::thread ta(ask, 0, 12);
  std::thread tb(ask, 1, 0);  // new: no state yet
  ta.join();
  tb.join();
  ASSERT_EQ(errors, "");
  EXPECT_EQ(out[0].quorum.max_step, 12);
  EXPECT_EQ(out[0].recover_from, -1);
  EXPECT_EQ(out[0].recover_to, (std::vector<int>{1}));
  EXPECT_EQ(out[1].recover_from, 0);
  EXPECT_TRUE(out[1].recover_to.empty());
}

TEST(Lighthouse, ARestartedLighthouseLosesNoGroupAndResumesAtTheirStep) {
  int port = 0;
  std::string first_prefix;
  {
    LighthouseServer server(local_lighthouse());
    port = server.port();
    LighthouseClient c("127.0.0.1:" + std::to_string(port), "a", 50ms);
    first_prefix = c.quorum(1, 7, 2, 5s).store_prefix;
  }
  // The lighthouse is down; the group asks anyway, and gets its answer once it is back.
  LighthouseClient c("127.0.0.1:" + std::to_string(port), "a", 50ms);
  QuorumAnswer got;
  std::string error;
  std::thread asking([&] {
    try {
      got = c.quorum(1, 8, 2, 10s);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  LighthouseServer again(local_lighthouse(port));
  asking.join();
  ASSERT_EQ(error, "");
  EXPECT_EQ(got.quorum.max_step, 8);
  EXPECT_NE(got.store_prefix, first_prefix);  // a new lighthouse's quorums never meet the old one's keys
}

TEST(Lighthouse, ALighthouseThatStaysDownIsAnErrorNamingIt) {
  const int port = free_tcp_port();
  LighthouseClient c("127.0.0.1:" + std::to_string(port), "a", 50ms);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c.quorum(1, 0, 2, 400ms);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lighthouse at 127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
}

TEST(Lighthouse, GroupsOfDifferentSizesAreRefused) {
  LighthouseServer server(local_lighthouse());
  const std::string addr = "127.0.0.1:" + std::to_string(server.port());
  LighthouseClient a(addr, "a", 50ms);
  a.quorum(1, 0, 2, 5s);
  LighthouseClient b(addr, "b", 50ms);
  try {
    b.quorum(1, 0, 4, 2s);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("replica group b has 4 ranks but group a of the last quorum has 2"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// The bridge's bounded wait

TEST(ReplicaBridge, ADeadPeerFailsTheCollectiveWithinTheTimeoutAndTheBridgeGoesQuiet) {
  TcpStoreServer store_server(0);
  const std::string spec = "tcp://127.0.0.1:" + std::to_string(store_server.port());
  CommOptions opt;
  opt.timeout = 1s;
  opt.gloo_host = "127.0.0.1";
  std::atomic<bool> connected{false};
  std::unique_ptr<Communicator> peer;
  std::thread other([&] {
    peer = GlooCommunicator::connect(Store::open(spec, 1, 5s)->prefixed("b"), 1, 2, opt, "replicas");
    connected = true;
  });
  ReplicaBridge bridge(GlooCommunicator::connect(Store::open(spec, 1, 5s)->prefixed("b"), 0, 2, opt, "replicas"));
  other.join();
  ASSERT_TRUE(connected);
  bridge.set_tolerant(true);
  Tensor t = Tensor::full({1000}, 1.0, DType::F32);
  const auto t0 = std::chrono::steady_clock::now();
  bridge.all_reduce(t);  // the peer never takes part: it hung
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(bridge.failed());
  EXPECT_LT(s, 2.5);
  EXPECT_EQ(bridge.comm(), nullptr);
  std::vector<double> v{1.0};
  bridge.all_reduce_doubles(v, Device::cpu());  // quiet until rebuilt
  EXPECT_EQ(v[0], 1.0);
  // Without tolerance (HSDP inside one job), a failed collective is an error, as before.
  ReplicaBridge strict(std::move(peer));
  try {
    strict.all_reduce(t);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("replicas"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moetrain
