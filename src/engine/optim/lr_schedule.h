// Learning-rate schedules: linear warmup, then cosine decay, warmup-stable-decay (WSD),
// or constant. Steps are 0-based; the rate for step s is used by the update of step s.
#pragma once

#include <cstdint>
#include <string>

namespace moetrain {

struct LrSchedule {
  std::string kind = "cosine";  // "cosine" | "wsd" | "constant"
  double peak_lr = 0, min_lr = 0;
  int64_t warmup_steps = 0, total_steps = 1;
  double decay_fraction = 0.2;  // wsd: share of total_steps spent decaying

  // warmup: peak * (s + 1) / warmup. cosine: min + (peak - min) (1 + cos(pi p)) / 2 with p
  // the progress through the post-warmup steps. wsd: peak until the decay phase, then
  // linear to min at the last step.
  double at(int64_t step) const;
};

}  // namespace moetrain
