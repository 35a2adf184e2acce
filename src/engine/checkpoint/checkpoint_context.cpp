#include "engine/checkpoint/checkpoint_context.h"

#include <chrono>
#include <filesystem>

#include "core/log.h"
#include "core/timer.h"
#include "engine/ft/fault.h"

namespace moetrain {

CheckpointContext::CheckpointContext(const RunConfig& cfg, TrainContext& ctx)
    : cfg_(cfg), ctx_(ctx), dir_(cfg.checkpoint.resolved_dir(cfg.metrics.dir)) {
  const ParallelContext& par = ctx.par;
  resume_from_ = resolve_resume(dir_, cfg.checkpoint.resume, par.rank == 0);
  if (par.rank == 0 && !cfg.checkpoint.remote.empty()) fetch_remote();
  if (par.comms) par.comms->world->barrier();  // rank 0 removed stale partial saves before anyone saves
  // Every rank must resume from the same step: they read one shared folder (a node-local
  // folder per node is not supported yet), which is checked here in one tiny all-reduce.
  if (par.comms) {
    const auto all = Checkpointer::committed(dir_);
    const double newest = all.empty() ? -1.0 : static_cast<double>(all.back().first);
    std::vector<double> v{newest, -newest};
    all_reduce_doubles(*par.comms->world, v, par.device, ReduceOp::Max);
    MT_CHECK(v[0] == -v[1],
             "checkpoint: the ranks see different newest steps in {} ({} to {}): [checkpoint].dir must be one folder "
             "all ranks share", dir_, -v[1], v[0]);
  }
}

void CheckpointContext::fetch_remote() {
  const CheckpointConfig& cc = cfg_.checkpoint;
  try {
    RemoteTier tier(cc.remote, S3Options::from_env(cc.remote_endpoint), cc.remote_keep);
    const std::vector<int64_t> remote = tier.committed();
    remote_listed_ = true;
    remote_newest_ = remote.empty() ? -1 : remote.back();
    if (cc.resume != "auto") return;
    const auto local = Checkpointer::committed(dir_);
    const int64_t local_newest = local.empty() ? -1 : local.back().first;
    spdlog::info("checkpoint: newest committed step: {} locally ({}), {} on {}",
                 local_newest < 0 ? std::string("none") : std::to_string(local_newest), dir_,
                 remote_newest_ < 0 ? std::string("none") : std::to_string(remote_newest_), cc.remote);
    // The newest remote step newer than every local one, as on a fresh node; when its
    // download fails (checked against its marker), the one before it.
    for (auto it = remote.rbegin(); it != remote.rend() && *it > local_newest; ++it) {
      try {
        tier.download(*it, dir_);
        return;
      } catch (const std::exception& e) {
        spdlog::error("checkpoint: cannot download step {} from {}: {}", *it, cc.remote, e.what());
      }
    }
  } catch (const std::exception& e) {
    spdlog::error("checkpoint: the remote tier {} cannot be read ({}); resuming from the local tier only", cc.remote,
                  e.what());
  }
}

CheckpointItems CheckpointContext::items() {
  FsdpContext* fsdp = ctx_.fsdp.get();
  ParameterList& params = ctx_.model->parameters();
  // HSDP: another replica group writes. Live fault tolerance: every group keeps its own.
  if (fsdp && !fsdp->writes_checkpoint() && !cfg_.fault_tolerance.enabled()) return CheckpointItems{};
  // Tensor parallelism: what every tp rank holds whole (outside the split weights and the
  // experts) is saved by tp rank 0 alone.
  const Layout& at = ctx_.par.layout;
  std::vector<bool> tp_whole(params.size(), false);
  if (at.tp() > 1 && at.tp_rank() != 0) {
    for (const ParamBucket& b : ctx_.model->buckets()) {
      for (const ParamBucket::Member& m : b.members) tp_whole[m.param] = b.tp_replicated;
    }
  }
  CheckpointItems items = fsdp ? sharded_checkpoint_items(params, fsdp->shard_params(), fsdp->segments(),
                                                          ctx_.optimizer(),
                                                          [&](size_t param) { return !tp_whole[param]; })
                               : checkpoint_items(params, &ctx_.optimizer());
  // Buffers are whole on every data rank of a pipeline stage: the first writes them.
  if (at.data_rank() == 0 && at.tp_rank() == 0) {
    for (const NamedBuffer& b : ctx_.model->buffers()) items.model.push_back({b.name, b.value});
  }
  return items;
}

TrainState CheckpointContext::restore() {
  auto fresh = [&] {  // step 0, with the model's buffers as the state's live views
    TrainState s;
    s.buffers = ctx_.model->buffers();
    return s;
  };
  TrainState state = fresh();
  FsdpContext* fsdp = ctx_.fsdp.get();
  ParameterList& params = ctx_.model->parameters();
  AdamW& opt = ctx_.optimizer();
  // Many ranks load only their shards of the weights and optimizer state.
  auto load = [&](CheckpointReader& reader, bool optimizer_too) {
    if (fsdp) {
      // The weights are gathered (a collective) only once every rank has loaded: a rank that
      // finds a damaged file must not leave the others waiting in the gather.
      load_sharded_state(reader, params, fsdp->shard_params(), fsdp->segments(), optimizer_too ? &opt : nullptr);
    } else {
      load_model_weights(reader, params);
      if (optimizer_too) load_optimizer_state(reader, params, opt);
    }
    load_model_buffers(reader, state.buffers);
  };
  const CheckpointConfig& cc = cfg_.checkpoint;
  // The newest committed step first; when it turns out damaged on any rank (a checksum or
  // size that does not match its index), every rank falls back to the one before, and rank 0
  // moves the damaged one aside (damaged-step-N: kept, never loaded, never overwritten).
  std::vector<std::string> candidates;
  if (cc.resume == "auto") {
    const auto all = Checkpointer::committed(dir_);
    for (auto it = all.rbegin(); it != all.rend(); ++it) candidates.push_back(it->second);
  } else if (!resume_from_.empty()) {
    candidates.push_back(resume_from_);
  }
  Communicator* world = ctx_.par.comms ? ctx_.par.comms->world.get() : nullptr;
  resume_from_.clear();
  for (const std::string& candidate : candidates) {
    const auto load_start = SteadyClock::now();
    std::string damage;
    uint64_t bytes = 0;
    try {
      CheckpointReader reader(candidate);
      state.read_json(reader.trainer_state(), candidate);
      load(reader, true);
      bytes = reader.total_bytes();
    } catch (const Error& e) {
      damage = e.what();
    }
    std::vector<double> bad{damage.empty() ? 0.0 : 1.0};
    if (world != nullptr) all_reduce_doubles(*world, bad, ctx_.par.device);
    if (bad[0] > 0) {
      if (!damage.empty()) spdlog::error("checkpoint: cannot resume from {}: {}", candidate, damage);
      MT_CHECK(cc.resume == "auto", "checkpoint {} named by [checkpoint].resume cannot be loaded on {} rank(s){}",
               candidate, bad[0], damage.empty() ? "" : ": " + damage);
      if (ctx_.par.rank == 0) {
        const std::filesystem::path p(candidate);
        const std::filesystem::path aside = p.parent_path() / ("damaged-" + p.filename().string());
        std::filesystem::rename(p, aside);
        spdlog::warn("checkpoint: {} is damaged; moved to {} and resuming from the step before it", candidate,
                     aside.string());
      }
      if (world != nullptr) world->barrier();
      state = fresh();
      continue;
    }
    if (fsdp) fsdp->gather_values();
    resume_from_ = candidate;
    opt.set_steps_taken(state.optimizer_steps);
    MT_CHECK(state.step <= cfg_.training.steps, "checkpoint {} is at step {}, beyond [training].steps = {}",
             resume_from_, state.step, cfg_.training.steps);
    for (const auto& [s, path] : Checkpointer::committed(dir_)) {
      MT_CHECK(s <= state.step,
               "resuming from step {} ({}) would later collide with the committed {}: move it away or resume from it",
               state.step, resume_from_, path);
    }
    const double load_s = seconds_since(load_start);
    const double mb = static_cast<double>(bytes) / 1e6;
    spdlog::info("checkpoint: resumed from {} (step {}; {:.1f} MB read and verified in {:.2f} s, {:.0f} MB/s)",
                 resume_from_, state.step, mb, load_s, mb / std::max(load_s, 1e-9));
    break;
  }
  // Weights half loaded from a damaged step are no start: never train from them.
  MT_CHECK(candidates.empty() || !resume_from_.empty(),
           "checkpoint: none of the {} committed steps in {} could be loaded (each moved aside as damaged-step-N); "
           "nothing to resume from",
           candidates.size(), dir_);
  if (resume_from_.empty() && !cc.init_from.empty()) {
    CheckpointReader reader(cc.init_from);
    load(reader, false);
    if (fsdp) fsdp->gather_values();
    spdlog::info("checkpoint: weights from {}{}", cc.init_from, reader.is_hf() ? " (Hugging Face folder)" : "");
  }
  if (cc.every > 0 || cc.save_final) make_checkpointer();
  return state;
}

void CheckpointContext::make_checkpointer() {
  const CheckpointConfig& cc = cfg_.checkpoint;
  const auto t0 = SteadyClock::now();
  checkpointer_ = std::make_unique<Checkpointer>(dir_, cc.keep, cc.async, ctx_.par.rank, ctx_.par.world);
  if (ctx_.par.rank == 0 && !cc.remote.empty()) {
    S3Options opt = S3Options::from_env(cc.remote_endpoint);
    opt.part_size = cc.remote_part_mb << 20;
    uploader_ = std::make_unique<Uploader>(cc.remote, std::move(opt), cc.remote_keep, dir_);
    checkpointer_->set_on_commit([this](int64_t step, const std::string& dir) { uploader_->submit(step, dir); });
    // A step committed locally but not mirrored (the last run stopped first) goes up now.
    const auto local = Checkpointer::committed(dir_);
    if (!local.empty() && (!remote_listed_ || local.back().first > remote_newest_)) {
      uploader_->submit(local.back().first, local.back().second);
    }
    spdlog::info("checkpoint: mirroring committed steps to {} (keeping {})", cc.remote,
                 cc.remote_keep > 0 ? std::to_string(cc.remote_keep) : std::string("all"));
  }
  checkpointer_->prepare(items());
  const std::string when = cc.every > 0   ? fmt::format("every {} steps{}", cc.every, cc.save_final ? " and at the end" : "")
                           : cc.save_final ? std::string("at the end")
                                           : std::string("on preemption");
  spdlog::info("checkpoint: saving to {} ({}), host snapshot buffers ready in {:.2f} s", dir_, when,
               seconds_since(t0));
}

nlohmann::json CheckpointContext::trainer_state(const TrainState& state) const {
  const ParallelContext& par = ctx_.par;
  const TrainingConfig& tc = cfg_.training;
  nlohmann::json st;
  state.write_json(st);
  st["tokens"] = ctx_.tokens_per_step(tc) * state.step;
  st["optimizer"]["name"] = cfg_.optimizer.name;
  st["data"]["kind"] = cfg_.data.kind;
  st["data"]["tokenizer"] = cfg_.data.tokenizer;
  st["seed"] = tc.seed;
  st["device"] = tc.device;
  st["model_dtype"] = std::string(dtype_name(ctx_.model->parameters().front().value.dtype()));
  st["world_size"] = par.world;
  const ParallelConfig& pc = cfg_.parallel;
  const Layout& l = par.layout;
  st["parallel"] = {{"pp", l.pp()}, {"dp", l.size(MeshAxis::DP)}, {"cp", l.size(MeshAxis::CP)}, {"ep", l.ep()},
                    {"schedule", pc.schedule}, {"dp_replicate", pc.dp_replicate}};
  st["moetrain_version"] = MOETRAIN_VERSION;
  st["config"] = RunConfig(cfg_).to_toml();
  st["hf_config"] = nlohmann::json::parse(cfg_.model->to_hf_json());
  return st;
}

std::optional<double> CheckpointContext::after_step(const TrainState& state, bool last, bool force) {
  const CheckpointConfig& cc = cfg_.checkpoint;
  if (!force && (!checkpointer_ || !((cc.every > 0 && state.step % cc.every == 0) || (cc.save_final && last)))) {
    return std::nullopt;
  }
  if (!checkpointer_) make_checkpointer();
  // Slow or stalled storage must not hold training up: while the last save is still being
  // written on any rank, a regular save is skipped (the ranks agree, so none writes a step
  // the others do not); the run's last save and a preemption's wait for it.
  if (!force && !last) {
    std::vector<double> busy{checkpointer_->busy() ? 1.0 : 0.0};
    if (ctx_.par.comms) all_reduce_doubles(*ctx_.par.comms->world, busy, ctx_.par.device);
    if (busy[0] > 0) {
      spdlog::warn("checkpoint: step {} not saved: the previous save is still being written on {} rank(s) (slow "
                   "storage?); training goes on",
                   state.step, busy[0]);
      return std::nullopt;
    }
  }
  ctx_.settle();
  fault_point("save", state.step);
  // A save that fails (a full disk) costs that step's checkpoint, not the run: the error is
  // logged (by the writer, at once), the last committed step stays, training goes on and the
  // next save tries again. The run's last save and a preemption's rethrow it.
  try {
    checkpointer_->wait();  // idle here, except before a last or preemption save
  } catch (const std::exception&) {
    spdlog::warn("checkpoint: the save before step {} failed (above); training went on and saves again now",
                 state.step);
  }
  SaveStats st;
  try {
    st = checkpointer_->save(state.step, items(), trainer_state(state));
  } catch (const std::exception& e) {
    if (force || last) throw;
    spdlog::error("checkpoint: step {} was not committed: {}; the last committed step stays and training goes on",
                  state.step, e.what());
    return std::nullopt;
  }
  spdlog::debug("checkpoint: step {} snapshot of {:.1f} MB, training waited {:.3f} s", state.step, st.bytes / 1e6,
                st.stall_s);
  return st.stall_s;
}

void CheckpointContext::finish() {
  if (checkpointer_) checkpointer_->wait();
  if (uploader_ && !uploader_->drain(cfg_.checkpoint.remote_wait_s)) {
    spdlog::error("checkpoint: the last step is not mirrored to {} after {} s ([checkpoint].remote_wait_s); it is "
                  "committed locally in {} and goes up when a run resumes from this folder",
                  cfg_.checkpoint.remote, cfg_.checkpoint.remote_wait_s, dir_);
  }
}

}  // namespace moetrain
