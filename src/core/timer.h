// Wall-clock seconds since a point of the steady clock: for the timings runs log. And the
// time of day as seconds since the epoch: for moments that cross processes and machines
// (a failure seen by the launcher, a worker's first step after it).
#pragma once

#include <chrono>

namespace moetrain {

using SteadyClock = std::chrono::steady_clock;

inline double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

inline double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace moetrain
