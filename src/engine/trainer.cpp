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
#include "engine/data/byte_tokenizer.h"
#include "engine/data/loader.h"
#include "engine/data/text_corpus.h"
#include "engine/models/qwen3_moe.h"
#include "engine/optim/adamw.h"
#include "engine/optim/lr_schedule.h"
#include "engine/parallel/expert_dispatch.h"
#include "engine/telemetry/metrics.h"
#include "engine/telemetry/progress.h"
#include "engine/telemetry/stage_timer.h"
#include "ops/threads.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Mean cross-entropy over the validation set's first eval_batches micro-batches.
// The batch with its tensors on `device`.
Batch on_device(Batch b, Device device) {
  if (device.is_cpu()) return b;
  b.inputs = b.inputs.to(device);
  b.targets = b.targets.to(device);
  b.positions = b.positions.to(device);
  return b;
}

double validation_loss(Qwen3MoeModel& model, ExpertDispatcher& d, BatchLoader& val, int64_t batches, Device device) {
  val.reset();
  double sum = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < batches; ++i) {
    MicroBatchLoss l = model.forward_loss(on_device(val.next(), device), d);
    sum += l.ce_sum;
    n += l.targets;
  }
  return sum / static_cast<double>(std::max<int64_t>(n, 1));
}

// Samples `n` tokens after `prompt` at `temperature`, each from the logits of the last
// position over a window of at most seq_len tokens.
std::string sample_text(Qwen3MoeModel& model, ExpertDispatcher& d, const ByteTokenizer& tok, const std::string& prompt,
                        int64_t n, int64_t seq_len, double temperature, uint64_t seed, Device device) {
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids.push_back(tok.eos_id());
  Rng rng(seed);
  const int64_t V = model.config().vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t S = std::min<int64_t>(static_cast<int64_t>(ids.size()), seq_len);
    std::vector<int32_t> window(ids.end() - S, ids.end()), pos(S);
    for (int64_t j = 0; j < S; ++j) pos[j] = static_cast<int32_t>(j);
    Tensor logits = model.forward_logits(Tensor::from_vector(window, {S}).to(device),
                                         Tensor::from_vector(pos, {S}).to(device), {1, S}, d);
    std::vector<double> p = logits.slice(S - 1, S).to_double_vector();
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
  return tok.decode(ids);
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

StepResult train_step(Qwen3MoeModel& model, ExpertDispatcher& dispatcher, AdamW& opt, const std::vector<Batch>& batches,
                      double lr, double grad_clip) {
  ParameterList& params = model.parameters();
  int64_t targets = 0;
  for (const Batch& b : batches) targets += b.num_targets;
  MT_CHECK(targets > 0, "no token of the step's batches has a target");
  StepResult r;
  double ce = 0;
  const double n = static_cast<double>(batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    const Batch& b = batches[i];
    // The first micro-batch writes the gradients, the others add: no zeroing pass.
    MicroBatchLoss l = model.forward_backward(b, dispatcher, 1.0 / static_cast<double>(targets), 1.0 / n, i > 0);
    ce += l.ce_sum;
    r.aux_loss += (l.aux_loss + l.z_loss) / n;
    if (r.expert_counts.empty()) r.expert_counts = l.expert_counts;
    else {
      for (size_t i = 0; i < l.expert_counts.size(); ++i) {
        for (size_t e = 0; e < l.expert_counts[i].size(); ++e) r.expert_counts[i][e] += l.expert_counts[i][e];
      }
    }
  }
  r.loss = ce / static_cast<double>(targets);
  StageScope t(Stage::kOptimizer);
  MT_CHECK(std::isfinite(r.loss), "training loss is not finite ({})", r.loss);
  const GradNorm g = global_grad_norm(params, grad_clip);
  r.grad_norm = g.norm;
  opt.step(params, lr, g.clip_scale);
  return r;
}

TrainSummary train(const RunConfig& cfg_in) {
  RunConfig cfg = cfg_in;
  const auto run_start = Clock::now();
  const TrainingConfig& tc = cfg.training;
  ops::set_cpu_threads(static_cast<int>(tc.threads));

  // Data.
  ByteTokenizer tok;
  MT_CHECK(cfg.model.vocab_size >= tok.vocab_size(), "[model].vocab_size = {} is smaller than the {} tokenizer's {}",
           cfg.model.vocab_size, cfg.data.tokenizer, tok.vocab_size());
  Corpus corpus = load_text_corpus(cfg.data, tok, tc.seq_len + 1);
  const uint64_t seed = static_cast<uint64_t>(tc.seed);
  BatchLoader train_loader(std::move(corpus.train), tc.micro_batch_size, tc.seq_len, stream_key(seed, "data.train"),
                           BatchLoader::Mode::Random);
  BatchLoader val_loader(std::move(corpus.val), tc.micro_batch_size, tc.seq_len, stream_key(seed, "data.val"),
                         BatchLoader::Mode::Sequential);
  spdlog::info("data: {} train documents ({} tokens), {} validation documents ({} tokens)", corpus.train_documents,
               train_loader.num_tokens(), corpus.val_documents, val_loader.num_tokens());

  // Model, dispatcher, optimizer. On the GPU: bf16 weights and activations, f32 masters,
  // gradients and optimizer state.
  const bool gpu = tc.device == "cuda";
  MT_CHECK(!gpu || cuda::available(), "[training].device = \"cuda\" but no GPU is usable: {}",
           cuda::unavailable_reason());
  const Device device = gpu ? Device::cuda(0) : Device::cpu();
  Qwen3MoeModel model(cfg.model, gpu ? DType::BF16 : DType::F32, device);
  model.init_weights(seed);
  LocalDispatcher dispatcher;
  ParameterList& params = model.parameters();
  const OptimizerConfig& oc = cfg.optimizer;
  AdamW opt(params, {oc.beta1, oc.beta2, oc.eps, oc.weight_decay});
  LrSchedule schedule{oc.schedule, oc.lr, oc.min_lr, oc.warmup_steps, tc.steps, oc.decay_fraction};
  const int64_t tokens_per_step = tc.micro_batch_size * tc.seq_len * tc.grad_accum_steps;
  const double flops_per_token = model.flops_per_token(tc.seq_len);
  spdlog::info("model: qwen3_moe, {} layers, {} experts (top-{}), {:.2f}M parameters ({:.2f}M active in matmuls)",
               cfg.model.num_hidden_layers, cfg.model.num_experts, cfg.model.num_experts_per_tok,
               count_elements(params) / 1e6, model.active_matmul_params() / 1e6);
  spdlog::info("training: {} steps x {} tokens on {}", tc.steps, tokens_per_step,
               gpu ? cuda::device_name(0) + " (bf16)" : fmt::format("the CPU, {} threads (f32)", ops::cpu_threads()));

  // Checkpoints: resume from the newest committed one (or the one named), else take the
  // weights from init_from, else keep the seeded initialisation.
  const CheckpointConfig& cc = cfg.checkpoint;
  const std::string ckpt_dir = cc.resolved_dir(cfg.metrics.dir);
  const std::string resume_from = resolve_resume(ckpt_dir, cc.resume);
  int64_t start_step = 0;
  if (!resume_from.empty()) {
    const auto load_start = Clock::now();
    CheckpointReader reader(resume_from);
    const nlohmann::json& st = reader.trainer_state();
    MT_CHECK(st.contains("step") && st.contains("data") && st.contains("optimizer"),
             "checkpoint {}: trainer_state.json lacks step, data or optimizer: not a training checkpoint (use "
             "[checkpoint].init_from for weights only)",
             resume_from);
    load_model_weights(reader, params);
    load_optimizer_state(reader, params, opt);
    start_step = st["step"].get<int64_t>();
    opt.set_steps_taken(st["optimizer"]["steps_taken"].get<int64_t>());
    train_loader.set_position(st["data"]["train_position"].get<uint64_t>());
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
    load_model_weights(reader, params);
    spdlog::info("checkpoint: weights from {}{}", cc.init_from, reader.is_hf() ? " (Hugging Face folder)" : "");
  }
  const int64_t end_step =
      tc.stop_after_steps > 0 ? std::min(tc.steps, start_step + tc.stop_after_steps) : tc.steps;
  std::unique_ptr<Checkpointer> checkpointer;
  if (cc.every > 0 || cc.save_final) {
    const auto t0 = Clock::now();
    checkpointer = std::make_unique<Checkpointer>(ckpt_dir, cc.keep, cc.async);
    checkpointer->prepare(checkpoint_items(params, &opt));
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
    st["data"] = {{"train_position", train_loader.position()}, {"tokenizer", cfg.data.tokenizer}};
    st["seed"] = tc.seed;
    st["device"] = tc.device;
    st["model_dtype"] = std::string(dtype_name(params.front().value.dtype()));
    st["world_size"] = 1;
    st["moetrain_version"] = MOETRAIN_VERSION;
    st["config"] = cfg.to_toml();
    st["hf_config"] = nlohmann::json::parse(cfg.model.to_hf_json());
    return st;
  };

  // Metrics: a resumed run appends to the file it started.
  std::filesystem::create_directories(cfg.metrics.dir);
  {
    std::ofstream f(std::filesystem::path(cfg.metrics.dir) / "config.toml");
    f << cfg.to_toml();
  }
  MetricsWriter metrics(cfg.metrics.dir, /*append=*/start_step > 0);
  spdlog::info("metrics: {}/metrics.jsonl", cfg.metrics.dir);

  TrainSummary summary;
  summary.parameters = count_elements(params);
  summary.first_val_loss = validation_loss(model, dispatcher, val_loader, tc.eval_batches, device);
  summary.last_val_loss = summary.first_val_loss;
  spdlog::info("step {} | val loss {:.4f}", start_step, summary.first_val_loss);

  ProgressBar progress(end_step - start_step, cfg.metrics.progress);
  double train_seconds = 0;
  for (int64_t step = start_step; step < end_step; ++step) {
    const auto t0 = Clock::now();
    std::vector<Batch> batches;
    for (int64_t m = 0; m < tc.grad_accum_steps; ++m) batches.push_back(on_device(train_loader.next(), device));
    const double lr = schedule.at(step);
    StepResult r;
    try {
      r = train_step(model, dispatcher, opt, batches, lr, tc.grad_clip);
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
    m.expert_load_max_over_mean = expert_imbalance(r.expert_counts);
    m.peak_memory_bytes = gpu ? cuda::device_memory_stats().peak_bytes : host_memory_stats().peak_bytes;
    const bool last = step + 1 == tc.steps;
    if (last || (tc.eval_every > 0 && (step + 1) % tc.eval_every == 0)) {
      m.val_loss = validation_loss(model, dispatcher, val_loader, tc.eval_batches, device);
      summary.last_val_loss = *m.val_loss;
    }
    if (checkpointer && ((cc.every > 0 && (step + 1) % cc.every == 0) || (cc.save_final && step + 1 == end_step))) {
      const SaveStats st = checkpointer->save(step + 1, checkpoint_items(params, &opt), trainer_state(step + 1));
      m.checkpoint_stall_s = st.stall_s;
      spdlog::debug("checkpoint: step {} snapshot of {:.1f} MB, training waited {:.3f} s", step + 1, st.bytes / 1e6,
                    st.stall_s);
    }
    metrics.write(m);
    if (step == start_step) summary.first_train_loss = loss;
    summary.last_train_loss = loss;
    if (m.val_loss || m.checkpoint_stall_s || (step + 1) % cfg.metrics.log_every == 0 || step == start_step) {
      progress.clear();
      spdlog::info("{}", human_line(m, tc.steps));
    }
    progress.update(step + 1, fmt::format("loss {:.3f}", loss));
  }
  progress.finish();
  if (checkpointer) checkpointer->wait();  // the run ends with its last save committed
  summary.steps = end_step - start_step;
  summary.tokens_per_s = static_cast<double>(tokens_per_step * summary.steps) / std::max(train_seconds, 1e-9);
  if (tc.sample_tokens > 0) {
    summary.sample = sample_text(model, dispatcher, tok, tc.sample_prompt, tc.sample_tokens, tc.seq_len,
                                 tc.sample_temperature, stream_key(seed, "sample"), device);
  }
  summary.seconds = seconds_since(run_start);
  return summary;
}

}  // namespace moetrain
