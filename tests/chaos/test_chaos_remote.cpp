// Chaos scenarios of the remote checkpoint tier (ctest -L chaos): the chaos run of
// chaos_run.h (4 workers, `moetrain launch`, Gloo on the CPU, ep2 x dp2, a checkpoint every
// step) whose rank 0 mirrors each committed step to a real S3-compatible server (s3rver on
// a free localhost port, tests/s3rver.h), with faults injected through MOETRAIN_FAULT
// (engine/ft/fault.h), each against one run without faults:
//   - the local disk lost: a run mirrors its steps, the next one is killed, the checkpoint
//     folder is deleted; the run started again (a fresh node) downloads the newest remote
//     step and ends bitwise as the fault-free run;
//   - rank 0 killed in the middle of an upload (its 13th S3 request) and the job started again:
//     no half-uploaded step counts as committed remotely, the run ends bitwise as the
//     fault-free one and its last step is mirrored;
//   - the S3 server down at the start and during the saves, back only once the last step's
//     upload has failed: training goes on at full speed, every step commits locally, the
//     uploader tries the last step again and it commits remotely before the run ends;
//   - S3 answering 503 (the client retries: the listing at start gets through) and the
//     first upload failing: the mirror goes on, the last step commits remotely;
//   - the uploader stalled 10 s in its first upload: no step waits for it, the steps committed meanwhile are
//     replaced by the newest, the last one commits remotely;
//   - a full disk (ENOSPC) in one rank's writer: the save of that step fails with a clear
//     line at once (rank 0 does not wait for the rank), training goes on, the next saves
//     commit, the steps before stay, and the run ends bitwise as the fault-free one.
// Skipped, saying so, where scripts/fetch-s3rver has not run.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "chaos_run.h"
#include "engine/checkpoint/remote_tier.h"
#include "s3rver.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using moetrain::testing::S3rver;

class ChaosRemote : public ::testing::Test {
 protected:
  static constexpr int kSteps = 7;

  void SetUp() override {
    corpus_ = moetrain::testing::write_chaos_corpus(dir_);
    s3_ = std::make_unique<S3rver>(dir_ / "s3");
    if (!s3_->ok()) GTEST_SKIP() << s3_->why();
  }

  std::string run_dir(const std::string& name) const { return dir_ / name; }
  std::string url(const std::string& name) const { return std::string("s3://") + S3rver::kBucket + "/" + name; }
  // The chaos run (chaos_run.h: 4 workers, ep2 x dp2, a synchronous checkpoint every step),
  // mirrored to s3://moetrain-test/<name> unless !remote.
  std::string command(const std::string& name, const std::string& fault, const std::string& extra, bool remote) {
    const std::string env = (fault.empty() ? "" : "MOETRAIN_FAULT='" + fault + "' ") + s3_->env();
    return env + moetrain::testing::moetrain_binary() + " launch -n 4 --grace 5 -- " +
           moetrain::testing::chaos_train_args(corpus_, run_dir(name), kSteps) + " --checkpoint.remote_wait_s=120" +
           (remote ? " --checkpoint.remote=" + url(name) : "") + " " + extra + " 2>&1";
  }
  // `moetrain launch -n 4 ...`; on_line sees each line of its output as it comes.
  template <typename OnLine>
  moetrain::testing::CliResult launch(const std::string& name, const std::string& fault, const std::string& extra,
                                      OnLine on_line, bool remote = true) {
    FILE* p = popen(command(name, fault, extra, remote).c_str(), "r");
    std::string out;
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p) != nullptr) {
      out += buf;
      on_line(std::string(buf));
    }
    const int status = pclose(p);
    return {WEXITSTATUS(status), out};
  }
  moetrain::testing::CliResult launch(const std::string& name, const std::string& fault = "",
                                      const std::string& extra = "", bool remote = true) {
    return launch(name, fault, extra, [](const std::string&) {}, remote);
  }

  std::string ckpt(const std::string& name) const { return moetrain::testing::checkpoints_of(run_dir(name)); }
  std::vector<int64_t> remote_steps(const std::string& name) {
    return RemoteTier(url(name), s3_->options(), 0).committed();
  }
  std::vector<int64_t> local_steps(const std::string& name) {
    std::vector<int64_t> out;
    for (const auto& [s, path] : Checkpointer::committed(ckpt(name))) out.push_back(s);
    return out;
  }
  void expect_bitwise_same_end(const std::string& a, const std::string& b) {
    moetrain::testing::expect_bitwise_same_step(run_dir(a), run_dir(b), kSteps);
  }
  // No step of the run waited for the storage (a step here takes well under a second).
  void expect_no_slow_step(const std::string& name) {
    const auto m = moetrain::testing::read_metrics(run_dir(name));
    ASSERT_FALSE(m.empty());
    for (const auto& row : m) {
      EXPECT_LT(row["step_time_s"].get<double>() + row.value("checkpoint_stall_s", 0.0), 2.0) << row.dump();
    }
  }
  static bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

  moetrain::testing::ScratchDir dir_;
  std::string corpus_;
  std::unique_ptr<S3rver> s3_;
};

TEST_F(ChaosRemote, ALostLocalDiskResumesFromTheRemoteTierBitwise) {
  const auto clean = launch("clean", "", "", false);
  ASSERT_EQ(clean.status, 0) << clean.output;
  // Four steps, each mirrored (the end of the run waits for the last upload).
  const auto first = launch("lost", "", "--training.stop_after_steps=4");
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_TRUE(has(first.output, "checkpoint: step 4 mirrored to " + url("lost"))) << first.output;
  EXPECT_EQ(remote_steps("lost").back(), 4);
  // The next run dies (SIGKILL) as step 6 begins, then the machine's disk is gone.
  const auto killed = launch("lost", "kill@step_begin:rank=0:step=6");
  EXPECT_NE(killed.status, 0) << killed.output;
  const int64_t newest_remote = remote_steps("lost").back();
  EXPECT_GE(newest_remote, 4);
  fs::remove_all(ckpt("lost"));
  // A fresh node: the newest remote step comes down and the run ends as the clean one.
  const auto again = launch("lost");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_TRUE(has(again.output, fmt::format("checkpoint: step {} downloaded from", newest_remote))) << again.output;
  EXPECT_TRUE(has(again.output, fmt::format("(step {};", newest_remote))) << again.output;  // resumed from it
  expect_bitwise_same_end("clean", "lost");
  EXPECT_EQ(remote_steps("lost").back(), kSteps);
  EXPECT_EQ(remote_steps("lost").size(), 3u);  // remote_keep = 3
}

TEST_F(ChaosRemote, AKillInTheMiddleOfAnUploadLeavesNoHalfStepAndTheRunEndsBitwise) {
  const auto clean = launch("clean", "", "", false);
  ASSERT_EQ(clean.status, 0) << clean.output;
  // Rank 0's 13th S3 request: after the listing at the start, within the first steps' files.
  const auto killed = launch("midway", "kill@s3:rank=0:skip=12");
  EXPECT_NE(killed.status, 0) << killed.output;
  EXPECT_TRUE(has(killed.output, "fault injected: kill at s3 (rank 0")) << killed.output;
  // Whatever was committed remotely is whole (RemoteTier::committed checks every marker's files).
  const auto before = remote_steps("midway");
  for (int64_t s : before) EXPECT_LE(s, static_cast<int64_t>(local_steps("midway").back())) << s;
  // The job started again resumes from its newest local step and mirrors on.
  const auto again = launch("midway");
  ASSERT_EQ(again.status, 0) << again.output;
  expect_bitwise_same_end("clean", "midway");
  const auto remote = remote_steps("midway");
  ASSERT_FALSE(remote.empty());
  EXPECT_EQ(remote.back(), kSteps);
  EXPECT_TRUE(has(again.output, fmt::format("checkpoint: step {} mirrored to {}", kSteps, url("midway"))))
      << again.output;
}

TEST_F(ChaosRemote, AnS3ServerDownThenBackHoldsNoStepUpAndTheLastStepCommitsRemotely) {
  s3_->stop();
  // The server comes back once the upload of the last step has failed for it: the uploader
  // must try that step again (the run's end waits for it).
  bool restarted = false;
  const std::string last_failed = fmt::format("step {} was not mirrored to {}", kSteps, url("down"));
  const auto r = launch("down", "", "", [&](const std::string& line) {
    if (!restarted && has(line, last_failed)) {
      s3_->start();
      restarted = true;
    }
  });
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_TRUE(restarted) << r.output;
  EXPECT_TRUE(has(r.output, fmt::format("checkpoint: step {} mirrored to", kSteps))) << r.output;
  ASSERT_TRUE(s3_->ok()) << s3_->why();
  EXPECT_TRUE(has(r.output, "cannot be read")) << r.output;  // at the start: resumed from the local tier
  EXPECT_TRUE(has(r.output, "no answer from " + s3_->endpoint())) << r.output;
  expect_no_slow_step("down");
  EXPECT_EQ(local_steps("down").size(), static_cast<size_t>(kSteps));  // the local tier never waited
  const auto remote = remote_steps("down");
  ASSERT_FALSE(remote.empty());
  EXPECT_EQ(remote.back(), kSteps);
}

TEST_F(ChaosRemote, S3ErrorsAreRetriedAndAFailedUploadDoesNotStopTheMirror) {
  // The first three S3 requests (the listing at start) answer 503: the client retries them;
  // the run's first upload fails as a whole (the uploader tries that step again, unless a
  // newer step replaced it meanwhile). Not a step number: on a loaded machine the uploader,
  // busy with one step, may never see step 2 (newest wins).
  const auto r = launch("errors", "error@s3:count=3;error@upload:count=1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "fault injected: error at s3")) << r.output;
  EXPECT_FALSE(has(r.output, "cannot be read")) << r.output;  // the listing at start got through on its 4th try
  EXPECT_TRUE(has(r.output, "checkpoint: newest committed step: none locally")) << r.output;
  EXPECT_TRUE(has(r.output, "was not mirrored to " + url("errors"))) << r.output;
  expect_no_slow_step("errors");
  const auto remote = remote_steps("errors");
  ASSERT_FALSE(remote.empty());
  EXPECT_EQ(remote.back(), kSteps);
}

TEST_F(ChaosRemote, AStalledUploaderHoldsNoStepUpAndTheNewestStepCommitsRemotely) {
  const auto t0 = std::chrono::steady_clock::now();
  // The run's first upload hangs 10 s (whichever step it is: see above).
  const auto r = launch("stalled", "stall=10@upload:count=1");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "fault injected: stall at upload (rank 0, step ")) << r.output;
  EXPECT_TRUE(has(r.output, "replaced it while the uploader was busy with step ")) << r.output;
  expect_no_slow_step("stalled");
  EXPECT_EQ(local_steps("stalled").size(), static_cast<size_t>(kSteps));
  const auto remote = remote_steps("stalled");
  ASSERT_FALSE(remote.empty());
  EXPECT_EQ(remote.back(), kSteps);  // the end of the run waited for it
  EXPECT_GE(took, 10.0);
}

TEST_F(ChaosRemote, AFullDiskFailsOneSaveAndTrainingGoesOnBitwise) {
  const auto clean = launch("clean", "", "", false);
  ASSERT_EQ(clean.status, 0) << clean.output;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = launch("full", "error@write:rank=1:step=3", "", false);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(has(r.output, "write failed: No space left on device")) << r.output;
  EXPECT_TRUE(has(r.output, "checkpoint step 3 is not committed: rank 1 could not write its files")) << r.output;
  EXPECT_LT(took, 120.0) << "rank 0 waited for rank 1's manifest";
  expect_no_slow_step("full");
  EXPECT_EQ(local_steps("full"), (std::vector<int64_t>{1, 2, 4, 5, 6, 7}));
  expect_bitwise_same_end("clean", "full");
}

}  // namespace
}  // namespace moetrain
