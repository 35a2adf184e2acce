// The choices that the "auto" layout settings make ([parallel].shard_weights and
// [parallel].ep_overlap), as rules over sizes and settings alone: the trainer asks them with
// its model's bytes (train_context.cpp) and `moetrain plan` with the planned ones
// (plan/memory_plan.cpp), so the plan describes the layout the trainer will run.
#pragma once

#include <string>

#include "engine/run_config.h"

namespace moetrain {

struct LayoutChoice {
  bool on = false;
  std::string why;  // for the log: what decided it
};

// This rank's whole weights with their f32 gradients (bytes) against its memory: they "fit"
// when they take at most a quarter of it.
struct WholeWeightBytes {
  double bytes = 0, memory = 0;
  bool fit() const { return bytes <= memory / 4; }
};

// Whether data parallelism shards the weights too (ZeRO-3). Never under a pipeline (many
// micro-batches in flight: gathering per micro-batch and chunk would multiply the
// traffic); with "auto", only when the whole weights do not fit.
LayoutChoice decide_shard_weights(const std::string& setting, bool pipelined, const WholeWeightBytes& whole);

// Whether plain expert parallelism (ep > 1, pp = 1) runs micro-batches in overlapped pairs.
// "auto": on GPUs, with two or more micro-batches a step, and whole weights that fit.
LayoutChoice decide_ep_overlap(const RunConfig& cfg, const WholeWeightBytes& whole);

}  // namespace moetrain
