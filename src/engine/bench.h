// `moetrain bench`: times full training steps (forward, backward, optimizer) of the
// config's model on synthetic tokens, and reports tokens/s, TFLOP/s, MFU, peak memory and
// the time per stage. Under a launcher it runs the config's [parallel] layout like `train`
// (rank 0 reports: tokens over all ranks, MFU per rank). A benchmark, not a test: it
// asserts nothing.
#pragma once

#include <array>
#include <string>

#include "engine/run_config.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {

struct BenchOptions {
  int64_t warmup_steps = 2;
  int64_t steps = 5;
  double peak_tflops = 989.0;  // H100 SXM dense bf16
};

struct BenchReport {
  std::string device;
  // What the figures depend on besides the model: micro-batches, repeatability, the
  // experts' weight-gradient groups, the optimizer's state (one line, for the reader).
  std::string settings;
  int ranks = 1;                  // world size; tokens and TFLOP/s are over all ranks
  int rank = 0;                   // the rank that measured (rank 0 reports)
  int64_t parameters = 0, active_matmul_params = 0;
  int64_t tokens_per_step = 0;
  double flops_per_token = 0;
  double step_ms = 0;  // median of the timed steps
  double tokens_per_s = 0, tflops = 0, mfu = 0;
  int64_t peak_memory_bytes = 0;
  std::array<double, kNumStages> stage_ms{};  // per step, mean over the timed steps
  // With the pipeline executor (pp > 1: ranks hold different layers; ep_overlap's one-rank
  // pipelines: ranks wait differently for the exchange) on several ranks: every rank's
  // stage_ms, by world rank.
  std::vector<std::array<double, kNumStages>> stage_ms_by_rank;
  bool optimizer_overlapped = false;  // the step time had the optimizer on its own stream
  double peak_tflops = 0;
  std::string pipeline;    // pp > 1: the measured and the simulated bubble
  std::string exchange;  // ep > 1: the expert exchange's time and bytes per step, and how much compute hid
  std::string collectives;  // every kind of collective that ran: ms and bytes per step, share hidden
};

BenchReport run_bench(const RunConfig& cfg, const BenchOptions& opt);
std::string format_bench(const BenchReport& r);
// Two runs of one process side by side (`moetrain bench --training.fp8=true` measures BF16
// first, on the same card): step, tokens/s, MFU and every stage, with the second's speedup.
std::string format_bench_comparison(const BenchReport& base, const std::string& base_name, const BenchReport& other,
                                    const std::string& other_name);

}  // namespace moetrain
