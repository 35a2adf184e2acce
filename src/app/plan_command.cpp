#include "app/plan_command.h"

#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/plan/memory_plan.h"
#include "engine/run_config.h"

namespace moetrain::app {
namespace {

// "80GiB", "141GB", "79.6 GiB", or bytes.
double parse_memory(const std::string& text) {
  size_t end = 0;
  double v = 0;
  try {
    v = std::stod(text, &end);
  } catch (const std::exception&) {
    MT_THROW("plan: --gpu-memory '{}' is not a size (write e.g. 80GiB or 141GB)", text);
  }
  std::string unit = text.substr(end);
  unit.erase(0, unit.find_first_not_of(' '));
  const double scale = unit.empty() || unit == "B"           ? 1.0
                       : unit == "GiB" || unit == "G"          ? 1024.0 * 1024 * 1024
                       : unit == "GB"                          ? 1e9
                       : unit == "MiB"                         ? 1024.0 * 1024
                       : unit == "TiB"                         ? 1024.0 * 1024 * 1024 * 1024
                                                               : -1;
  MT_CHECK(scale > 0 && v > 0, "plan: --gpu-memory '{}': expected a positive size in B, MiB, GiB, GB or TiB", text);
  return v * scale;
}

}  // namespace

int run_plan(const std::string& config, const std::vector<std::string>& overrides, const PlanOptions& a) {
  const RunConfig cfg = RunConfig::load(config, overrides);
  const double memory = parse_memory(a.gpu_memory);
  const ParallelConfig& p = cfg.parallel;
  const int64_t fixed = p.pp * p.cp * p.ep;  // the ranks of one data-parallel replica
  const int gpus = a.gpus > 0 ? a.gpus : static_cast<int>(fixed * (p.dp > 0 ? p.dp : 1));
  const bool gpu = cfg.training.device == "cuda";
  std::printf("plan: %s on %d %s of %.1f GiB; micro-batch %lld x %lld, %lld a step; recompute %s\n",
              config.c_str(), gpus, gpu ? "GPUs" : "CPU ranks", memory / (1024.0 * 1024 * 1024),
              static_cast<long long>(cfg.training.micro_batch_size), static_cast<long long>(cfg.training.seq_len),
              static_cast<long long>(cfg.training.grad_accum_steps), cfg.training.recompute.c_str());
  if (gpus % fixed == 0 && (p.dp < 0 || fixed * p.dp == gpus)) {
    const MemoryPlan mine = plan_memory(cfg, layout_of(cfg, gpus, memory), gpu);
    std::printf("\n%s", format_memory_plan(mine, memory).c_str());
  } else {
    std::printf("\nthe config's layout (pp %lld, cp %lld, ep %lld) does not divide %d GPUs\n",
                static_cast<long long>(p.pp), static_cast<long long>(p.cp), static_cast<long long>(p.ep), gpus);
  }
  std::vector<MemoryPlan> plans;
  for (const PlanLayout& l : layouts_of(cfg, gpus, memory)) plans.push_back(plan_memory(cfg, l, gpu));
  std::printf("\nevery layout of %d:\n%s", gpus, format_memory_plans(plans, memory).c_str());
  return 0;
}

}  // namespace moetrain::app
