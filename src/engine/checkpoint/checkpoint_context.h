// CheckpointContext: the checkpoint subsystem of a training run ([checkpoint]), live: where
// the run starts from (the newest committed step, the one named, or weights only from
// init_from) and the saves along the way (every N steps and at the end), each a snapshot of
// this rank's weights, optimizer state and buffers plus the run's TrainState.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "engine/checkpoint/checkpointer.h"
#include "engine/run_config.h"
#include "engine/train_context.h"
#include "engine/train_state.h"

namespace moetrain {

class CheckpointContext {
 public:
  // Finds the step to resume (rank 0 removes saves that never committed; every rank waits
  // for that) and prepares the host buffers of the saves.
  CheckpointContext(const RunConfig& cfg, TrainContext& ctx);

  // Loads into the model and optimizer what the run starts from and returns the state it
  // starts in: a resumed step's, or step 0 (weights from init_from, or as initialised).
  // An error names the checkpoint when it does not fit the run.
  TrainState restore();
  // After `state.step` steps: saves when it is a save step (every N, or `last` with
  // save_final) or `force` (preemption); returns the training's wait for the save, else nothing.
  std::optional<double> after_step(const TrainState& state, bool last, bool force = false);
  // The run ends with its last save committed (rethrows its error).
  void finish();

 private:
  CheckpointItems items();
  void make_checkpointer();
  nlohmann::json trainer_state(const TrainState& state) const;

  const RunConfig& cfg_;
  TrainContext& ctx_;
  std::string dir_;
  std::string resume_from_;
  std::unique_ptr<Checkpointer> checkpointer_;
};

}  // namespace moetrain
