#include "engine/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/log.h"
#include "core/timer.h"
#include "core/rng.h"
#include "engine/checkpoint/checkpoint_context.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/data/data_context.h"
#include "engine/data/loader.h"
#include "engine/ft/fault.h"
#include "engine/ft/heartbeat.h"
#include "engine/ft/preemption.h"
#include "engine/ft/replica_manager.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/optim/layerwise.h"
#include "engine/optim/lr_schedule.h"
#include "engine/parallel/expert_dispatch.h"
#include "engine/parallel/fsdp.h"
#include "engine/parallel/parallel_context.h"
#include "engine/parallel/replica_check.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/schedule.h"
#include "engine/telemetry/metrics.h"
#include "engine/telemetry/progress.h"
#include "engine/telemetry/prometheus.h"
#include "engine/telemetry/stage_timer.h"
#include "engine/telemetry/tensorboard.h"
#include "engine/train_context.h"
#include "ops/ops.h"
#include "ops/threads.h"

namespace moetrain {
namespace {

using Clock = SteadyClock;


// Mean cross-entropy over the validation set's first eval_batches micro-batches, summed
// over the data ranks (`group` of this replica group and the bridge across them, or one process).
double validation_loss(Model& model, ExpertDispatcher& d, DataLoader& val, int64_t batches, Device device,
                       Communicator* group = nullptr, ReplicaBridge* bridge = nullptr) {
  val.reset();
  std::vector<double> sums{0, 0};  // cross-entropy, targets
  for (int64_t i = 0; i < batches; ++i) {
    MicroBatchLoss l = model.forward_loss(val.next().to(device), d);
    sums[0] += l.ce_sum;
    sums[1] += static_cast<double>(l.targets);
  }
  sum_over_data(group, bridge, sums, device);
  return sums[0] / std::max(sums[1], 1.0);
}

// Samples `n` tokens after `prompt` at `temperature`, each from the logits of the last
// position over a window of at most seq_len tokens.
std::string sample_text(Model& model, ExpertDispatcher& d, const Tokenizer& tok, const std::string& prompt,
                        int64_t n, int64_t seq_len, double temperature, uint64_t seed, Device device) {
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids.push_back(tok.eos_id());
  Rng rng(seed);
  // Only ids the tokenizer has (a model's embedding is often padded beyond its vocabulary).
  const int64_t V = std::min<int64_t>(model.model_config().shape().vocab_size, tok.vocab_size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t S = std::min<int64_t>(static_cast<int64_t>(ids.size()), seq_len);
    std::vector<int32_t> window(ids.end() - S, ids.end()), pos(S);
    for (int64_t j = 0; j < S; ++j) pos[j] = static_cast<int32_t>(j);
    Tensor logits = model.forward_logits(Tensor::from_vector(window, {S}).to(device),
                                         Tensor::from_vector(pos, {S}).to(device), {1, S}, d);
    std::vector<double> p = logits.slice(S - 1, S).to_double_vector();
    p.resize(static_cast<size_t>(V));
    double mx = -1e300;
    for (auto& x : p) mx = std::max(mx, x /= temperature);
    double z = 0;
    for (auto& x : p) z += (x = std::exp(x - mx));
    double u = rng.uniform() * z;
    int32_t pick = static_cast<int32_t>(V - 1);
    for (int64_t v = 0; v < V; ++v) {
      if ((u -= p[v]) <= 0) {
        pick = static_cast<int32_t>(v);
        break;
      }
    }
    ids.push_back(pick);
  }
  // Token by token, so that an unused id (a gap in a vocabulary) prints as U+FFFD rather
  // than failing the run at its end.
  std::string text;
  for (const int32_t id : ids) {
    try {
      text += tok.decode(std::span<const int32_t>(&id, 1));
    } catch (const Error&) {
      text += "\xEF\xBF\xBD";
    }
  }
  return text;
}

}  // namespace

double expert_imbalance(const std::vector<std::vector<int64_t>>& counts) {
  double worst = 0;
  for (const auto& layer : counts) worst = std::max(worst, expert_load(layer).max_over_mean);
  return worst;
}

namespace {

// Per MoE layer of this rank, the tokens routed to every expert (global ids) summed over the
// data group: each rank puts its local experts' counts at their global index and the sum
// over ranks fills in the rest. `also_sum` rides in the same all-reduce (one collective), and
// so does the router entropy (per layer, summed in place).
std::vector<std::vector<int64_t>> global_expert_counts(const Model& model,
                                                       const std::vector<std::vector<int64_t>>& local,
                                                       std::vector<double>& entropy, Communicator& data_group,
                                                       ReplicaBridge* bridge, std::vector<double>& also_sum) {
  const int64_t E = model.model_config().shape().num_experts;
  const int64_t first = expert_range(E, model.placement().ep_size, model.placement().ep_rank).first;
  std::vector<double> sums = also_sum;
  sums.insert(sums.end(), entropy.begin(), entropy.end());
  const size_t base = sums.size();
  for (const auto& layer : local) {
    std::vector<double> global(static_cast<size_t>(E), 0.0);
    for (size_t e = 0; e < layer.size(); ++e) global[first + e] = static_cast<double>(layer[e]);
    sums.insert(sums.end(), global.begin(), global.end());
  }
  sum_over_data(&data_group, bridge, sums, model.device());
  std::copy(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(also_sum.size()), also_sum.begin());
  std::copy(sums.begin() + static_cast<std::ptrdiff_t>(also_sum.size()), sums.begin() + static_cast<std::ptrdiff_t>(base),
            entropy.begin());
  std::vector<std::vector<int64_t>> out(local.size(), std::vector<int64_t>(static_cast<size_t>(E)));
  for (size_t k = 0; k < local.size(); ++k) {
    for (int64_t e = 0; e < E; ++e) out[k][e] = std::llround(sums[base + k * E + e]);
  }
  return out;
}

// The targets of the step's micro-batches on all data ranks (the loss is their mean).
double global_targets(const std::vector<Batch>& batches, Communicator& data_group, ReplicaBridge* bridge,
                      Device device) {
  std::vector<double> targets{0};
  for (const Batch& b : batches) targets[0] += static_cast<double>(b.num_targets);
  sum_over_data(&data_group, bridge, targets, device);
  MT_CHECK(targets[0] > 0, "no token of the step's batches has a target on any rank");
  return targets[0];
}

// The end of a sharded step: gradients reduced, the global norm, then (if committed)
// AdamW on the shards.
void sharded_optimizer_step(FsdpContext& fsdp, StepResult& r, double lr, double grad_clip, const CommitFn& commit) {
  StageScope t(Stage::kOptimizer);
  MT_CHECK(std::isfinite(r.loss), "training loss is not finite ({})", r.loss);
  fsdp.reduce_scatter_grads();
  const GradNorm g = fsdp.grad_norm(grad_clip);
  r.grad_norm = g.norm;
  r.committed = !commit || commit();
  if (r.committed) fsdp.step(lr, g.clip_scale);
}

}  // namespace

LossTerms in_model_order(const Model& model, const LossTerms& have) {
  LossTerms out = model.loss_terms();
  for (LossTerm& t : out) {
    for (const LossTerm& h : have) {
      if (h.name == t.name) t.value = h.value;
    }
  }
  return out;
}

bool groups_expert_weight_grads(const Model& model, const FsdpContext* fsdp) {
  return model.expert_wgrad_group() > 1 && (fsdp == nullptr || fsdp->keeps_whole_grads());
}

namespace {

// A step's micro-batches see the same weights (the optimizer runs after them; the layerwise
// one updates a layer after its last use), so under FP8 each weight is quantized once a step,
// not once a micro-batch; not under ZeRO-3, whose gathers free and reuse the weights' memory.
class QuantizedWeightsKept {
 public:
  QuantizedWeightsKept(Model& model, const FsdpContext* fsdp)
      : model_(model), on_(fsdp == nullptr || fsdp->keeps_whole_grads()) {
    if (on_) model_.keep_quantized_weights(true);
  }
  ~QuantizedWeightsKept() {
    if (on_) model_.keep_quantized_weights(false);
  }
  QuantizedWeightsKept(const QuantizedWeightsKept&) = delete;
  QuantizedWeightsKept& operator=(const QuantizedWeightsKept&) = delete;

 private:
  Model& model_;
  bool on_;
};

// Forward and backward of a step's micro-batches, the gradients accumulated in the model.
// `targets`: of the whole step over all data ranks (the loss is their mean). Returns the
// cross-entropy sum in r.loss and the loss terms' means over the micro-batches in r.terms
// (this rank's: a term that is not global still needs its sum over the data ranks).
StepResult accumulate_micro_batches(Model& model, ExpertDispatcher& dispatcher,
                                    const std::vector<Batch>& batches, double targets,
                                    FsdpContext* fsdp = nullptr, LayerwiseOptimizer* layerwise = nullptr) {
  StepResult r;
  const double n = static_cast<double>(batches.size());
  const bool groups = groups_expert_weight_grads(model, fsdp);
  const QuantizedWeightsKept kept(model, fsdp);
  for (size_t i = 0; i < batches.size(); ++i) {
    // The first micro-batch writes the gradients, the others add: no zeroing pass.
    if (fsdp) fsdp->begin_micro_batch(i == 0, i + 1 == batches.size());
    if (layerwise && i + 1 == batches.size()) layerwise->begin_last_micro_batch();
    const bool accumulate = fsdp ? fsdp->model_accumulates(i) : i > 0;
    // Micro-batches in groups: the experts' weight gradients of a group's micro-batches are
    // made by its last, in one pass over f32 dW.
    const int64_t group = model.expert_wgrad_group();
    const bool defer = groups && static_cast<int64_t>(i + 1) % group != 0 && i + 1 < batches.size();
    MicroBatchLoss l = model.forward_backward(batches[i], dispatcher, 1.0 / targets, 1.0 / n, accumulate, defer);
    fault_point("micro_batch", -1);  // for the chaos tests: a fault between forward/backward passes (count, skip)
    r.loss += l.ce_sum;
    for (const LossTerm& t : l.terms) add_loss_term(r.terms, t, n);
    if (r.expert_counts.empty()) {
      r.expert_counts = l.expert_counts;
      r.router_entropy = l.router_entropy;
    } else {
      for (size_t k = 0; k < l.expert_counts.size(); ++k) {
        for (size_t e = 0; e < l.expert_counts[k].size(); ++e) r.expert_counts[k][e] += l.expert_counts[k][e];
        if (k < r.router_entropy.size() && k < l.router_entropy.size()) r.router_entropy[k] += l.router_entropy[k];
      }
    }
  }
  return r;
}

}  // namespace

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, LayerwiseOptimizer& opt,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit) {
  int64_t targets = 0;
  for (const Batch& b : batches) targets += b.num_targets;
  MT_CHECK(targets > 0, "no token of the step's batches has a target");
  StepResult r = accumulate_micro_batches(model, dispatcher, batches, static_cast<double>(targets), nullptr, &opt);
  r.loss /= static_cast<double>(targets);
  r.terms = in_model_order(model, r.terms);
  r.aux_loss = total_of(r.terms);
  StageScope t(Stage::kOptimizer);
  MT_CHECK(std::isfinite(r.loss), "training loss is not finite ({})", r.loss);
  if (commit && !commit()) {
    r.committed = false;
    r.grad_norm = opt.discard();
    return r;
  }
  const GradNorm g = opt.step(lr, grad_clip);
  r.grad_norm = g.norm;
  return r;
}

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, AdamW& opt, const std::vector<Batch>& batches,
                      double lr, double grad_clip, const CommitFn& commit) {
  LayerwiseOptimizer in_line(model, opt, LayerwiseConfig{.overlap = false});
  return train_step(model, dispatcher, in_line, batches, lr, grad_clip, commit);
}

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, FsdpContext& fsdp, Communicator& data_group,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit) {
  const Device device = model.parameters().front().grad.device();
  const std::vector<double> targets{global_targets(batches, data_group, fsdp.bridge(), device)};
  StepResult r = accumulate_micro_batches(model, dispatcher, batches, targets[0], &fsdp);
  r.terms = in_model_order(model, r.terms);
  // The cross-entropy and the terms that are rank shares sum over the data ranks (global
  // terms are the batch's already), in the one all-reduce that sums the expert counts.
  std::vector<double> sums{r.loss};
  for (const LossTerm& t : r.terms) {
    if (!t.global) sums.push_back(t.value);
  }
  r.expert_counts = global_expert_counts(model, r.expert_counts, r.router_entropy, data_group, fsdp.bridge(), sums);
  r.loss = sums[0] / targets[0];
  size_t at = 1;
  for (LossTerm& t : r.terms) {
    if (!t.global) t.value = sums[at++];
  }
  r.aux_loss = total_of(r.terms);
  sharded_optimizer_step(fsdp, r, lr, grad_clip, commit);
  return r;
}

namespace {

// Sums over `group` and the bridge a few doubles and takes the max of another (in place).
void sum_then_max(Communicator& group, ReplicaBridge* bridge, std::vector<double>& sums, double& max_value,
                  Device device) {
  sum_over_data(&group, bridge, sums, device);
  std::vector<double> most{max_value};
  all_reduce_doubles(group, most, device, ReduceOp::Max);
  if (bridge != nullptr) bridge->all_reduce_doubles(most, device, ReduceOp::Max);
  max_value = most[0];
}

// Validation through the pipeline: the head ranks hold the cross-entropy and the targets.
// `replica_world`: every rank of this replica group; the bridge crosses to the others.
double pipeline_validation_loss(PipelineExecutor& ex, const PipelineSchedule& forward, DataLoader& val,
                                Communicator& replica_world, ReplicaBridge* bridge, Device device) {
  val.reset();
  std::vector<Batch> batches;
  for (int m = 0; m < forward.micro_batches; ++m) batches.push_back(val.next().to(device));
  const PipelineExecutor::Result r = ex.forward(forward, batches);
  std::vector<double> sums{0, 0};
  if (r.has_head) {
    sums[0] = r.ce_sum;
    for (const Batch& b : batches) sums[1] += static_cast<double>(b.num_targets);
  }
  sum_over_data(&replica_world, bridge, sums, device);
  return sums[0] / std::max(sums[1], 1.0);
}

}  // namespace

StepResult train_step(PipelineExecutor& ex, const PipelineSchedule& schedule, Model& model,
                      FsdpContext& fsdp, Communicator& data_group, Communicator& replica_world,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit) {
  const Device device = model.device();
  const std::vector<double> targets{global_targets(batches, data_group, fsdp.bridge(), device)};
  const double n = static_cast<double>(batches.size());
  PipelineExecutor::Result pr = [&] {
    const QuantizedWeightsKept kept(model, &fsdp);
    return ex.train(schedule, batches, 1.0 / targets[0], 1.0 / n);
  }();
  // Only the ranks holding the head have losses; each data rank's head rank adds its share
  // (a global term is the batch's on each, so each adds 1 / data ranks of it). Every rank
  // sends the model's terms in its one order, zero where it has none.
  StepResult r;
  r.terms = in_model_order(model, pr.terms);
  std::vector<double> sums{pr.ce_sum};
  for (const LossTerm& t : r.terms) {
    const double data_ranks = static_cast<double>(data_group.size()) * (fsdp.bridge() ? fsdp.bridge()->replicas() : 1);
    sums.push_back(t.global ? t.value / n / data_ranks : t.value / n);
  }
  // Expert loads: this stage's layers over the data ranks; the imbalance of the worst layer
  // anywhere is the max over the world.
  std::vector<double> none;  // the losses sum over the world below, not the data group
  r.router_entropy = pr.router_entropy;
  r.expert_counts = global_expert_counts(model, pr.expert_counts, r.router_entropy, data_group, fsdp.bridge(), none);
  double imbalance = expert_imbalance(r.expert_counts);
  sum_then_max(replica_world, fsdp.bridge(), sums, imbalance, device);
  r.expert_imbalance = imbalance;
  r.loss = sums[0] / targets[0];
  for (size_t k = 0; k < r.terms.size(); ++k) r.terms[k].value = sums[k + 1];
  r.aux_loss = total_of(r.terms);
  sharded_optimizer_step(fsdp, r, lr, grad_clip, commit);
  return r;
}

namespace {

// A distributed run ends by checking that every data rank of a stage holds the same bits of
// the state they all hold copies of (parallel/replica_check.h); after the last checkpoint,
// so that a failure loses nothing.
// Under tensor parallelism the weights split over the tp ranks (heads, vocabulary rows) are
// copies only across the other data ranks (dp x cp x ep): checked there too.
void check_replicas(TrainContext& ctx) {
  Communicator* group = ctx.par.data_group();
  if (group == nullptr || group->size() < 2) return;
  const bool whole_weights = !ctx.fsdp || ctx.fsdp->keeps_whole_grads();
  auto check = [&](const std::vector<NamedTensor>& state, Communicator& ranks, const char* which) {
    const std::vector<std::string> differ = replicas_that_differ(state, ranks, ctx.par.device);
    MT_CHECK(differ.empty(),
             "{} of the {} tensors the {} hold copies of differ between them at the end of the run (first: {}): the "
             "ranks trained different models",
             differ.size(), state.size(), which, differ.empty() ? "" : differ.front());
    spdlog::info("replicas: {} replicated tensors{} bitwise equal on the {} {}", state.size(),
                 whole_weights ? "" : " (routing biases; the weights are sharded)", ranks.size(), which);
  };
  check(replicated_state(*ctx.model, whole_weights, ReplicaSet::kStage), *group, "data ranks");
  Communicator& pieces = *ctx.par.comms->shard_dense;
  if (ctx.par.layout.tp() > 1 && whole_weights && pieces.size() > 1) {
    check(replicated_state(*ctx.model, whole_weights, ReplicaSet::kTensorPieces), pieces,
          "ranks of each tensor-parallel piece");
  }
  const std::vector<NamedTensor> copies = replicated_state(*ctx.model, whole_weights, ReplicaSet::kTensorCopies);
  if (!copies.empty() && ctx.par.comms->tp && ctx.par.comms->tp->size() > 1) {
    check(copies, *ctx.par.comms->tp, "tp ranks of each expert-parallel coordinate (experts not folded)");
  }
}

// The text sampled at the end of the run (printed by rank 0), or empty.
std::string end_of_run_sample(const RunConfig& cfg, TrainContext& ctx, const Tokenizer& tok) {
  const TrainingConfig& tc = cfg.training;
  if (tc.sample_tokens <= 0) return "";
  if (ctx.pipeline || ctx.par.layout.tp() > 1) {
    spdlog::info("sample: skipped (token-by-token sampling runs the whole model in one process; under pipeline or "
                 "tensor parallelism convert the checkpoint and sample from it)");
    return "";
  }
  std::string text = sample_text(*ctx.model, *ctx.dispatcher, tok, tc.sample_prompt, tc.sample_tokens, tc.seq_len,
                                 tc.sample_temperature, stream_key(static_cast<uint64_t>(tc.seed), "sample"),
                                 ctx.par.device);
  return ctx.par.rank == 0 ? text : "";  // every rank samples (experts are spread), one prints
}

// "SIGTERM", "SIGUSR1", or "the signal" when another rank got it.
std::string signal_name_of(const PreemptionWatch& w) {
  const int sig = w.signal_received();
  return sig == 0 ? "the signal" : signal_name(sig);
}

// The step's micro-batches, on the model's device.
std::vector<Batch> next_batches(DataLoader& loader, const TrainingConfig& tc, Device device) {
  std::vector<Batch> batches;
  for (int64_t m = 0; m < tc.grad_accum_steps; ++m) batches.push_back(loader.next().to(device));
  return batches;
}

// Validation loss of the layout: through the pipeline, or the model's forward on each rank.
double validate(TrainContext& ctx, DataLoader& val, const TrainingConfig& tc) {
  const ParallelContext& par = ctx.par;
  if (ctx.pipeline) {
    return pipeline_validation_loss(*ctx.pipeline, *ctx.pipe_val, val, *par.comms->replica_world, par.bridge.get(),
                                    par.device);
  }
  return validation_loss(*ctx.model, *ctx.dispatcher, val, tc.eval_batches, par.device, par.data_group(),
                         par.bridge.get());
}

void log_run(const RunConfig& cfg, TrainContext& ctx) {
  const TrainingConfig& tc = cfg.training;
  const ParallelContext& par = ctx.par;
  const ModelShape shape = cfg.model->shape();
  spdlog::info("model: {}, {} layers, {} experts (top-{}), {:.2f}M parameters{} ({:.2f}M active in matmuls)",
               cfg.model->model_type, shape.num_layers, shape.num_experts, shape.experts_per_token,
               count_elements(ctx.model->parameters()) / 1e6, par.layout.ep() > 1 ? " on this rank" : "",
               ctx.model->active_matmul_params() / 1e6);
  spdlog::info("training: {} steps x {} tokens on {}{}", tc.steps, ctx.tokens_per_step(tc),
               tc.device == "cuda" ? cuda::device_name(par.device.index) + " (bf16)"
                                   : fmt::format("the CPU, {} threads (f32)", ops::cpu_threads()),
               par.distributed() ? fmt::format(", {} ranks", par.world) : "");
}

// Rank 0's record of the run: one metrics.jsonl line per step (appended to when resuming)
// and the human line every log_every steps, on validations, saves and the first step.
class RunLog {
 public:
  RunLog(const RunConfig& cfg, TrainContext& ctx, int64_t start_step, int64_t end_step)
      : cfg_(cfg),
        ctx_(ctx),
        tokens_per_step_(ctx.tokens_per_step(cfg.training)),
        flops_per_token_(ctx.model->flops_per_token(cfg.training.seq_len)),
        start_step_(start_step),
        progress_(end_step - start_step, cfg.metrics.progress && ctx.par.rank == 0) {
    if (ctx.par.rank != 0) return;
    std::filesystem::create_directories(cfg.metrics.dir);
    std::ofstream(std::filesystem::path(cfg.metrics.dir) / "config.toml") << RunConfig(cfg).to_toml();
    // Live fault tolerance: a restarted replica group starts at step 0 and heals, but its
    // record goes on in the same file.
    writer_ = std::make_unique<MetricsWriter>(cfg.metrics.dir,
                                              /*append=*/start_step > 0 || cfg.fault_tolerance.enabled());
    spdlog::info("metrics: {}/metrics.jsonl", cfg.metrics.dir);
    if (cfg.metrics.prometheus_port > 0) {
      prometheus_ = std::make_unique<PrometheusExporter>(cfg.metrics.prometheus_bind,
                                                         static_cast<int>(cfg.metrics.prometheus_port), cfg.metrics.dir);
      spdlog::info("metrics: Prometheus endpoint http://{}:{}/metrics", cfg.metrics.prometheus_bind, prometheus_->port());
    }
    if (cfg.metrics.tensorboard) {
      tensorboard_ = std::make_unique<TensorBoardWriter>((std::filesystem::path(cfg.metrics.dir) / "tb").string());
      spdlog::info("metrics: TensorBoard event file {}", tensorboard_->path());
    }
  }

  // The metrics of step `step` (1-based), from its result and wall time.
  StepMetrics of(const StepResult& r, int64_t step, double lr, double seconds) const {
    StepMetrics m;
    m.step = step;
    m.loss = r.loss;
    m.aux_loss = r.aux_loss;
    for (const LossTerm& t : r.terms) m.loss_terms.emplace_back(t.name, t.value);
    m.lr = lr;
    m.grad_norm = r.grad_norm;
    m.step_time_s = seconds;
    m.tokens = tokens_per_step_ * step;
    m.tokens_per_s = static_cast<double>(tokens_per_step_) / seconds;
    m.tflops = flops_per_token_ * m.tokens_per_s / 1e12;
    m.expert_load_max_over_mean = r.expert_imbalance >= 0 ? r.expert_imbalance : expert_imbalance(r.expert_counts);
    m.expert_tokens = r.expert_counts;
    if (regular_line(step)) m.router_bias = router_bias();
    // Mean entropy per token: each token made top-k selections, so a layer's counts add up to k x its tokens.
    const double k = static_cast<double>(ctx_.model->model_config().shape().experts_per_token);
    for (size_t i = 0; i < r.router_entropy.size() && i < r.expert_counts.size(); ++i) {
      double selections = 0;
      for (int64_t c : r.expert_counts[i]) selections += static_cast<double>(c);
      m.router_entropy.push_back(selections > 0 ? r.router_entropy[i] * k / selections : 0.0);
    }
    const bool cpu = ctx_.par.device.is_cpu();
    const MemoryStats host = cpu ? host_memory_stats() : MemoryStats{};
    const cuda::DeviceMemoryStats device = cpu ? cuda::DeviceMemoryStats{} : cuda::device_memory_stats();
    m.peak_memory_bytes = cpu ? host.peak_bytes : device.peak_bytes;
    m.live_memory_bytes = cpu ? host.live_bytes : device.live_bytes;
    m.reserved_memory_bytes = cpu ? m.live_memory_bytes : cuda::device_reserved_bytes();
    m.memory_growth_bytes = last_live_ < 0 ? 0 : m.live_memory_bytes - last_live_;
    last_live_ = m.live_memory_bytes;
    m.pinned_host_bytes = cuda::pinned_host_bytes();
    m.layout = ctx_.par.layout.mesh().str();
    m.restart_generation = ctx_.par.env.restart_generation;
    m.world_size = ctx_.par.world;
    // The first step this process commits (under live FT, after healing: later than
    // start_step + 1).
    if (first_step_ && ctx_.par.env.failure_at > 0) {
      m.restart_downtime_s = epoch_seconds() - seconds - ctx_.par.env.failure_at;
    }
    first_step_ = false;
    return m;
  }

  void write(const StepMetrics& m) {
    if (writer_) writer_->write(m);
    const std::vector<std::pair<std::string, double>> scalars =
        prometheus_ || tensorboard_ ? metrics_scalars(m) : std::vector<std::pair<std::string, double>>{};
    if (prometheus_) prometheus_->publish(m.step, scalars);
    if (tensorboard_) {
      tensorboard_->scalars(m.step, scalars);
      for (size_t i = 0; i < m.expert_tokens.size(); ++i) {
        const std::vector<double> tokens(m.expert_tokens[i].begin(), m.expert_tokens[i].end());
        tensorboard_->histogram(m.step, fmt::format("moe/layer{}/tokens_per_expert", i), tokens);
      }
    }
    if (m.val_loss || m.checkpoint_stall_s || regular_line(m.step)) {
      progress_.clear();
      spdlog::info("{}", human_line(m, cfg_.training.steps));
    }
    const std::string skewed = load_watch_.observe(m);
    if (!skewed.empty()) {
      progress_.clear();
      spdlog::warn("{}", skewed);
    }
    progress_.update(m.step, fmt::format("loss {:.3f}", m.loss));
  }
  void finish() { progress_.finish(); }

 private:
  // The steps of the human log line besides validations and saves: every log_every, the first.
  bool regular_line(int64_t step) const { return step % cfg_.metrics.log_every == 0 || step == start_step_ + 1; }
  // Each held routing bias's largest |b| and range (none without aux-loss-free balancing's
  // buffers).
  std::optional<StepMetrics::RouterBias> router_bias() const {
    std::optional<StepMetrics::RouterBias> out;
    for (const NamedBuffer& b : ctx_.model->buffers()) {
      if (b.name.find("e_score_correction_bias") == std::string::npos) continue;
      const std::vector<double> v = b.value.to_double_vector();
      if (v.empty()) continue;
      if (!out) out.emplace();
      double abs_max = 0, lo = v[0], hi = v[0];
      for (double x : v) {
        abs_max = std::max(abs_max, std::abs(x));
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      out->abs_max.push_back(abs_max);
      out->range.push_back(hi - lo);
    }
    return out;
  }

  const RunConfig& cfg_;
  TrainContext& ctx_;
  const int64_t tokens_per_step_;
  const double flops_per_token_;
  const int64_t start_step_;
  ProgressBar progress_;
  ExpertLoadWatch load_watch_;  // warns when a router stays collapsed
  std::unique_ptr<MetricsWriter> writer_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<PrometheusExporter> prometheus_;
  mutable int64_t last_live_ = -1;  // the live bytes at the previous step's end
  mutable bool first_step_ = true;  // of() not yet called
};

}  // namespace

namespace {

// Live fault tolerance: each replica group keeps its own metrics and checkpoints (any one
// of them can restart the run alone), in replica-<id> under the configured folders.
void separate_replica_folders(RunConfig& cfg) {
  const std::string sub = fmt::format("replica-{}", cfg.fault_tolerance.replica_id);
  cfg.metrics.dir = (std::filesystem::path(cfg.metrics.dir) / sub).string();
  if (!cfg.checkpoint.dir.empty()) cfg.checkpoint.dir = (std::filesystem::path(cfg.checkpoint.dir) / sub).string();
  if (!cfg.checkpoint.remote.empty()) cfg.checkpoint.remote += "/" + sub;
}

}  // namespace

TrainSummary train(const RunConfig& cfg_in) {
  RunConfig cfg = cfg_in;
  const auto run_start = Clock::now();
  const TrainingConfig& tc = cfg.training;
  ops::set_cpu_threads(static_cast<int>(tc.threads));
  ops::set_deterministic(tc.deterministic);
  // Ranks: rank 0 speaks for the job (logs, metrics, progress); the others only warn. A
  // world the layout does not fit (an elastic restart on fewer nodes) takes a fallback.
  cfg.parallel = cfg.parallel.for_world(LaunchEnv::from_environment().world_size);
  if (cfg.fault_tolerance.enabled()) separate_replica_folders(cfg);
  ParallelContext connected = ParallelContext::build(cfg);
  if (connected.rank != 0) spdlog::set_level(spdlog::level::warn);
  // Data: tokenizer and loaders of [data].kind (data/data_context.h); each data rank gets
  // its rows of the same global micro-batches (of every replica group's, under live FT).
  // Rows are cut over the dp x ep ranks; under context parallelism the cp ranks of a (dp, ep)
  // place take the same rows and each its zigzag chunks of them.
  const Layout& at = connected.layout;
  const DataShare share = replica_data_share(cfg.fault_tolerance, at.row_rank(), at.row_world());
  DataContext data = make_data_context(cfg, share.rank, share.world);
  if (at.cp() > 1) {
    data.train = std::make_unique<ZigzagLoader>(std::move(data.train), at.cp(), at.cp_rank(),
                                                cfg.model->shape().mtp_layers);  // (validation runs no module)
    data.val = std::make_unique<ZigzagLoader>(std::move(data.val), at.cp(), at.cp_rank());
    spdlog::info("context parallelism: cp {}, every sequence in {} chunks of {} tokens, cp rank r holding chunks r "
                 "and {} - r; {}",
                 at.cp(), 2 * at.cp(), tc.seq_len / (2 * at.cp()), 2 * at.cp() - 1,
                 "keys and values passed round the cp ranks (ring attention)");
  }
  if (at.tp() > 1) {  // every tp rank loads the same rows and counts the loss of its slice of them
    data.train = std::make_unique<TensorSliceLoader>(std::move(data.train), at.tp(), at.tp_rank());
    data.val = std::make_unique<TensorSliceLoader>(std::move(data.val), at.tp(), at.tp_rank());
    spdlog::info("tensor parallelism: tp {}, attention heads, dense MLP columns and the vocabulary split over the tp "
                 "ranks, each holding {} of a micro-batch's {} tokens between them (sequence parallelism); MoE "
                 "layers' experts over tp x ep = {} ranks",
                 at.tp(), tc.micro_batch_size * tc.seq_len / at.tp(), tc.micro_batch_size * tc.seq_len,
                 at.expert_ranks());
  }
  spdlog::info("data: {}", data.summary);
  // Model, dispatcher, optimizer, pipeline: train_context.h.
  std::unique_ptr<TrainContext> ctx = TrainContext::build(cfg, std::move(connected));
  log_run(cfg, *ctx);
  // Where the run starts (checkpoint_context.h), and the state it carries from step to step.
  CheckpointContext checkpoints(cfg, *ctx);
  TrainState state = checkpoints.restore();
  if (!state.data_position.is_null()) data.train->set_position(state.data_position);
  state.data_position = data.train->position();  // where a discarded step rewinds to
  const int64_t start_step = state.step;
  const int64_t end_step = tc.stop_after_steps > 0 ? std::min(tc.steps, start_step + tc.stop_after_steps) : tc.steps;
  const OptimizerConfig& oc = cfg.optimizer;
  const LrSchedule schedule{oc.schedule, oc.lr, oc.min_lr, oc.warmup_steps, tc.steps, oc.decay_fraction};
  RunLog log(cfg, *ctx, start_step, end_step);
  // Live fault tolerance (ft/replica_manager.h): a quorum before each step, a vote before
  // each optimizer step. Without it the hooks are empty and every step commits.
  std::unique_ptr<ReplicaManager> replicas;
  StepHooks hooks;
  int64_t discarded = 0;
  bool healed_to_end = false;
  if (cfg.fault_tolerance.enabled()) {
    replicas = std::make_unique<ReplicaManager>(cfg.fault_tolerance, *ctx);
    hooks.before_step = [&](TrainState& s) { replicas->begin_step(s, *data.train); };
    hooks.after_gradients = [&](const TrainState&) { return replicas->should_commit(); };
  }
  const PreemptionWatch preemption;  // SIGTERM / SIGUSR1: save and stop after the step (ft/preemption.h)
  Heartbeat heartbeat;               // for `moetrain launch --heartbeat-timeout` (ft/heartbeat.h)
  Communicator* world = ctx->par.comms ? ctx->par.comms->world.get() : nullptr;
  bool preempted = false;

  TrainSummary summary;
  summary.parameters = count_elements(ctx->model->parameters());
  summary.first_val_loss = summary.last_val_loss = validate(*ctx, *data.val, tc);
  spdlog::info("step {} | val loss {:.4f}", start_step, summary.first_val_loss);
  double train_seconds = 0;
  // [metrics].detailed: every collective timed by kind for the step's record.
  std::unique_ptr<CollectiveTimer> collectives;
  if (cfg.metrics.detailed && ctx->par.comms) collectives = std::make_unique<CollectiveTimer>(ctx->par.device);
  CollectiveTimer::activate(collectives.get());
  while (state.step < end_step) {
    if (hooks.before_step) hooks.before_step(state);
    if (state.step >= end_step) {  // healed from a replica group that ended the run: no step left
      replicas->vote_without_step(state);  // this round's vote, which the others wait for
      healed_to_end = true;
      break;
    }
    fault_point("step_begin", state.step + 1);
    heartbeat.beat();
    if (collectives) collectives->take();  // drops what a validation or a healing left
    const auto t0 = Clock::now();
    const std::vector<Batch> batches = next_batches(*data.train, tc, ctx->par.device);
    const double lr = schedule.at(state.step);
    StepResult r;
    try {
      r = ctx->step(batches, lr, tc.grad_clip, [&] { return hooks.commit(&state); });
    } catch (const Error& e) {
      MT_THROW("step {}: {}", state.step + 1, e.what());
    }
    const double dt = seconds_since(t0);
    train_seconds += dt;
    std::optional<std::array<CollectiveTotals, kNumCollectives>> step_collectives;
    if (collectives) step_collectives = collectives->take();
    if (!r.committed) {  // discarded: the same step again, on the same batches
      data.train->set_position(state.data_position);
      ++discarded;
      continue;
    }
    state.step += 1;
    state.optimizer_steps = ctx->optimizer().steps_taken();
    state.data_position = data.train->position();

    StepMetrics m = log.of(r, state.step, lr, dt);
    if (step_collectives) m.collectives = *step_collectives;
    if (replicas) {
      const ReplicaManager::StepReport& q = replicas->report();
      m.replicas = StepMetrics::Replicas{q.replicas, q.quorum_id, q.quorum_ms, q.recovered_from, q.heal_bytes,
                                         q.heal_s, discarded};
      discarded = 0;
    }
    if (state.step == tc.steps || (tc.eval_every > 0 && state.step % tc.eval_every == 0)) {
      m.val_loss = summary.last_val_loss = validate(*ctx, *data.val, tc);
      if (replicas && ctx->par.bridge->failed()) {  // a group died meanwhile: this group's share only
        spdlog::warn("step {}: validation lost a replica group midway; its loss is not recorded", state.step);
        m.val_loss.reset();
      }
    }
    preempted = preemption.stop_requested(world, ctx->par.device);
    m.checkpoint_stall_s = checkpoints.after_step(state, state.step == end_step, /*force=*/preempted);
    if (const std::optional<CommitStats> c = checkpoints.take_commit()) {
      m.checkpoint_commit = StepMetrics::Commit{c->step, c->seconds, c->bytes};
    }
    log.write(m);
    if (state.step == start_step + 1) summary.first_train_loss = r.loss;
    summary.last_train_loss = r.loss;
    if (preempted) {
      spdlog::warn("preempted (a rank got {}): step {} is saved; stopping", signal_name_of(preemption), state.step);
      break;
    }
  }
  if (replicas && !preempted) replicas->finish(state, *data.train);  // until every alive group has the last step
  if (healed_to_end) checkpoints.after_step(state, /*last=*/true);
  CollectiveTimer::activate(nullptr);
  log.finish();
  {  // the last step's optimizer updates may still run (optim/layerwise.h): count them as training
    const auto t0 = Clock::now();
    ctx->settle();
    if (!ctx->par.device.is_cpu()) cuda::stream_synchronize(cuda::current_stream());
    train_seconds += seconds_since(t0);
  }
  checkpoints.finish();  // the run ends with its last save committed
  if (!replicas) check_replicas(*ctx);  // (live fault tolerance heals replica groups from each other instead)
  summary.steps = state.step - start_step;
  summary.tokens_per_s =
      static_cast<double>(ctx->tokens_per_step(tc) * summary.steps) / std::max(train_seconds, 1e-9);
  if (!preempted) summary.sample = end_of_run_sample(cfg, *ctx, *data.tokenizer);
  summary.seconds = seconds_since(run_start);
  return summary;
}

}  // namespace moetrain
