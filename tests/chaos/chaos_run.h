// Helpers of the chaos scenarios: the small training run they all fault, the checks that
// a faulted run ended as a fault-free one, and processes run in the background (agents of
// several "nodes" on this machine, a store server) whose output the test watches.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "app/cli_run.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
#include "test_files.h"

namespace moetrain::testing {

// A corpus of 200 short documents in `dir`; returns its path.
inline std::string write_chaos_corpus(const ScratchDir& dir) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "The quick brown fox " + std::to_string(i * 11 % 17) + " jumps.\n%\n";
  return dir.file("corpus.txt", text);
}

// The worker command of every chaos run: the tiny model, `steps` steps of 2 micro-batches
// of one 32-token row, ep2 (dp inferred), a synchronous checkpoint every step (the kill
// points then fall where they are named), metrics and checkpoints under `run_dir`.
inline std::string chaos_train_args(const std::string& corpus, const std::string& run_dir, int steps) {
  return "train --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml --data.paths=" + corpus +
         " --training.steps=" + std::to_string(steps) +
         " --training.seq_len=32 --training.micro_batch_size=1 --training.grad_accum_steps=2"
         " --training.eval_every=100 --training.eval_batches=1 --training.sample_tokens=0 --training.threads=1"
         " --optimizer.warmup_steps=1 --parallel.ep=2 --metrics.progress=false --checkpoint.every=1"
         " --checkpoint.keep=0 --checkpoint.async=false --metrics.dir=" +
         run_dir;
}

inline std::string checkpoints_of(const std::string& run_dir) { return run_dir + "/checkpoints"; }

// `sh -c cmd`, its exit status and everything it printed.
inline CliResult run_shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

// Every tensor (weights, masters, Adam moments) of two runs' step `step`, bitwise, and the
// step and data position they hold.
inline void expect_bitwise_same_step(const std::string& run_a, const std::string& run_b, int64_t step) {
  CheckpointReader ra(checkpoints_of(run_a) + "/" + Checkpointer::step_dir_name(step));
  CheckpointReader rb(checkpoints_of(run_b) + "/" + Checkpointer::step_dir_name(step));
  ASSERT_EQ(ra.names(), rb.names());
  int compared = 0;
  for (const std::string& name : ra.names()) {
    const Tensor x = ra.read_whole(name), y = rb.read_whole(name);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << name;
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << name << " differs at step " << step;
    ++compared;
  }
  EXPECT_GT(compared, 100);  // the model's tensors and their optimizer state
  EXPECT_EQ(ra.trainer_state()["step"], rb.trainer_state()["step"]);
  EXPECT_EQ(ra.trainer_state()["data"]["train_position"], rb.trainer_state()["data"]["train_position"]);
}

// Steps 1..steps committed, each once, and no save left half-written.
inline void expect_every_step_committed_once(const std::string& run_dir, int steps) {
  std::set<int64_t> seen;
  for (const auto& [s, path] : Checkpointer::committed(checkpoints_of(run_dir))) {
    EXPECT_TRUE(seen.insert(s).second) << s;
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(steps));
  if (!seen.empty()) {
    EXPECT_EQ(*seen.begin(), 1);
    EXPECT_EQ(*seen.rbegin(), steps);
  }
  for (const auto& e : std::filesystem::directory_iterator(checkpoints_of(run_dir))) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << "a save left behind: " << e.path();
  }
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Waits until `file` holds `text`; false after `limit`.
inline bool wait_for_text(const std::string& file, const std::string& text, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (read_text(file).find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// `sh -c cmd` in the background, in its own process group, its output in `log`; killed
// with its group when still running at the end of the test.
class Background {
 public:
  Background(const std::string& cmd, std::string log) : log_(std::move(log)) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      const std::string full = "{ " + cmd + " ; } >" + log_ + " 2>&1 </dev/null";
      ::execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  ~Background() {
    if (pid_ > 0) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // Its exit status (128 + signal when killed), waiting up to `limit`; -1 when still running.
  int wait(std::chrono::milliseconds limit = std::chrono::seconds(120)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (pid_ > 0) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        status_ = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        break;
      }
      if (std::chrono::steady_clock::now() > until) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }
  void kill(int sig = SIGKILL) {
    if (pid_ > 0) ::kill(-pid_, sig);
  }
  std::string output() const { return read_text(log_); }
  const std::string& log() const { return log_; }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int status_ = -1;
};

}  // namespace moetrain::testing
