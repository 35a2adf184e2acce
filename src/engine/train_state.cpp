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
  try {
    step = st["step"].get<int64_t>();
    optimizer_steps = st["optimizer"]["steps_taken"].get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("checkpoint {}: trainer_state.json: step and optimizer.steps_taken must be integers ({})", origin,
             e.what());
  }
  data_position = st["data"]["train_position"];
}

}  // namespace moetrain
