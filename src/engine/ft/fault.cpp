#include "engine/ft/fault.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace moetrain {
namespace {

struct Fault {
  std::string action, point;
  double stall_s = 0;
  int64_t rank = -1, step = -1, generation = -1;  // -1: any
  int64_t count = -1;                              // -1: every time
  int64_t skip = 0;                                // matches passed over before it fires
  int64_t from_step = -1;                          // -1: any; else steps >= it only
};

int64_t env_int(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoll(v, nullptr, 10) : 0;
}

std::vector<Fault> parse(const std::string& text) {
  std::vector<Fault> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(';', start);
    if (end == std::string::npos) end = text.size();
    const std::string one = text.substr(start, end - start);
    start = end + 1;
    if (one.empty()) continue;
    Fault f;
    const size_t at = one.find('@');
    MT_CHECK(at != std::string::npos, "MOETRAIN_FAULT: '{}' is not ACTION@POINT[:key=value...]", one);
    f.action = one.substr(0, at);
    std::string rest = one.substr(at + 1);
    size_t colon = rest.find(':');
    f.point = rest.substr(0, colon);
    while (colon != std::string::npos) {
      const size_t next = rest.find(':', colon + 1);
      const std::string kv = rest.substr(colon + 1, next == std::string::npos ? std::string::npos : next - colon - 1);
      colon = next;
      const size_t eq = kv.find('=');
      MT_CHECK(eq != std::string::npos, "MOETRAIN_FAULT: '{}' in '{}' is not key=value", kv, one);
      const std::string k = kv.substr(0, eq);
      const int64_t v = std::strtoll(kv.c_str() + eq + 1, nullptr, 10);
      if (k == "rank") f.rank = v;
      else if (k == "step") f.step = v;
      else if (k == "generation") f.generation = v;
      else if (k == "count") f.count = v;
      else if (k == "skip") f.skip = v;
      else if (k == "from_step") f.from_step = v;
      else MT_THROW("MOETRAIN_FAULT: unknown key '{}' in '{}' (rank, step, from_step, generation, count, skip)", k, one);
    }
    if (f.action.rfind("stall=", 0) == 0) {
      f.stall_s = std::strtod(f.action.c_str() + 6, nullptr);
      f.action = "stall";
    }
    MT_CHECK(f.action == "kill" || f.action == "kill_node" || f.action == "exit" || f.action == "stall" ||
                 f.action == "term" || f.action == "error",
             "MOETRAIN_FAULT: unknown action '{}' in '{}' (kill, kill_node, exit, stall=SECONDS, term, error)",
             f.action, one);
    static const std::vector<std::string_view> points{"step_begin", "save",      "files",        "index",
                                                      "rename",     "latest",    "write",        "upload",
                                                      "s3",         "micro_batch", "ft_quorum",  "ft_step",
                                                      "ft_heal_send", "ft_allreduce", "ft_commit"};
    MT_CHECK(std::find(points.begin(), points.end(), f.point) != points.end(),
             "MOETRAIN_FAULT: unknown point '{}' in '{}' ({})", f.point, one, fmt::join(points, ", "));
    out.push_back(f);
  }
  return out;
}

std::vector<Fault>* faults() {
  static std::vector<Fault>* parsed = [] {
    const char* v = std::getenv("MOETRAIN_FAULT");
    return v && *v ? new std::vector<Fault>(parse(v)) : nullptr;
  }();
  return parsed;
}

}  // namespace

bool fault_point(std::string_view point, int64_t step) {
  std::vector<Fault>* all = faults();
  if (all == nullptr) return false;
  static std::mutex mu;  // points fire from the training, writer and uploader threads
  const int64_t rank = env_int("RANK"), generation = env_int("TORCHELASTIC_RESTART_COUNT");
  bool error = false;
  for (Fault& f : *all) {
    if (f.point != point || (f.rank >= 0 && f.rank != rank) || (f.step >= 0 && f.step != step) ||
        (f.from_step >= 0 && step < f.from_step) || (f.generation >= 0 && f.generation != generation)) {
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (f.skip > 0) {
        --f.skip;
        continue;
      }
      if (f.count == 0) continue;
      if (f.count > 0) --f.count;
    }
    spdlog::warn("fault injected: {} at {} (rank {}, step {}, generation {}, t={:.6f})", f.action, point, rank, step,
                 generation, epoch_seconds());
    if (f.action == "kill_node") {
      // A moment for the line above to reach the launcher's log; then the launcher, whose
      // other workers die with it (PR_SET_PDEATHSIG).
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      ::kill(::getppid(), SIGKILL);
    }
    if (f.action == "kill" || f.action == "kill_node") ::kill(::getpid(), SIGKILL);
    if (f.action == "exit") ::_exit(3);
    if (f.action == "term") ::kill(::getpid(), SIGTERM);
    if (f.action == "stall") std::this_thread::sleep_for(std::chrono::duration<double>(f.stall_s));
    if (f.action == "error") error = true;
  }
  return error;
}

}  // namespace moetrain
