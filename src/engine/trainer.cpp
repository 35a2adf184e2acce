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
#include "core/rng.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/data/data_context.h"
#include "engine/data/loader.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/optim/layerwise.h"
#include "engine/optim/lr_schedule.h"
#include "engine/parallel/expert_dispatch.h"
#include "engine/parallel/fsdp.h"
#include "engine/parallel/parallel_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/schedule.h"
#include "engine/telemetry/metrics.h"
#include "engine/telemetry/progress.h"
#include "engine/telemetry/stage_timer.h"
#include "engine/train_context.h"
#include "ops/ops.h"
#include "ops/threads.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The batch with its tensors on `device`.
Batch on_device(Batch b, Device device) {
  if (device.is_cpu()) return b;
  b.inputs = b.inputs.to(device);
  b.targets = b.targets.to(device);
  b.positions = b.positions.to(device);
  if (b.segment_ids.defined()) b.segment_ids = b.segment_ids.to(device);
  return b;
}

// Mean cross-entropy over the validation set's first eval_batches micro-batches, summed
// over the data ranks (`group`, or one process).
double validation_loss(Model& model, ExpertDispatcher& d, DataLoader& val, int64_t batches, Device device,
                       Communicator* group = nullptr) {
  val.reset();
  std::vector<double> sums{0, 0};  // cross-entropy, targets
  for (int64_t i = 0; i < batches; ++i) {
    MicroBatchLoss l = model.forward_loss(on_device(val.next(), device), d);
    sums[0] += l.ce_sum;
    sums[1] += static_cast<double>(l.targets);
  }
  if (group != nullptr) all_reduce_doubles(*group, sums, device);
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
  for (const auto& layer : counts) {
    int64_t total = 0, most = 0;
    for (int64_t c : layer) {
      total += c;
      most = std::max(most, c);
    }
    if (total > 0) worst = std::max(worst, static_cast<double>(most) * layer.size() / static_cast<double>(total));
  }
  return worst;
}

namespace {

// Per MoE layer of this rank, the tokens routed to every expert (global ids) summed over the
// data group: each rank puts its local experts' counts at their global index and the sum
// over ranks fills in the rest. `also_sum` rides in the same all-reduce (one collective).
std::vector<std::vector<int64_t>> global_expert_counts(const Model& model,
                                                       const std::vector<std::vector<int64_t>>& local,
                                                       Communicator& data_group, std::vector<double>& also_sum) {
  const int64_t E = model.model_config().shape().num_experts, first = model.placement().ep_rank * E / model.placement().ep_size;
  std::vector<double> sums = also_sum;
  const size_t base = also_sum.size();
  for (const auto& layer : local) {
    std::vector<double> global(static_cast<size_t>(E), 0.0);
    for (size_t e = 0; e < layer.size(); ++e) global[first + e] = static_cast<double>(layer[e]);
    sums.insert(sums.end(), global.begin(), global.end());
  }
  all_reduce_doubles(data_group, sums, model.device());
  std::copy(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(base), also_sum.begin());
  std::vector<std::vector<int64_t>> out(local.size(), std::vector<int64_t>(static_cast<size_t>(E)));
  for (size_t k = 0; k < local.size(); ++k) {
    for (int64_t e = 0; e < E; ++e) out[k][e] = std::llround(sums[base + k * E + e]);
  }
  return out;
}

// The targets of the step's micro-batches on all data ranks (the loss is their mean).
double global_targets(const std::vector<Batch>& batches, Communicator& data_group, Device device) {
  std::vector<double> targets{0};
  for (const Batch& b : batches) targets[0] += static_cast<double>(b.num_targets);
  all_reduce_doubles(data_group, targets, device);
  MT_CHECK(targets[0] > 0, "no token of the step's batches has a target on any rank");
  return targets[0];
}

// The end of a sharded step: gradients reduced, the global norm, AdamW on the shards.
void sharded_optimizer_step(FsdpContext& fsdp, StepResult& r, double lr, double grad_clip) {
  StageScope t(Stage::kOptimizer);
  MT_CHECK(std::isfinite(r.loss), "training loss is not finite ({})", r.loss);
  fsdp.reduce_scatter_grads();
  const GradNorm g = fsdp.grad_norm(grad_clip);
  r.grad_norm = g.norm;
  fsdp.step(lr, g.clip_scale);
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
  for (size_t i = 0; i < batches.size(); ++i) {
    // The first micro-batch writes the gradients, the others add: no zeroing pass.
    if (fsdp) fsdp->begin_micro_batch(i == 0);
    if (layerwise && i + 1 == batches.size()) layerwise->begin_last_micro_batch();
    const bool accumulate = fsdp ? fsdp->model_accumulates(i) : i > 0;
    // Micro-batches in groups: the experts' weight gradients of a group's micro-batches are
    // made by its last, in one pass over f32 dW.
    const int64_t group = model.expert_wgrad_group();
    const bool defer = groups && static_cast<int64_t>(i + 1) % group != 0 && i + 1 < batches.size();
    MicroBatchLoss l = model.forward_backward(batches[i], dispatcher, 1.0 / targets, 1.0 / n, accumulate, defer);
    r.loss += l.ce_sum;
    for (const LossTerm& t : l.terms) add_loss_term(r.terms, t, n);
    if (r.expert_counts.empty()) r.expert_counts = l.expert_counts;
    else {
      for (size_t k = 0; k < l.expert_counts.size(); ++k) {
        for (size_t e = 0; e < l.expert_counts[k].size(); ++e) r.expert_counts[k][e] += l.expert_counts[k][e];
      }
    }
  }
  return r;
}

}  // namespace

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, LayerwiseOptimizer& opt,
                      const std::vector<Batch>& batches, double lr, double grad_clip) {
  int64_t targets = 0;
  for (const Batch& b : batches) targets += b.num_targets;
  MT_CHECK(targets > 0, "no token of the step's batches has a target");
  StepResult r = accumulate_micro_batches(model, dispatcher, batches, static_cast<double>(targets), nullptr, &opt);
  r.loss /= static_cast<double>(targets);
  r.terms = in_model_order(model, r.terms);
  r.aux_loss = total_of(r.terms);
  StageScope t(Stage::kOptimizer);
  MT_CHECK(std::isfinite(r.loss), "training loss is not finite ({})", r.loss);
  const GradNorm g = opt.step(lr, grad_clip);
  r.grad_norm = g.norm;
  return r;
}

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, AdamW& opt, const std::vector<Batch>& batches,
                      double lr, double grad_clip) {
  LayerwiseOptimizer in_line(model, opt, LayerwiseConfig{.overlap = false});
  return train_step(model, dispatcher, in_line, batches, lr, grad_clip);
}

StepResult train_step(Model& model, ExpertDispatcher& dispatcher, FsdpContext& fsdp, Communicator& data_group,
                      const std::vector<Batch>& batches, double lr, double grad_clip) {
  const Device device = model.parameters().front().grad.device();
  const std::vector<double> targets{global_targets(batches, data_group, device)};
  StepResult r = accumulate_micro_batches(model, dispatcher, batches, targets[0], &fsdp);
  r.terms = in_model_order(model, r.terms);
  // The cross-entropy and the terms that are rank shares sum over the data ranks (global
  // terms are the batch's already), in the one all-reduce that sums the expert counts.
  std::vector<double> sums{r.loss};
  for (const LossTerm& t : r.terms) {
    if (!t.global) sums.push_back(t.value);
  }
  r.expert_counts = global_expert_counts(model, r.expert_counts, data_group, sums);
  r.loss = sums[0] / targets[0];
  size_t at = 1;
  for (LossTerm& t : r.terms) {
    if (!t.global) t.value = sums[at++];
  }
  r.aux_loss = total_of(r.terms);
  sharded_optimizer_step(fsdp, r, lr, grad_clip);
  return r;
}

namespace {

// Sums over `group` a few doubles and takes the max of the last one (in place).
void sum_then_max(Communicator& group, std::vector<double>& sums, double& max_value, Device device) {
  all_reduce_doubles(group, sums, device);
  Tensor m = Tensor::full({1}, max_value, DType::F64);
  if (group.backend() != "gloo" && !device.is_cpu()) m = m.to(device);
  group.all_reduce(m, ReduceOp::Max);
  max_value = m.item();
}

// Validation through the pipeline: the head ranks hold the cross-entropy and the targets.
double pipeline_validation_loss(PipelineExecutor& ex, const PipelineSchedule& forward, DataLoader& val,
                                Communicator& world, Device device) {
  val.reset();
  std::vector<Batch> batches;
  for (int m = 0; m < forward.micro_batches; ++m) batches.push_back(on_device(val.next(), device));
  const PipelineExecutor::Result r = ex.forward(forward, batches);
  std::vector<double> sums{0, 0};
  if (r.has_head) {
    sums[0] = r.ce_sum;
    for (const Batch& b : batches) sums[1] += static_cast<double>(b.num_targets);
  }
  all_reduce_doubles(world, sums, device);
  return sums[0] / std::max(sums[1], 1.0);
}

}  // namespace

StepResult train_step(PipelineExecutor& ex, const PipelineSchedule& schedule, const Model& model,
                      FsdpContext& fsdp, Communicator& data_group, Communicator& world,
                      const std::vector<Batch>& batches, double lr, double grad_clip) {
  const Device device = model.device();
  const std::vector<double> targets{global_targets(batches, data_group, device)};
  const double n = static_cast<double>(batches.size());
  PipelineExecutor::Result pr = ex.train(schedule, batches, 1.0 / targets[0], 1.0 / n);
  // Only the ranks holding the head have losses; each data rank's head rank adds its share
  // (a global term is the batch's on each, so each adds 1 / data ranks of it). Every rank
  // sends the model's terms in its one order, zero where it has none.
  StepResult r;
  r.terms = in_model_order(model, pr.terms);
  std::vector<double> sums{pr.ce_sum};
  for (const LossTerm& t : r.terms) {
    sums.push_back(t.global ? t.value / n / static_cast<double>(data_group.size()) : t.value / n);
  }
  // Expert loads: this stage's layers over the data ranks; the imbalance of the worst layer
  // anywhere is the max over the world.
  std::vector<double> none;  // the losses sum over the world below, not the data group
  r.expert_counts = global_expert_counts(model, pr.expert_counts, data_group, none);
  double imbalance = expert_imbalance(r.expert_counts);
  sum_then_max(world, sums, imbalance, device);
  r.expert_imbalance = imbalance;
  r.loss = sums[0] / targets[0];
  for (size_t k = 0; k < r.terms.size(); ++k) r.terms[k].value = sums[k + 1];
  r.aux_loss = total_of(r.terms);
  sharded_optimizer_step(fsdp, r, lr, grad_clip);
  return r;
}

TrainSummary train(const RunConfig& cfg_in) {
  RunConfig cfg = cfg_in;
  const auto run_start = Clock::now();
  const TrainingConfig& tc = cfg.training;
  ops::set_cpu_threads(static_cast<int>(tc.threads));
  ops::set_deterministic(tc.deterministic);
  // Ranks: rank 0 speaks for the job (logs, metrics, progress); the others only warn.
  ParallelContext connected = ParallelContext::build(cfg);
  if (connected.rank != 0) spdlog::set_level(spdlog::level::warn);

  // Data: tokenizer and loaders of [data].kind (data/data_context.h); each data rank gets
  // its rows of the same global micro-batches.
  DataContext data = make_data_context(cfg, connected.data_rank, connected.data_world);
  const Tokenizer& tok = *data.tokenizer;
  DataLoader& train_loader = *data.train;
  DataLoader& val_loader = *data.val;
  const uint64_t seed = static_cast<uint64_t>(tc.seed);
  spdlog::info("data: {}", data.summary);

  // Model, dispatcher, optimizer, pipeline: train_context.h.
  std::unique_ptr<TrainContext> ctx = TrainContext::build(cfg, std::move(connected));
  const ParallelContext& par = ctx->par;

  const bool gpu = tc.device == "cuda";
  const Device device = par.device;
  Model& model = *ctx->model;
  ExpertDispatcher& dispatcher = *ctx->dispatcher;
  FsdpContext* fsdp = ctx->fsdp.get();
  PipelineExecutor* pipeline = ctx->pipeline.get();
  ParameterList& params = model.parameters();
  AdamW& opt = ctx->optimizer();
  const OptimizerConfig& oc = cfg.optimizer;
  LrSchedule schedule{oc.schedule, oc.lr, oc.min_lr, oc.warmup_steps, tc.steps, oc.decay_fraction};
  const int64_t tokens_per_step = ctx->tokens_per_step(tc);
  const double flops_per_token = model.flops_per_token(tc.seq_len);
  const ModelShape shape = cfg.model->shape();
  spdlog::info("model: {}, {} layers, {} experts (top-{}), {:.2f}M parameters{} ({:.2f}M active in matmuls)",
               cfg.model->model_type, shape.num_layers, shape.num_experts, shape.experts_per_token,
               count_elements(params) / 1e6, par.ep > 1 ? " on this rank" : "", model.active_matmul_params() / 1e6);
  spdlog::info("training: {} steps x {} tokens on {}{}", tc.steps, tokens_per_step,
               gpu ? cuda::device_name(device.index) + " (bf16)"
                   : fmt::format("the CPU, {} threads (f32)", ops::cpu_threads()),
               par.distributed() ? fmt::format(", {} ranks", par.world) : "");

  // Checkpoints: resume from the newest committed one (or the one named), else take the
  // weights from init_from, else keep the seeded initialisation.
  const CheckpointConfig& cc = cfg.checkpoint;
  const std::string ckpt_dir = cc.resolved_dir(cfg.metrics.dir);
  const std::string resume_from = resolve_resume(ckpt_dir, cc.resume, par.rank == 0);
  if (par.comms) par.comms->world->barrier();  // rank 0 removed stale partial saves before anyone saves
  // Many ranks load and save only their shards of the weights and optimizer state.
  auto load_state = [&](CheckpointReader& reader, bool optimizer_too) {
    if (fsdp) {
      load_sharded_state(reader, params, fsdp->shard_params(), fsdp->segments(), optimizer_too ? &opt : nullptr);
      fsdp->gather_values();
    } else {
      load_model_weights(reader, params);
      if (optimizer_too) load_optimizer_state(reader, params, opt);
    }
  };
  auto checkpoint_state = [&] {
    if (fsdp && !fsdp->writes_checkpoint()) return CheckpointItems{};  // HSDP: another replica group writes
    return fsdp ? sharded_checkpoint_items(params, fsdp->shard_params(), fsdp->segments(), opt)
                : checkpoint_items(params, &opt);
  };
  int64_t start_step = 0;
  if (!resume_from.empty()) {
    const auto load_start = Clock::now();
    CheckpointReader reader(resume_from);
    const nlohmann::json& st = reader.trainer_state();
    MT_CHECK(st.contains("step") && st.contains("data") && st.contains("optimizer"),
             "checkpoint {}: trainer_state.json lacks step, data or optimizer: not a training checkpoint (use "
             "[checkpoint].init_from for weights only)",
             resume_from);
    load_state(reader, true);
    start_step = st["step"].get<int64_t>();
    opt.set_steps_taken(st["optimizer"]["steps_taken"].get<int64_t>());
    train_loader.set_position(st["data"]["train_position"]);
    MT_CHECK(start_step <= tc.steps, "checkpoint {} is at step {}, beyond [training].steps = {}", resume_from,
             start_step, tc.steps);
    for (const auto& [s, path] : Checkpointer::committed(ckpt_dir)) {
      MT_CHECK(s <= start_step,
               "resuming from step {} ({}) would later collide with the committed {}: move it away or resume from it",
               start_step, resume_from, path);
    }
    const double load_s = seconds_since(load_start);
    const double mb = static_cast<double>(reader.total_bytes()) / 1e6;
    spdlog::info("checkpoint: resumed from {} (step {}; {:.1f} MB read and verified in {:.2f} s, {:.0f} MB/s)",
                 resume_from, start_step, mb, load_s, mb / std::max(load_s, 1e-9));
  } else if (!cc.init_from.empty()) {
    CheckpointReader reader(cc.init_from);
    load_state(reader, false);
    spdlog::info("checkpoint: weights from {}{}", cc.init_from, reader.is_hf() ? " (Hugging Face folder)" : "");
  }
  const int64_t end_step =
      tc.stop_after_steps > 0 ? std::min(tc.steps, start_step + tc.stop_after_steps) : tc.steps;
  std::unique_ptr<Checkpointer> checkpointer;
  if (cc.every > 0 || cc.save_final) {
    const auto t0 = Clock::now();
    checkpointer = std::make_unique<Checkpointer>(ckpt_dir, cc.keep, cc.async, par.rank, par.world);
    checkpointer->prepare(checkpoint_state());
    const std::string when = cc.every > 0 ? fmt::format("every {} steps{}", cc.every, cc.save_final ? " and at the end" : "")
                                          : std::string("at the end");
    spdlog::info("checkpoint: saving to {} ({}), host snapshot buffers ready in {:.2f} s", ckpt_dir, when,
                 seconds_since(t0));
  }
  auto trainer_state = [&](int64_t step) {
    nlohmann::json st;
    st["step"] = step;
    st["tokens"] = tokens_per_step * step;
    st["optimizer"] = {{"name", oc.name}, {"steps_taken", opt.steps_taken()}};
    st["data"] = {
        {"train_position", train_loader.position()}, {"kind", cfg.data.kind}, {"tokenizer", cfg.data.tokenizer}};
    st["seed"] = tc.seed;
    st["device"] = tc.device;
    st["model_dtype"] = std::string(dtype_name(params.front().value.dtype()));
    st["world_size"] = par.world;
    st["parallel"] = {{"pp", cfg.parallel.pp}, {"dp", par.world / (cfg.parallel.pp * cfg.parallel.cp * par.ep)},
                      {"cp", cfg.parallel.cp}, {"ep", par.ep}, {"schedule", cfg.parallel.schedule},
                      {"dp_replicate", cfg.parallel.dp_replicate}};
    st["moetrain_version"] = MOETRAIN_VERSION;
    st["config"] = cfg.to_toml();
    st["hf_config"] = nlohmann::json::parse(cfg.model->to_hf_json());
    return st;
  };

  // Metrics (rank 0): a resumed run appends to the file it started.
  std::unique_ptr<MetricsWriter> metrics;
  if (par.rank == 0) {
    std::filesystem::create_directories(cfg.metrics.dir);
    std::ofstream f(std::filesystem::path(cfg.metrics.dir) / "config.toml");
    f << cfg.to_toml();
    metrics = std::make_unique<MetricsWriter>(cfg.metrics.dir, /*append=*/start_step > 0);
    spdlog::info("metrics: {}/metrics.jsonl", cfg.metrics.dir);
  }
  auto validate = [&] {
    if (pipeline) return pipeline_validation_loss(*pipeline, *ctx->pipe_val, val_loader, *par.comms->world, device);
    return validation_loss(model, dispatcher, val_loader, tc.eval_batches, device, par.data_group());
  };

  TrainSummary summary;
  summary.parameters = count_elements(params);
  summary.first_val_loss = validate();
  summary.last_val_loss = summary.first_val_loss;
  spdlog::info("step {} | val loss {:.4f}", start_step, summary.first_val_loss);

  ProgressBar progress(end_step - start_step, cfg.metrics.progress && par.rank == 0);
  double train_seconds = 0;
  for (int64_t step = start_step; step < end_step; ++step) {
    const auto t0 = Clock::now();
    std::vector<Batch> batches;
    for (int64_t m = 0; m < tc.grad_accum_steps; ++m) {
      batches.push_back(on_device(train_loader.next(), device));
    }
    const double lr = schedule.at(step);
    StepResult r;
    try {
      r = ctx->step(batches, lr, tc.grad_clip);
    } catch (const Error& e) {
      MT_THROW("step {}: {}", step + 1, e.what());
    }
    const double loss = r.loss;
    const double dt = seconds_since(t0);
    train_seconds += dt;

    StepMetrics m;
    m.step = step + 1;
    m.loss = loss;
    m.aux_loss = r.aux_loss;
    m.lr = lr;
    m.grad_norm = r.grad_norm;
    m.step_time_s = dt;
    m.tokens = tokens_per_step * (step + 1);
    m.tokens_per_s = static_cast<double>(tokens_per_step) / dt;
    m.tflops = flops_per_token * m.tokens_per_s / 1e12;
    m.expert_load_max_over_mean = r.expert_imbalance >= 0 ? r.expert_imbalance : expert_imbalance(r.expert_counts);
    m.peak_memory_bytes = gpu ? cuda::device_memory_stats().peak_bytes : host_memory_stats().peak_bytes;
    const bool last = step + 1 == tc.steps;
    if (last || (tc.eval_every > 0 && (step + 1) % tc.eval_every == 0)) {
      m.val_loss = validate();
      summary.last_val_loss = *m.val_loss;
    }
    if (checkpointer && ((cc.every > 0 && (step + 1) % cc.every == 0) || (cc.save_final && step + 1 == end_step))) {
      ctx->settle();
      const SaveStats st = checkpointer->save(step + 1, checkpoint_state(), trainer_state(step + 1));
      m.checkpoint_stall_s = st.stall_s;
      spdlog::debug("checkpoint: step {} snapshot of {:.1f} MB, training waited {:.3f} s", step + 1, st.bytes / 1e6,
                    st.stall_s);
    }
    if (metrics) metrics->write(m);
    if (step == start_step) summary.first_train_loss = loss;
    summary.last_train_loss = loss;
    if (m.val_loss || m.checkpoint_stall_s || (step + 1) % cfg.metrics.log_every == 0 || step == start_step) {
      progress.clear();
      spdlog::info("{}", human_line(m, tc.steps));
    }
    progress.update(step + 1, fmt::format("loss {:.3f}", loss));
  }
  progress.finish();
  {  // the last step's optimizer updates may still run (optim/layerwise.h): count them as training
    const auto t0 = Clock::now();
    ctx->settle();
    if (gpu) cuda::stream_synchronize(cuda::current_stream());
    train_seconds += seconds_since(t0);
  }
  if (checkpointer) checkpointer->wait();  // the run ends with its last save committed
  summary.steps = end_step - start_step;
  summary.tokens_per_s = static_cast<double>(tokens_per_step * summary.steps) / std::max(train_seconds, 1e-9);
  if (tc.sample_tokens > 0 && pipeline) {
    spdlog::info("sample: skipped (token-by-token sampling runs the whole model in one process; under pipeline "
                 "parallelism convert the checkpoint and sample from it)");
  } else if (tc.sample_tokens > 0) {
    summary.sample = sample_text(model, dispatcher, tok, tc.sample_prompt, tc.sample_tokens, tc.seq_len,
                                 tc.sample_temperature, stream_key(seed, "sample"), device);
    if (par.rank != 0) summary.sample.clear();  // every rank samples (experts are spread), one prints
  }
  summary.seconds = seconds_since(run_start);
  return summary;
}

}  // namespace moetrain
