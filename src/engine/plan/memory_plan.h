// MemoryPlan: what one rank of a training job will hold on its device, part by part, worked
// out from the config before anything is allocated (docs/memory.md): `moetrain plan` prints it
// for the config's layout or every layout of N GPUs, and the trainer prints it at start-up
// and stops before allocating when it will not fit. It follows what moetrain allocates
// (parameters, FSDP's shards and gathers, each family's saved activations through
// ModelConfig::layer_footprint, the micro-batches a schedule keeps in flight, pipeline
// messages, the head's logits); expert loads are taken as balanced, so the busiest expert
// rank of a real run holds somewhat more.
#pragma once

#include <string>
#include <vector>

#include "engine/run_config.h"

namespace moetrain {

// The layout a plan is for (one replica group's mesh and the choices that change memory).
struct PlanLayout {
  int pp = 1, dp = 1, cp = 1, ep = 1;
  std::string schedule = "dualpipev";  // with pp > 1
  bool shard_weights = false;          // ZeRO-3 (with more than one rank)
  bool ep_overlap = false;             // paired micro-batches (two in flight)
  int world() const { return pp * dp * cp * ep; }
  std::string str() const;
};

struct MemoryPart {
  std::string name;
  double bytes = 0;
  std::string note;
};

struct MemoryPlan {
  PlanLayout layout;
  int pipeline_rank = 0;            // the pipeline rank planned (the one with the most)
  std::vector<MemoryPart> parts;    // what the allocator's peak (peak_memory_bytes) counts
  double training_peak = 0;         // their sum
  double startup_peak = 0;          // FSDP's constructor: the model as built, or the shards beside what it keeps
  std::vector<MemoryPart> outside;  // what it does not count: the CUDA context, workspaces
  double peak() const { return training_peak > startup_peak ? training_peak : startup_peak; }
  double outside_bytes() const;
  // Whether peak() + outside_bytes() fits `device_bytes`.
  bool fits(double device_bytes) const { return peak() + outside_bytes() <= device_bytes; }
};

// The config's own layout on `world` ranks (its [parallel] section, dp inferred), with
// shard_weights and ep_overlap resolved as the trainer resolves them for `device_bytes`.
PlanLayout layout_of(const RunConfig& cfg, int world, double device_bytes);
// Every layout of `gpus` ranks the model splits into (pp, ep dividing; dp the rest), each
// with the config's other choices.
std::vector<PlanLayout> layouts_of(const RunConfig& cfg, int gpus, double device_bytes);

// The plan of the pipeline rank that holds the most (or of pipeline rank `rank`, when given).
// `gpu`: bf16 weights and activations with split f32 masters (else the CPU's f32 model).
MemoryPlan plan_memory(const RunConfig& cfg, const PlanLayout& layout, bool gpu, int rank = -1);

// At a run's start: this job's plan (pp, dp, ep: its mesh, dp the ranks that shard the
// experts) against the GPU's memory, logged by `log` (rank 0); an Error naming the parts, before
// anything is allocated, when it will not fit and `refuse` ([training].check_memory).
void check_memory_at_start(const RunConfig& cfg, int pp, int dp, int cp, int ep, double device_bytes, bool log,
                           bool refuse);

// A plan as a table of parts (GiB), and whether it fits `device_bytes`.
std::string format_memory_plan(const MemoryPlan& plan, double device_bytes);
// One line per plan: layout, peak, outside, fits.
std::string format_memory_plans(const std::vector<MemoryPlan>& plans, double device_bytes);

}  // namespace moetrain
