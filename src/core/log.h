// Logging: spdlog's default logger, with one format for the whole program.
#pragma once

#include <spdlog/spdlog.h>

namespace moetrain {
// Sets the format ("[time] level message") and the level ("info", "debug", ...).
void init_logging(const std::string& level = "info");
// "SIGTERM", "SIGKILL", ... for log lines ("signal N" when the system has no name for it).
std::string signal_name(int sig);
}  // namespace moetrain
