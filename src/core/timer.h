// Wall-clock seconds since a point of the steady clock: for the timings runs log.
#pragma once

#include <chrono>

namespace moetrain {

using SteadyClock = std::chrono::steady_clock;

inline double seconds_since(SteadyClock::time_point t0) {
  return std::chrono::duration<double>(SteadyClock::now() - t0).count();
}

}  // namespace moetrain
