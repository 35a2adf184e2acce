#include "engine/bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/log.h"
#include "core/rng.h"
#include "engine/data/loader.h"
#include "engine/parallel/all_gather_dispatch.h"
#include "engine/train_context.h"
#include "engine/trainer.h"
#include "ops/ops.h"
#include "ops/threads.h"

namespace moetrain {
namespace {

// The temporary FP8 switches the environment sets (docs/choices.md), named in the settings
// line so that a bench's figures say which kernels they timed.
std::string fp8_switches_set() {
  std::string out;
  for (const char* name : {"MOETRAIN_FP8_EXPERTS_WGRAD", "MOETRAIN_FP8_EXPERTS_BF16_DGRAD"}) {
    if (const char* v = std::getenv(name)) out += fmt::format(", {}={}", name, v);
  }
  return out;
}

// Uniform random tokens; targets are the next token of the same random stream. Under context
// parallelism this rank's zigzag chunks of them (the cp ranks of a place draw the same rows);
// under tensor parallelism the tp ranks draw the same rows and each marks its slice.
Batch synthetic_batch(int64_t batch, int64_t seq, int64_t vocab, Rng& rng, const Layout& layout, int64_t mtp_depth,
                      Device device) {
  std::vector<int32_t> ids(batch * seq + 1), pos(batch * seq);
  for (auto& t : ids) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  for (int64_t i = 0; i < batch * seq; ++i) pos[i] = static_cast<int32_t>(i % seq);
  Batch b;
  b.batch = batch;
  b.seq = seq;
  b.inputs = Tensor::from_vector(std::vector<int32_t>(ids.begin(), ids.end() - 1), {batch * seq});
  b.targets = Tensor::from_vector(std::vector<int32_t>(ids.begin() + 1, ids.end()), {batch * seq});
  b.positions = Tensor::from_vector(pos, {batch * seq});
  b.num_targets = batch * seq;
  if (layout.cp() > 1) {
    Tensor places;
    b = zigzag_batch(b, layout.cp(), layout.cp_rank(), &places, mtp_depth);
    b.places = std::move(places);
  }
  if (layout.tp() > 1) b = tensor_slice_batch(std::move(b), layout.tp(), layout.tp_rank());
  return b.to(device);
}

void wait_for(Device d) {
  if (!d.is_cpu()) cuda::device_synchronize();
}

}  // namespace

BenchReport run_bench(const RunConfig& cfg, const BenchOptions& opt) {
  const TrainingConfig& tc = cfg.training;
  const bool gpu = tc.device == "cuda";
  ops::set_cpu_threads(static_cast<int>(tc.threads));
  ops::set_deterministic(tc.deterministic);
  // The same ranks, model part, dispatcher, optimizer and pipeline as `train` (train_context.h).
  ParallelContext connected = ParallelContext::build(cfg);
  if (connected.rank != 0) spdlog::set_level(spdlog::level::warn);
  std::unique_ptr<TrainContext> ctx = TrainContext::build(cfg, std::move(connected));
  const ParallelContext& par = ctx->par;
  const Device device = par.device;
  Model& model = *ctx->model;
  const OptimizerConfig& oc = cfg.optimizer;
  // Every pipeline stage of a (dp, ep) place, and every cp rank of it, draws the same rows.
  Rng rng(stream_key(static_cast<uint64_t>(tc.seed), fmt::format("bench/{}", par.layout.row_rank())));
  auto step = [&](const std::vector<Batch>& bs) { ctx->step(bs, oc.lr, tc.grad_clip); };

  BenchReport r;
  r.device = gpu ? cuda::device_name(device.index) : "cpu";
  r.ranks = par.world;
  r.rank = par.rank;
  r.parameters = count_elements(model.parameters());
  r.active_matmul_params = model.active_matmul_params();
  r.tokens_per_step = ctx->tokens_per_step(tc);
  r.flops_per_token = model.flops_per_token(tc.seq_len);
  r.peak_tflops = opt.peak_tflops;
  r.settings = fmt::format("micro-batch {} x {}, {} a step; {}; {}{}AdamW moments {}{}", tc.micro_batch_size,
                           tc.seq_len, tc.grad_accum_steps,
                           tc.deterministic ? "bitwise repeatable" : "not bitwise repeatable",
                           tc.fp8 ? fmt::format("FP8 projections (block-scaled e4m3{}); ", fp8_switches_set()) : "",
                           tc.recompute == "none"          ? ""
                           : tc.recompute_layers.empty()  ? "full recomputation; "
                                                          : fmt::format("full recomputation of layers [{}]; ",
                                                                        fmt::join(tc.recompute_layers, ", ")),
                           oc.moments,
                           tc.grad_accum_steps > 1 && !ctx->pipeline && groups_expert_weight_grads(model, ctx->fsdp.get())
                               ? fmt::format("; expert weight gradients in groups of {}", model.expert_wgrad_group())
                               : "");

  auto batches = [&] {
    std::vector<Batch> bs;
    for (int64_t m = 0; m < tc.grad_accum_steps; ++m) {
      bs.push_back(synthetic_batch(tc.micro_batch_size, tc.seq_len, cfg.model->shape().vocab_size, rng, par.layout,
                                   cfg.model->shape().mtp_layers, device));
    }
    return bs;
  };
  for (int64_t i = 0; i < opt.warmup_steps; ++i) {
    step(batches());
    spdlog::info("bench: warm-up step {}/{}", i + 1, opt.warmup_steps);
  }
  // The timed steps' tokens are made (and copied to the device) before the clock starts.
  std::vector<std::vector<Batch>> timed_batches;
  for (int64_t i = 0; i < opt.steps; ++i) timed_batches.push_back(batches());

  // Timed steps: the wall time from one step's return to the next's (a step returns once its
  // backward and gradient norm are done, the host having read both), with no device-wide
  // wait in between: with the optimizer overlapped (optim/layerwise.h) a step's updates run
  // under the next one's forward, and that steady state is what a training run sees. Then
  // one extra pass with the stage timer on, since its events would perturb the timing.
  std::vector<double> ms;
  // Pipeline: each rank's compute time per op kind and wall time, summed over the timed
  // steps and the world (pipeline/executor.h Timing).
  std::vector<double> pipe(10, 0.0);  // step, busy, f ms, f n, b ms, b n, w ms, w n, h ms, h n
  if (ctx->pipeline) ctx->pipeline->set_timing(true);
  const bool exchanges = dynamic_cast<LocalDispatcher*>(ctx->dispatcher.get()) == nullptr;
  // Collectives by kind (telemetry/collective_timer.h): events around each, read after the steps.
  CollectiveTimer collectives(device);
  CollectiveTimer* run_timer = CollectiveTimer::active();  // the trainer's, if any
  CollectiveTimer::activate(&collectives);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < opt.steps; ++i) {
    step(timed_batches[static_cast<size_t>(i)]);
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    t0 = t1;
    spdlog::info("bench: step {}/{} {:.1f} ms", i + 1, opt.steps, ms.back());
    if (ctx->pipeline) {
      const PipelineExecutor::Timing& t = ctx->pipeline->last_timing();
      // A pair's time is an F and a B: split in the proportion of this step's lone F and B.
      const double f1 = t.f ? t.f_ms / t.f : 0, b1 = t.b ? t.b_ms / t.b : 0;
      const double fb_f = t.fb && f1 + b1 > 0 ? t.fb_ms * f1 / (f1 + b1) : 0.0;
      const double add[10] = {t.step_ms, t.busy_ms(), t.f_ms + fb_f, double(t.f + t.fb), t.b_ms + (t.fb_ms - fb_f),
                              double(t.b + t.fb), t.w_ms, double(t.w), t.h_ms, double(t.h)};
      for (int k = 0; k < 10; ++k) pipe[k] += add[k];
    }
  }
  CollectiveTimer::activate(run_timer);
  if (par.comms) {
    // Per kind: ms, exposed ms, count, bytes, summed over the world, then per rank and step.
    const std::array<CollectiveTotals, kNumCollectives> t = collectives.take();
    std::vector<double> sums;
    for (const CollectiveTotals& c : t) sums.insert(sums.end(), {c.ms, c.exposed_ms, double(c.count), c.bytes});
    all_reduce_doubles(*par.comms->world, sums, device);
    const double per_rank_step = static_cast<double>(par.world) * static_cast<double>(opt.steps);
    std::array<CollectiveTotals, kNumCollectives> world{};  // summed over the ranks
    for (int k = 0; k < kNumCollectives; ++k) {
      const double* s = &sums[static_cast<size_t>(4 * k)];
      world[static_cast<size_t>(k)] = {s[0], s[1], static_cast<int64_t>(s[2]), s[3]};
    }
    if (exchanges) {
      const CollectiveTotals &d = world[static_cast<int>(Collective::kDispatch)],
                             &c = world[static_cast<int>(Collective::kCombine)];
      const CollectiveTotals both{d.ms + c.ms, d.exposed_ms + c.exposed_ms, d.count + c.count, d.bytes + c.bytes};
      r.exchange = fmt::format(
          "{}: {:.2f} ms per step per rank in {:.0f} exchanges sending {:.1f} MB, {:.1f}% hidden behind compute "
          "({:.2f} ms stalled)",
          dynamic_cast<AllGatherDispatcher*>(ctx->dispatcher.get()) ? "all-gather" : "all-to-all",
          both.ms / per_rank_step, both.count / per_rank_step, both.bytes / per_rank_step / 1e6,
          both.ms > 0 ? 100.0 * both.hidden() : 0.0, both.exposed_ms / per_rank_step);
    }
    for (int k = 0; k < kNumCollectives; ++k) {
      const CollectiveTotals& t = world[static_cast<size_t>(k)];
      if (t.count == 0) continue;
      r.collectives += fmt::format("{}{} {:.2f} ms ({:.0f}% hidden, {:.1f} MB)", r.collectives.empty() ? "" : "; ",
                                   collective_name(static_cast<Collective>(k)), t.ms / per_rank_step,
                                   100.0 * t.hidden(), t.bytes / per_rank_step / 1e6);
    }
  }
  if (ctx->pipeline) {
    ctx->pipeline->set_timing(false);
    all_reduce_doubles(*par.comms->world, pipe, device);
    const double f = pipe[2] / std::max(pipe[3], 1.0), b = pipe[4] / std::max(pipe[5], 1.0),
                 w = pipe[6] / std::max(pipe[7], 1.0), h = pipe[8] / std::max(pipe[9], 1.0);
    const ScheduleTimes sim = simulate(*ctx->pipe_train, f, b, w, h);
    r.pipeline = fmt::format("{} over {} ranks, {} micro-batches: bubble measured {:.1f}% (idle / wall time over all "
                             "ranks), simulated {:.1f}% from the mean op times F {:.2f} / B {:.2f} / W {:.2f} ms{}",
                             ctx->pipe_train->name, ctx->pipe_train->pp, ctx->pipe_train->micro_batches,
                             100.0 * (1.0 - pipe[1] / std::max(pipe[0], 1e-9)), 100.0 * sim.bubble_fraction, f, b, w,
                             pipe[9] > 0 ? fmt::format(" / H {:.2f} ms (the head's rows on rank {})", h,
                                                       ctx->pipe_train->head_helper)
                                         : std::string());
  }
  wait_for(device);
  timed_batches.clear();
  std::sort(ms.begin(), ms.end());
  r.step_ms = ms[ms.size() / 2];
  r.tokens_per_s = static_cast<double>(r.tokens_per_step) / (r.step_ms / 1e3);
  r.tflops = r.tokens_per_s * r.flops_per_token / 1e12;
  r.mfu = r.tflops / (opt.peak_tflops * static_cast<double>(r.ranks));
  r.peak_memory_bytes = gpu ? cuda::device_memory_stats().peak_bytes : host_memory_stats().peak_bytes;

  // Stages: the optimizer in line (its events are on the current stream), so each stage's
  // time is its own; with the overlap on, the step above is shorter than their sum.
  const bool overlapped = ctx->optimizer_overlapping();
  if (overlapped) ctx->set_optimizer_overlap(false);
  StageTimer timer(device);
  StageTimer::activate(&timer);
  const int64_t staged = std::max<int64_t>(1, std::min<int64_t>(opt.steps, 3));
  for (int64_t i = 0; i < staged; ++i) step(batches());
  auto totals = timer.totals_ms();
  StageTimer::activate(nullptr);
  if (overlapped) ctx->set_optimizer_overlap(true);
  r.optimizer_overlapped = overlapped;
  for (int s = 0; s < kNumStages; ++s) r.stage_ms[s] = totals[s] / static_cast<double>(staged);
  if (ctx->pipeline && par.comms && par.world > 1) {  // each rank's row, summed into place over the world
    std::vector<double> rows(static_cast<size_t>(par.world * kNumStages), 0.0);
    for (int s = 0; s < kNumStages; ++s) rows[static_cast<size_t>(par.rank * kNumStages + s)] = r.stage_ms[s];
    all_reduce_doubles(*par.comms->world, rows, device);
    r.stage_ms_by_rank.resize(static_cast<size_t>(par.world));
    for (int k = 0; k < par.world; ++k) {
      for (int s = 0; s < kNumStages; ++s) r.stage_ms_by_rank[k][s] = rows[static_cast<size_t>(k * kNumStages + s)];
    }
  }
  return r;
}

std::string format_bench(const BenchReport& r) {
  std::string out;
  out += fmt::format("device            {}{}\n", r.device, r.ranks > 1 ? fmt::format(" x {} ranks", r.ranks) : "");
  if (!r.settings.empty()) out += fmt::format("settings          {}\n", r.settings);
  out += fmt::format("parameters        {:.1f} M{} ({:.1f} M active in matmuls)\n", r.parameters / 1e6,
                     r.ranks > 1 ? " on rank 0" : "", r.active_matmul_params / 1e6);
  out += fmt::format("tokens/step       {}\n", r.tokens_per_step);
  out += fmt::format("FLOPs/token       {:.3f} GFLOP (6 x active + attention)\n", r.flops_per_token / 1e9);
  out += fmt::format("step time         {:.1f} ms (median)\n", r.step_ms);
  out += fmt::format("tokens/s          {:.0f}\n", r.tokens_per_s);
  out += fmt::format("TFLOP/s           {:.1f}{}\n", r.tflops,
                     r.ranks > 1 ? fmt::format(" ({:.1f} per rank)", r.tflops / r.ranks) : "");
  out += fmt::format("MFU               {:.1f}% of {:.0f} TFLOP/s{}\n", 100 * r.mfu, r.peak_tflops,
                     r.ranks > 1 ? " per rank" : "");
  out += fmt::format("peak memory       {:.2f} GiB\n", r.peak_memory_bytes / 1073741824.0);
  if (!r.pipeline.empty()) out += fmt::format("pipeline          {}\n", r.pipeline);
  if (!r.exchange.empty()) out += fmt::format("expert exchange   {}\n", r.exchange);
  if (!r.collectives.empty()) out += fmt::format("collectives       per step per rank: {}\n", r.collectives);
  double total = 0;
  for (double v : r.stage_ms) total += v;
  out += "stage             ms/step   share\n";
  for (int s = 0; s < kNumStages; ++s) {
    out += fmt::format("  {:<15} {:>8.2f}  {:>5.1f}%\n", stage_name(static_cast<Stage>(s)), r.stage_ms[s],
                       total > 0 ? 100 * r.stage_ms[s] / total : 0.0);
  }
  out += fmt::format("  {:<15} {:>8.2f}  (with stage events{})\n", "total", total,
                     r.optimizer_overlapped ? "; optimizer in line here, under the next forward in the step time" : "");
  if (!r.stage_ms_by_rank.empty()) {  // each rank's stages (bench.h)
    out += fmt::format("{:<17}", "stage by rank");
    for (size_t k = 0; k < r.stage_ms_by_rank.size(); ++k) out += fmt::format(" {:>8}", fmt::format("rank {}", k));
    out += "\n";
    std::vector<double> sums(r.stage_ms_by_rank.size(), 0.0);
    for (int s = 0; s < kNumStages; ++s) {
      out += fmt::format("  {:<15}", stage_name(static_cast<Stage>(s)));
      for (size_t k = 0; k < r.stage_ms_by_rank.size(); ++k) {
        out += fmt::format(" {:>8.2f}", r.stage_ms_by_rank[k][s]);
        sums[k] += r.stage_ms_by_rank[k][s];
      }
      out += "\n";
    }
    out += fmt::format("  {:<15}", "total");
    for (double v : sums) out += fmt::format(" {:>8.2f}", v);
    out += "\n";
  }
  return out;
}

std::string format_bench_comparison(const BenchReport& base, const std::string& base_name, const BenchReport& other,
                                    const std::string& other_name) {
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  std::string out = fmt::format("{:<17} {:>10} {:>10} {:>8}\n", "comparison", base_name, other_name, "speedup");
  out += fmt::format("{:<17} {:>10.1f} {:>10.1f} {:>7.3f}x\n", "step time (ms)", base.step_ms, other.step_ms,
                     ratio(base.step_ms, other.step_ms));
  out += fmt::format("{:<17} {:>10.0f} {:>10.0f} {:>7.3f}x\n", "tokens/s", base.tokens_per_s, other.tokens_per_s,
                     ratio(other.tokens_per_s, base.tokens_per_s));
  out += fmt::format("{:<17} {:>9.1f}% {:>9.1f}%\n", "MFU", 100 * base.mfu, 100 * other.mfu);
  for (int s = 0; s < kNumStages; ++s) {
    out += fmt::format("  {:<15} {:>10.2f} {:>10.2f} {:>7.3f}x\n", stage_name(static_cast<Stage>(s)), base.stage_ms[s],
                       other.stage_ms[s], ratio(base.stage_ms[s], other.stage_ms[s]));
  }
  return out;
}

}  // namespace moetrain
