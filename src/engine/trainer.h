// The single-process training loop: builds the contexts a run needs from its RunConfig
// (data, model, dispatcher, optimizer, metrics), trains, validates every N steps, and ends
// with a summary and a short text sampled from the model.
#pragma once

#include <string>

#include "engine/run_config.h"

namespace moetrain {

struct TrainSummary {
  int64_t steps = 0;
  double first_val_loss = 0, last_val_loss = 0;
  double first_train_loss = 0, last_train_loss = 0;
  double tokens_per_s = 0;  // training tokens over training time (validation excluded)
  double seconds = 0;       // whole run
  int64_t parameters = 0;
  std::string sample;
};

TrainSummary train(const RunConfig& cfg);

}  // namespace moetrain
