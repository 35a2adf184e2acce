// CheckpointContext: the checkpoint subsystem of a training run ([checkpoint]), live: where
// the run starts from (the newest committed step, the one named, or weights only from
// init_from) and the saves along the way (every N steps and at the end), each a snapshot of
// this rank's weights, optimizer state and buffers plus the run's TrainState. With
// [checkpoint].remote, rank 0 mirrors each committed step to the object store in the
// background (Uploader) and the run may start from a step only the remote tier holds.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "engine/checkpoint/checkpointer.h"
#include "engine/checkpoint/remote_tier.h"
#include "engine/run_config.h"
#include "engine/train_context.h"
#include "engine/train_state.h"

namespace moetrain {

class CheckpointContext {
 public:
  // Finds the step to resume (rank 0 removes saves that never committed and, with a remote
  // tier, downloads its newest step when it is newer than every local one; every rank waits
  // for that) and prepares the host buffers of the saves.
  CheckpointContext(const RunConfig& cfg, TrainContext& ctx);

  // Loads into the model and optimizer what the run starts from and returns the state it
  // starts in: a resumed step's, or step 0 (weights from init_from, or as initialised).
  // An error names the checkpoint when it does not fit the run.
  TrainState restore();
  // After `state.step` steps: saves when it is a save step (every N, or `last` with
  // save_final) or `force` (preemption); returns the training's wait for the save, else nothing.
  std::optional<double> after_step(const TrainState& state, bool last, bool force = false);
  // The commit (rank 0) finished since the last call, if any: the metrics report it once.
  std::optional<CommitStats> take_commit() { return checkpointer_ ? checkpointer_->take_commit() : std::nullopt; }
  // The run ends with its last save committed (rethrows its error) and, with a remote tier,
  // waits up to remote_wait_s for its upload.
  void finish();

 private:
  CheckpointItems items();
  void make_checkpointer();
  void fetch_remote();  // rank 0, before the others look at dir_
  nlohmann::json trainer_state(const TrainState& state) const;

  const RunConfig& cfg_;
  TrainContext& ctx_;
  std::string dir_;
  std::string resume_from_;
  int64_t remote_newest_ = -1;  // rank 0: the newest remote step at start (-1: none or unknown)
  bool remote_listed_ = false;
  std::unique_ptr<Uploader> uploader_;  // before checkpointer_: its writer calls the uploader
  std::unique_ptr<Checkpointer> checkpointer_;
};

}  // namespace moetrain
