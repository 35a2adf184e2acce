#include "engine/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace moetrain {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (kind == "constant") return peak_lr;
  if (kind == "wsd") {
    const int64_t decay_steps = std::max<int64_t>(1, std::llround(decay_fraction * static_cast<double>(total_steps)));
    const int64_t decay_start = std::max(warmup_steps, total_steps - decay_steps);
    if (step < decay_start) return peak_lr;
    const double span = static_cast<double>(std::max<int64_t>(1, total_steps - 1 - decay_start));
    const double p = std::min(1.0, static_cast<double>(step - decay_start) / span);
    return peak_lr + (min_lr - peak_lr) * p;
  }
  // cosine
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - 1 - warmup_steps));
  const double p = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace moetrain
