#include "engine/train_state.h"

#include "core/error.h"

namespace moetrain {

void TrainState::write_json(nlohmann::json& st) const {
  st["step"] = step;
  st["optimizer"]["steps_taken"] = optimizer_steps;
  st["data"]["train_position"] = data_position;
}

void TrainState::read_json(const nlohmann::json& st, const std::string& origin) {
  MT_CHECK(st.contains("step") && st.contains("data") && st.contains("optimizer"),
           "checkpoint {}: trainer_state.json lacks step, data or optimizer: not a training checkpoint (use "
           "[checkpoint].init_from for weights only)",
           origin);
  MT_CHECK(st["optimizer"].contains("steps_taken") && st["data"].contains("train_position"),
           "checkpoint {}: trainer_state.json lacks optimizer.steps_taken or data.train_position", origin);
  // JSON integers only: nlohmann converts a float by a C++ cast, undefined beyond int64's range.
  MT_CHECK(st["step"].is_number_integer() && st["optimizer"]["steps_taken"].is_number_integer(),
           "checkpoint {}: trainer_state.json: step and optimizer.steps_taken must be integers (got {} and {})", origin,
           st["step"].dump(), st["optimizer"]["steps_taken"].dump());
  step = st["step"].get<int64_t>();
  optimizer_steps = st["optimizer"]["steps_taken"].get<int64_t>();
  data_position = st["data"]["train_position"];
}

}  // namespace moetrain
