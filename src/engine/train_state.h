// TrainState: what a run must carry, besides its weights and optimizer moments, to go on
// exactly where it was: the steps done, the optimizer's own step count (Adam's bias
// correction), where the training data stands, and the model's non-gradient buffers (a
// routing bias). A checkpoint saves and loads it as one thing (trainer_state.json + the
// buffers as tensors beside the weights), and a recovering replica is sent it as one thing.
//
// StepHooks are where fault tolerance plugs into the step loop (DESIGN.md section 6):
// before a step (membership: a replica group joining or leaving) and once a step's
// gradients are complete (commit: take the optimizer step, or discard it). Empty hooks do
// nothing, which is how every run trains today.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/models/model.h"

namespace moetrain {

struct TrainState {
  int64_t step = 0;             // optimizer steps committed
  int64_t optimizer_steps = 0;  // the optimizer's count (AdamW bias correction)
  nlohmann::json data_position; // the training loader's position (DataLoader::position)
  std::vector<NamedBuffer> buffers;  // the model's buffers (live views)

  // Into / out of trainer_state.json: "step", "optimizer": {"steps_taken"}, "data":
  // {"train_position"} (the other keys of that file are the checkpoint's). from_json errors
  // name `origin` and the missing key.
  void write_json(nlohmann::json& st) const;
  void read_json(const nlohmann::json& st, const std::string& origin);
};

struct StepHooks {
  // Before a step's batches are drawn (the state says which step is next).
  std::function<void(TrainState&)> before_step;
  // The step's gradients are complete (reduced over the replica group's ranks), the
  // optimizer has not run: true commits the step (the optimizer runs), false discards it
  // (weights and optimizer state stay as they were; the loop does not count the step).
  std::function<bool(const TrainState&)> after_gradients;

  bool commit(const TrainState* state) const {
    return !after_gradients || state == nullptr || after_gradients(*state);
  }
};

}  // namespace moetrain
