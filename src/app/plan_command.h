// `moetrain plan`: the memory a config's training job will need per GPU, by part, for its
// layout and every layout of N GPUs (engine/plan/memory_plan.h), before anything is allocated.
#pragma once

#include <string>
#include <vector>

namespace moetrain::app {

struct PlanOptions {
  int gpus = 0;                      // 0: the config's layout's ranks
  std::string gpu_memory = "80GiB";  // one GPU's memory: 80GiB, 141GB, ...
};

// Prints the plan of the config (with `overrides`, "section.key=value") to stdout.
int run_plan(const std::string& config, const std::vector<std::string>& overrides, const PlanOptions& options);

}  // namespace moetrain::app
