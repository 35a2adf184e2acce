// launch_workers: the environment workers see, their output, and fail-fast: one worker
// dying brings the others down within seconds and the result names it.
#include <gtest/gtest.h>

#include <memory>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "comm/launch_env.h"
#include "comm/launcher.h"
#include "test_util.h"
#include "comm_test_util.h"

namespace moetrain {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Collects every worker's lines.
struct Output {
  std::mutex mu;
  std::map<int, std::vector<std::string>> lines[3];
  std::string all() {
    std::lock_guard<std::mutex> lock(mu);
    std::string s;
    for (int stream : {1, 2}) {
      for (auto& [rank, ls] : lines[stream]) {
        for (auto& l : ls) s += fmt::format("[{}] {}\n", rank, l);
      }
    }
    return s;
  }
};

LaunchSpec shell_workers(int n, const std::string& script, Output& out) {
  LaunchSpec spec;
  spec.nproc = n;
  spec.argv = {"/bin/sh", "-c", script};
  spec.on_line = [&out](int rank, int stream, const std::string& line) {
    std::lock_guard<std::mutex> lock(out.mu);
    out.lines[stream][rank].push_back(line);
  };
  return spec;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

// SIGTERM to this process (the launcher: its own handler catches it) once every worker of
// `spec` has printed "ready".
void term_launcher_when_ready(LaunchSpec& spec) {
  auto ready = std::make_shared<int>(0);
  spec.on_line = [collect = spec.on_line, ready, n = spec.nproc](int rank, int stream, const std::string& line) {
    collect(rank, stream, line);
    if (line == "ready" && ++*ready == n) ::kill(::getpid(), SIGTERM);
  };
}

TEST(CommLauncher, WorkersSeeTheirRankStoreAndPort) {
  Output out;
  LaunchSpec spec = shell_workers(
      3,
      "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $EXTRA\"; "
      "test -d \"$MOETRAIN_STORE\" && echo \"store $MOETRAIN_STORE\"; printf 'no newline' >&2",
      out);
  spec.env = {{"EXTRA", "x"}, {"RANK", "overridden"}};
  LaunchResult r = launch_workers(spec);
  EXPECT_EQ(r.exit_code, 0) << r.message << "\n" << out.all();
  EXPECT_EQ(r.failed_rank, -1);
  std::string store;
  for (int rank = 0; rank < 3; ++rank) {
    const auto& ls = out.lines[1][rank];
    ASSERT_EQ(ls.size(), 2u) << out.all();
    std::string prefix = std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 127.0.0.1 ";
    EXPECT_EQ(ls[0].rfind(prefix, 0), 0u) << ls[0];
    EXPECT_EQ(ls[0].substr(ls[0].size() - 2), " x") << ls[0];
    ASSERT_EQ(ls[1].rfind("store ", 0), 0u) << ls[1];
    if (rank == 0) store = ls[1].substr(6);
    EXPECT_EQ(ls[1].substr(6), store) << "every worker shares one store";
    EXPECT_EQ(out.lines[2][rank], std::vector<std::string>{"no newline"});
  }
  EXPECT_FALSE(std::filesystem::exists(store)) << "the store directory outlived the launch";
}

// The brief's case: one worker is SIGKILLed; the others (sleeping for a minute) are
// stopped within seconds and the result names the rank and the signal.
TEST(CommLauncher, OneKilledWorkerStopsTheOthersQuickly) {
  Output out;
  LaunchSpec spec = shell_workers(
      4, "echo pid $$; if [ \"$RANK\" = 1 ]; then sleep 0.3; kill -KILL $$; fi; exec sleep 60", out);
  auto start = Clock::now();
  LaunchResult r = launch_workers(spec);
  auto took = Clock::now() - start;
  EXPECT_LT(took, 10s);
  EXPECT_EQ(r.failed_rank, 1) << out.all();
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
  EXPECT_NE(r.message.find("rank 1 (pid"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("killed by signal 9 (SIGKILL)"), std::string::npos) << r.message;
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_EQ(out.lines[1][rank].size(), 1u) << out.all();
    pid_t pid = std::atoi(out.lines[1][rank][0].c_str() + 4);
    EXPECT_FALSE(alive(pid)) << "rank " << rank << " (pid " << pid << ") still runs";
  }
}

// An elastic agent's node: its workers are ranks 4 and 5 of 8, on the store it names; its
// monitor (another node's failure, say) stops them as a failure would.
TEST(CommLauncher, AMonitorStopsTheWorkersAndANodesRanksStartAtItsOffset) {
  Output out;
  LaunchSpec spec = shell_workers(
      2, "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $MOETRAIN_STORE\"; exec sleep 60", out);
  spec.rank_offset = 4;
  spec.world_size = 8;
  spec.node_rank = 2;
  spec.worker_store = "tcp://node2:4242";
  spec.monitor_interval = 50ms;
  int calls = 0;
  const auto start = Clock::now();
  spec.monitor = [&]() -> std::optional<std::string> {
    ++calls;
    if (Clock::now() - start < 500ms) return std::nullopt;
    return std::string("round 3 ended elsewhere");
  };
  LaunchResult r = launch_workers(spec);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_TRUE(r.stopped_by_monitor);
  EXPECT_EQ(r.message, "round 3 ended elsewhere");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_GT(r.failed_at, 1e9) << "seconds since the epoch";
  EXPECT_GE(calls, 5) << "polled about every 50 ms";
  ASSERT_EQ(out.lines[1][4].size(), 1u) << out.all();
  EXPECT_EQ(out.lines[1][4][0], "4 8 0 2 tcp://node2:4242");
  ASSERT_EQ(out.lines[1][5].size(), 1u) << out.all();
  EXPECT_EQ(out.lines[1][5][0], "5 8 1 2 tcp://node2:4242");
  // Ranks that do not fit the world are refused.
  spec.rank_offset = 7;
  EXPECT_NE(testing::error_of([&] { launch_workers(spec); }).find("do not fit a world of 8"), std::string::npos);
}

// After a failure the others get SIGINT (SIGTERM is a training worker's preemption notice);
// one that ignores it gets SIGKILL after the grace period.
TEST(CommLauncher, WorkersIgnoringTheStopSignalAreKilledAfterTheGrace) {
  Output out;
  LaunchSpec spec = shell_workers(
      2, "if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 3; fi; trap '' INT; while true; do sleep 0.1; done", out);
  spec.grace = 1s;
  auto start = Clock::now();
  LaunchResult r = launch_workers(spec);
  EXPECT_LT(Clock::now() - start, 8s);
  EXPECT_EQ(r.failed_rank, 1);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.message.find("rank 1 (pid"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("exited with status 3"), std::string::npos) << r.message;
}

TEST(CommLauncher, SigtermToTheLauncherReachesTheWorkers) {
  Output out;
  LaunchSpec spec = shell_workers(2, "echo ready; exec sleep 60", out);
  term_launcher_when_ready(spec);
  auto start = Clock::now();
  LaunchResult r = launch_workers(spec);
  EXPECT_LT(Clock::now() - start, 8s);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
  EXPECT_EQ(r.failed_rank, -1);
  EXPECT_NE(r.message.find("launch got SIGTERM"), std::string::npos) << r.message;
}

// A preempted job: SIGTERM to the launcher, every worker saves and exits 0: a clean end.
TEST(CommLauncher, SigtermThatEveryWorkerAnswersWithExit0EndsCleanly) {
  Output out;
  LaunchSpec spec = shell_workers(2, "trap 'exit 0' TERM; echo ready; while true; do sleep 0.1; done", out);
  term_launcher_when_ready(spec);
  LaunchResult r = launch_workers(spec);
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.exit_code, 0) << r.message;
  EXPECT_EQ(r.failed_rank, -1);
}

TEST(CommLauncher, AMissingCommandFailsWithStatus127) {
  Output out;
  LaunchSpec spec = shell_workers(2, "", out);
  spec.argv = {"/nonexistent/moetrain-worker"};
  LaunchResult r = launch_workers(spec);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_GE(r.failed_rank, 0);
  EXPECT_NE(out.all().find("cannot execute"), std::string::npos) << out.all();
}

// The whole path in separate processes: this test binary launches 3 copies of itself;
// each reads its rank from the environment, opens the store launch made, connects Gloo
// and all-reduces. A worker's failed expectation fails its exit status, hence the launch.
TEST(CommLauncher, WorkersRendezvousThroughTheEnvironment) {
  if (std::getenv("MOETRAIN_TEST_WORKER")) {
    LaunchEnv env = LaunchEnv::from_environment();
    ASSERT_EQ(env.world_size, 3);
    auto store = Store::open(default_store_spec(env), env.rank, 20s);
    auto comm = GlooCommunicator::connect(store, env.rank, env.world_size, default_comm_options(env));
    Tensor t = Tensor::from_vector<int64_t>({env.rank, 1}, {2});
    comm->all_reduce(t);
    EXPECT_EQ(t.to_vector<int64_t>(), (std::vector<int64_t>{3, 3}));
    comm->barrier();
    return;
  }
  Output out;
  LaunchSpec spec = shell_workers(3, "", out);
  spec.argv = {std::filesystem::read_symlink("/proc/self/exe").string(),
               "--gtest_filter=CommLauncher.WorkersRendezvousThroughTheEnvironment"};
  spec.env = {{"MOETRAIN_TEST_WORKER", "1"}};
  LaunchResult r = launch_workers(spec);
  EXPECT_EQ(r.exit_code, 0) << r.message << "\n" << out.all();
  for (int rank = 0; rank < 3; ++rank) {
    bool passed = false;
    for (const auto& l : out.lines[1][rank]) passed = passed || l.find("[  PASSED  ] 1 test") != std::string::npos;
    EXPECT_TRUE(passed) << "rank " << rank << ":\n" << out.all();
  }
}

}  // namespace
}  // namespace moetrain
