#include "engine/parallel/layout_choices.h"

#include <fmt/format.h>

namespace moetrain {

LayoutChoice decide_shard_weights(const std::string& setting, bool pipelined, const WholeWeightBytes& whole) {
  if (pipelined) return {false, "weights kept whole under pipeline parallelism (ZeRO-2: gradients and optimizer "
                                "state sharded)"};
  if (setting != "auto") return {setting == "true", fmt::format("[parallel].shard_weights = {}", setting)};
  const bool shard = !whole.fit();
  return {shard, fmt::format("[parallel].shard_weights = \"auto\": this rank's whole weights and f32 gradients take "
                             "{:.2f} GB of {:.1f} GB: {}",
                             whole.bytes / 1e9, whole.memory / 1e9,
                             shard ? "sharded (ZeRO-3: gathered per layer and micro-batch)"
                                   : "kept whole (ZeRO-2: one gather and one reduce-scatter a step)")};
}

LayoutChoice decide_ep_overlap(const RunConfig& cfg, const WholeWeightBytes& whole) {
  const std::string& setting = cfg.parallel.ep_overlap;
  if (setting != "auto") return {setting == "true", fmt::format("[parallel].ep_overlap = {}", setting)};
  std::string why;
  if (cfg.training.device != "cuda") {
    why = "off: not on GPUs (nothing runs beside an exchange on the CPU)";
  } else if (cfg.training.grad_accum_steps < 2) {
    why = "off: one micro-batch a step, none to pair";
  } else if (cfg.parallel.shard_weights == "true") {
    why = "off: [parallel].shard_weights = true (the pairs keep weights whole)";
  } else if (!whole.fit()) {
    why = fmt::format("off: whole weights and f32 gradients take {:.2f} GB of {:.1f} GB (ZeRO-3 then)",
                      whole.bytes / 1e9, whole.memory / 1e9);
  }
  return {why.empty(), "[parallel].ep_overlap = \"auto\": " +
                           (why.empty() ? std::string("on (micro-batches in overlapped forward/backward pairs, "
                                                      "weights kept whole)")
                                        : why)};
}

}  // namespace moetrain
