// Chaos scenarios (ctest -L chaos): whole training runs of 4 workers (`moetrain launch`,
// Gloo on the CPU, ep2 x dp2, a checkpoint every step) with faults injected through
// MOETRAIN_FAULT (engine/ft/fault.h), each against the same run without faults:
//   - workers killed (SIGKILL) at the start of a step, in the middle of a save and in rank
//     0's commit, in three successive restart generations: `launch --max-restarts` brings
//     the job back each time from the newest committed step, the run finishes by itself, its
//     final weights and optimizer state are bitwise those of the fault-free run, and every
//     step from 1 to the end is committed once;
//   - a preemption notice (SIGTERM) reaching one worker: every worker stops after the same
//     step with it committed and exits 0; the run started again finishes bitwise as the
//     fault-free one;
//   - without --max-restarts a killed worker still brings the job down, naming it;
//   - a damaged newest checkpoint (a flipped byte in one rank's file) is reported by name,
//     moved aside, and the run resumes from the step before it, ending bitwise as without;
//   - a worker that hangs (sleeps 60 s as a step begins): `--heartbeat-timeout` finds it by
//     its stale heartbeat, names it, stops every worker and restarts; the run ends bitwise;
//   - storage that stalls (one rank's writer held 4 s, background saves): no step waits for
//     it (the saves due meanwhile are skipped, all ranks alike), the saves resume after it,
//     and the last one commits.
// The faults are fixed, not drawn, so every run of these tests is the same run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "chaos_run.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using namespace moetrain::testing;

class Chaos : public ::testing::Test {
 protected:
  void SetUp() override { corpus_ = write_chaos_corpus(dir_); }

  static constexpr int kSteps = 7;

  // `moetrain launch -n 4 ...` (ep2 x dp2) with MOETRAIN_FAULT set to `fault` (none when empty).
  CliResult launch(const std::string& name, const std::string& fault, int max_restarts, const std::string& extra = "",
                   const std::string& launch_extra = "") {
    const std::string env = fault.empty() ? "" : "MOETRAIN_FAULT='" + fault + "' ";
    return run_shell(env + moetrain_binary() + " launch -n 4 --grace 5 --max-restarts " + std::to_string(max_restarts) +
                     " " + launch_extra + " -- " + chaos_train_args(corpus_, dir_ / name, kSteps) + " " + extra);
  }

  std::string ckpt(const std::string& name) const { return checkpoints_of(dir_ / name); }
  void expect_bitwise_same_step(const std::string& a, const std::string& b, int64_t step) {
    moetrain::testing::expect_bitwise_same_step(dir_ / a, dir_ / b, step);
  }
  void expect_every_step_committed_once(const std::string& name) {
    moetrain::testing::expect_every_step_committed_once(dir_ / name, kSteps);
  }

  ScratchDir dir_;
  std::string corpus_;
};

TEST_F(Chaos, KilledWorkersAreRestartedAndTheRunEndsBitwiseAsWithoutFaults) {
  const auto clean = launch("clean", "", 0);
  ASSERT_EQ(clean.status, 0) << clean.output;
  // Generation 0: rank 2 dies as step 3 begins. Generation 1: rank 1 dies in the save of
  // step 4 (before its snapshot). Generation 2: rank 0 dies in the commit of step 6, its
  // files written, the index not yet. Generation 3 finishes.
  const std::string faults =
      "kill@step_begin:rank=2:step=3:generation=0;kill@save:rank=1:step=4:generation=1;"
      "kill@files:rank=0:step=6:generation=2";
  const auto r = launch("faulty", faults, 3);
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* want : {"fault injected: kill at step_begin (rank 2, step 3, generation 0",
                           "fault injected: kill at save (rank 1, step 4, generation 1",
                           "fault injected: kill at files (rank 0, step 6, generation 2",
                           "restart 3 of at most 3, generation 3"}) {
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
  }
  expect_every_step_committed_once("faulty");
  expect_bitwise_same_step("clean", "faulty", kSteps);
  // The restarts' timings, for scripts/chaos-repeat: the launcher's stop, the loads.
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("every worker stopped") != std::string::npos ||
        (line.find("[rank 0]") != std::string::npos && line.find("resumed from") != std::string::npos)) {
      std::printf("%s\n", line.c_str());
    }
  }
  // The metrics say which generation made each step, and the world size.
  const auto m = read_metrics(dir_ / "faulty");
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(m.back()["restart_generation"], 3);
  EXPECT_EQ(m.back()["world_size"], 4);
}

TEST_F(Chaos, PreemptionSavesStopsCleanlyAndResumesBitwise) {
  const auto clean = launch("clean", "", 0);
  ASSERT_EQ(clean.status, 0) << clean.output;
  // One worker gets SIGTERM as step 3 begins: all four finish step 3, save it, exit 0.
  const auto first = launch("preempted", "term@step_begin:rank=3:step=3", 0);
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_NE(first.output.find("preempted (a rank got"), std::string::npos) << first.output;
  const auto committed = Checkpointer::committed(ckpt("preempted"));
  ASSERT_FALSE(committed.empty());
  EXPECT_EQ(committed.back().first, 3);
  const auto again = launch("preempted", "", 0);
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("resumed from"), std::string::npos) << again.output;
  expect_every_step_committed_once("preempted");
  expect_bitwise_same_step("clean", "preempted", kSteps);
}

TEST_F(Chaos, WithoutRestartsAKilledWorkerStopsTheJobNamingIt) {
  const auto r = launch("once", "kill@step_begin:rank=1:step=2", 0);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SIGKILL"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
}

TEST_F(Chaos, ADamagedNewestCheckpointIsMovedAsideAndTheStepBeforeResumes) {
  const auto clean = launch("clean", "", 0);
  ASSERT_EQ(clean.status, 0) << clean.output;
  const auto first = launch("damaged", "", 0, "--training.stop_after_steps=5");
  ASSERT_EQ(first.status, 0) << first.output;
  // One byte of rank 1's optimizer file of step 5 flipped, in the middle (its tensor data).
  const std::string step5 = ckpt("damaged") + "/" + Checkpointer::step_dir_name(5);
  const std::string file = step5 + "/optimizer-r00001.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << file;
    f.seekg(0, std::ios::end);
    const std::streamoff mid = f.tellg() / 2;
    f.seekg(mid);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(mid);
    f.write(&c, 1);
  }
  const auto again = launch("damaged", "", 0);
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("optimizer-r00001.safetensors"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("is damaged; moved to"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("step 4;"), std::string::npos) << again.output;  // resumed from step 4
  EXPECT_TRUE(fs::exists(ckpt("damaged") + "/damaged-" + Checkpointer::step_dir_name(5)));
  expect_every_step_committed_once("damaged");
  expect_bitwise_same_step("clean", "damaged", kSteps);
}

TEST_F(Chaos, AHungWorkerIsFoundByItsHeartbeatAndTheJobRestarts) {
  const auto clean = launch("clean", "", 0);
  ASSERT_EQ(clean.status, 0) << clean.output;
  const auto start = std::chrono::steady_clock::now();
  // Two restarts allowed: a loaded machine that made some phase look hung would restart once
  // more and still end bitwise; the hang itself is one.
  const auto r = launch("hung", "stall=60@step_begin:rank=1:step=4:generation=0", 2, "", "--heartbeat-timeout 4");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sent no heartbeat for"), std::string::npos) << r.output;
  EXPECT_LT(took, 40.0) << "the hung worker's 60 s were waited out";
  expect_every_step_committed_once("hung");
  expect_bitwise_same_step("clean", "hung", kSteps);
}

TEST_F(Chaos, StalledStorageHoldsNoStepUpAndTheLastSaveCommits) {
  const std::string async = "--checkpoint.async=true";
  const auto clean = launch("clean", "", 0, async);
  ASSERT_EQ(clean.status, 0) << clean.output;
  // The stall hits the first save: a later one may itself be skipped when a slow machine (ASAN)
  // is still writing the save before it, and then the fault never fires.
  const auto r = launch("stalled", "stall=4@files:rank=1:step=1", 0, async);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("fault injected: stall at files (rank 1, step 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not saved: the previous save is still being written"), std::string::npos) << r.output;
  // No step waited for the 4 s stall (a step here takes well under a second).
  const auto m = read_metrics(dir_ / "stalled");
  ASSERT_EQ(m.size(), static_cast<size_t>(kSteps));
  for (const auto& row : m) {
    EXPECT_LT(row["step_time_s"].get<double>() + row.value("checkpoint_stall_s", 0.0), 2.0) << row.dump();
  }
  // Step 1 committed once the storage came back, some later ones were skipped, the last is there.
  const auto committed = Checkpointer::committed(ckpt("stalled"));
  ASSERT_FALSE(committed.empty());
  EXPECT_EQ(committed.back().first, kSteps);
  EXPECT_LT(committed.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(committed.front().first, 1);
  expect_bitwise_same_step("clean", "stalled", kSteps);
}

}  // namespace
}  // namespace moetrain
