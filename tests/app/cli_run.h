// Helpers of the command-line tests: run the moetrain binary and read a run's metrics.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moetrain::testing {

struct CliResult {
  int status;
  std::string output;  // stdout and stderr
};

// The binary under test: the build's, or $MOETRAIN_BINARY (tests run from a copy of the
// binaries on another machine, scripts/device-bundle).
inline std::string moetrain_binary() {
  const char* env = std::getenv("MOETRAIN_BINARY");
  return env != nullptr && *env != '\0' ? env : MOETRAIN_BINARY;
}

// `moetrain <args>` through the shell; its exit status and everything it printed.
inline CliResult run_moetrain(const std::string& args) {
  const std::string cmd = moetrain_binary() + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

// The lines of <dir>/metrics.jsonl.
inline std::vector<nlohmann::json> read_metrics(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace moetrain::testing
