// Per-step training metrics: one JSON object per line in <dir>/metrics.jsonl (for plots
// and tools), and a short human-readable line for the log.
#pragma once

#include <array>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/telemetry/collective_timer.h"

namespace moetrain {

// How evenly one MoE layer's experts were loaded in a step.
struct ExpertLoad {
  double max_over_mean = 0;  // busiest expert's tokens / the mean (1: perfectly even)
  double cv = 0;             // coefficient of variation of the tokens per expert
  int64_t idle = 0;          // experts that got no token
};
ExpertLoad expert_load(const std::vector<int64_t>& tokens_per_expert);

struct StepMetrics {
  int64_t step = 0;
  double loss = 0, aux_loss = 0;  // aux_loss: every term of the objective besides the main cross-entropy
  // Each such term by name, already times its weight (aux_loss, z_loss, seq_aux_loss, mtp_loss).
  std::vector<std::pair<std::string, double>> loss_terms;
  double lr = 0, grad_norm = 0;
  double tokens_per_s = 0, tflops = 0, step_time_s = 0;  // tflops: achieved TFLOP/s
  double expert_load_max_over_mean = 0;                  // busiest expert's tokens / mean
  // Aux-loss-free balancing: the routing biases (e_score_correction_bias) of this rank's MoE
  // layers after the step, per layer its largest |b| and its range; only on the steps of the
  // human log line (reading them waits for the device).
  struct RouterBias {
    std::vector<double> abs_max, range;
  };
  std::optional<RouterBias> router_bias;
  int64_t peak_memory_bytes = 0;
  // Memory at the step's end: tensors live (device, or host on the CPU), what the device's
  // pool holds from the driver (the host's live bytes on the CPU), the change of the live bytes
  // since the previous step (a leak grows it step after step), page-locked host memory.
  int64_t live_memory_bytes = 0, reserved_memory_bytes = 0, memory_growth_bytes = 0, pinned_host_bytes = 0;
  std::string layout;  // "pp 1 x dp 2 x cp 1 x tp 1 x ep 2 (4 ranks)" (Mesh::str)
  int64_t tokens = 0;  // tokens trained on so far
  std::optional<double> val_loss;  // written as null when absent
  std::optional<double> checkpoint_stall_s;  // only on steps that saved: the step's wait for the save
  // Only on the first step after a save's commit finished (rank 0 commits, in the background):
  // which step it was, the seconds from the start of writing to the commit, its bytes.
  struct Commit {
    int64_t step = 0;
    double seconds = 0;
    uint64_t bytes = 0;
  };
  std::optional<Commit> checkpoint_commit;
  int64_t restart_generation = 0;  // `moetrain launch --max-restarts`: how many times the job was restarted
  int64_t world_size = 1;          // ranks of the job (smaller after an elastic restart on fewer nodes)
  // Only on the first step after a restart: seconds from the failure to this step's start
  // (detection, stop, rendezvous, start, checkpoint load: the training time the failure cost,
  // besides the steps since the last committed one, which are trained again).
  std::optional<double> restart_downtime_s;
  // Live fault tolerance ([fault_tolerance]), only when it is on: the replica groups in this
  // step's quorum, the time to get the quorum, the group this one copied its state from
  // (only on the step it healed) with the bytes and seconds of the copy, and the steps
  // discarded since the previous committed one (a collective across groups failed).
  struct Replicas {
    int in_quorum = 1;
    int64_t quorum_id = 0;
    double quorum_ms = 0;
    std::optional<std::string> recovered_from;
    int64_t heal_bytes = 0;
    double heal_s = 0;
    int64_t discarded_steps = 0;
  };
  std::optional<Replicas> replicas;
  // Tokens routed to each expert in the step, per MoE layer (the layers rank 0 holds: all of
  // them, but under a pipeline its stage's), summed over the data ranks.
  std::vector<std::vector<int64_t>> expert_tokens;
  // Per MoE layer as expert_tokens: the router's entropy, mean over the step's tokens, in
  // nats (log num_experts: it cannot tell the experts apart; 0: certain of one expert).
  std::vector<double> router_entropy;
  // Several ranks with [metrics].detailed: this rank's collectives of the step by kind (ms
  // they ran, ms the compute waited for them, count, bytes sent); kinds that did not run
  // are left out of the record.
  std::optional<std::array<CollectiveTotals, kNumCollectives>> collectives;
};

// Watches the per-layer expert loads step after step and says when a layer's has stayed
// badly skewed (busiest expert at `threshold` x the mean or more) for `steps` steps in a
// row: a router collapsing onto a few experts. Says it once per stretch.
class ExpertLoadWatch {
 public:
  explicit ExpertLoadWatch(double threshold = 2.0, int64_t steps = 100) : threshold_(threshold), steps_(steps) {}
  // The warning to log after this step, or empty.
  std::string observe(const StepMetrics& m);

 private:
  double threshold_;
  int64_t steps_;
  std::vector<int64_t> run_;   // per layer: consecutive skewed steps
  std::vector<bool> warned_;   // per layer: said for the current stretch
};

// Every number of a step as (tag, value), the one list of names the TensorBoard scalars use
// ("train/loss", "moe/layer0/load_max_over_mean", ...); optional fields only when set.
std::vector<std::pair<std::string, double>> metrics_scalars(const StepMetrics& m);

// Appends StepMetrics to <dir>/metrics.jsonl, one line each, flushed at once so that a
// crash loses nothing already written.
class MetricsWriter {
 public:
  // Creates `dir` if needed. append = false starts the file afresh (a new run); true keeps
  // the lines already there (a resumed run). Throws naming the path if it cannot be opened.
  explicit MetricsWriter(const std::string& dir, bool append = false);

  void write(const StepMetrics& m);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// The JSON text of one line (no newline).
std::string metrics_json(const StepMetrics& m);

// "step 40/600 | loss 2.8312 | lr 3.00e-03 | gnorm 0.91 | 2,345 tok/s | 0.012 TFLOP/s |
//  load max/mean 1.42 | mem 210 MB", with "| val 2.9012" when val_loss is set.
std::string human_line(const StepMetrics& m, int64_t total_steps);

// 1234567 -> "1,234,567".
std::string thousands(int64_t v);

}  // namespace moetrain
