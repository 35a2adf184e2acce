#include "core/log.h"

#include <cstring>
#include <string>

namespace moetrain {
namespace {
// spdlog builds its registry (the default logger) on first use; build it while the program
// is loading, on the main thread, so that threads logging first never race to build it
// (ThreadSanitizer saw two test threads do so).
const bool kLoggerBuilt = spdlog::default_logger_raw() != nullptr;
}  // namespace

void init_logging(const std::string& level) {
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  spdlog::set_level(spdlog::level::from_str(level));
}

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

}  // namespace moetrain
