#include "core/log.h"

namespace moetrain {
void init_logging(const std::string& level) {
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  spdlog::set_level(spdlog::level::from_str(level));
}
}  // namespace moetrain
