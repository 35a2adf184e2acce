#include "engine/parallel/fsdp.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/log.h"
#include "engine/telemetry/collective_timer.h"
#include "engine/telemetry/stage_timer.h"
#include "ops/ops.h"

namespace moetrain {

FsdpContext::FsdpContext(Model& model, Communicator& dense_group, Communicator& expert_group,
                         Communicator& replica_world, AdamWConfig adamw, bool shard_weights, ReplicaBridge* bridge,
                         Communicator* tp_group)
    : model_(model),
      replica_world_(replica_world),
      bridge_(bridge),
      tp_group_(tp_group != nullptr && tp_group->size() > 1 ? tp_group : nullptr),
      shard_weights_(shard_weights),
      opt_(ParameterList{}, adamw) {
  ParameterList& params = model.parameters();
  std::vector<Tensor> full_lows;  // kept alive until the shards have their copies
  shards_.reserve(model.buckets().size());
  // ZeRO-3 drops the whole gradients (nothing in them yet: a backward restores them) before
  // making the shards, and each bucket's whole weights once its shard has its copy, so that
  // the start holds the shards beside one bucket's whole weights, not beside the whole model's
  // weights and gradients (docs/memory.md: the start-up peak).
  if (shard_weights) {
    for (ParamBucket& b : model.buckets()) b.grads.release_memory();
  }
  for (ParamBucket& b : model.buckets()) units_.push_back(b.layer);
  std::sort(units_.begin(), units_.end());
  units_.erase(std::unique(units_.begin(), units_.end()), units_.end());
  updates_.resize(units_.size());
  for (ParamBucket& b : model.buckets()) {
    UnitUpdate& u = updates_[static_cast<size_t>(std::lower_bound(units_.begin(), units_.end(), b.layer) - units_.begin())];
    Communicator& g = b.experts ? expert_group : dense_group;
    const int64_t n = g.size();
    MT_CHECK(b.values.numel() % n == 0, "bucket {} holds {} elements, not a multiple of its group {}'s {} ranks",
             b.name, b.values.numel(), g.name(), n);
    Shard sh{&b, &g, b.values.numel() / n, Tensor(), Tensor(), Tensor()};
    u.gathers = u.gathers || n > 1;
    const int64_t lo = sh.lo(), hi = lo + sh.size;
    // A group of one reduces nothing: without shard_weights its shard is the bucket's own
    // gradient; with them the bucket's gradient is one micro-batch's and the shard sums them.
    sh.grad = n == 1 && !shard_weights ? b.grads : Tensor::zeros({sh.size}, b.grads.dtype(), b.grads.device());
    sh.value = shard_weights ? b.values.slice(lo, hi).clone() : b.values.slice(lo, hi);
    if (shard_weights) b.values.release_memory();  // gathered again on use
    if (shard_weights || n > 1) sh.scratch = Tensor::zeros({sh.size}, b.grads.dtype(), b.grads.device());
    for (const ParamBucket::Member& m : b.members) {
      const Parameter& p = params[m.param];
      const int64_t begin = std::max(lo, m.offset), end = std::min(hi, m.offset + p.value.numel());
      if (begin >= end) continue;
      segments_.push_back({m.param, begin - m.offset, end - m.offset});
      Parameter s;
      s.name = p.name;
      s.value = sh.value.slice(begin - lo, end - lo);
      s.grad = sh.grad.slice(begin - lo, end - lo);
      s.weight_decay = p.weight_decay;
      s.init_std = p.init_std;
      if (p.has_master()) {
        full_lows.push_back(p.master_low);
        s.master_low = p.master_low.view({p.master_low.numel()}).slice(begin - m.offset, end - m.offset);
      }
      u.params.push_back(shard_params_.size());
      shard_params_.push_back(std::move(s));
      tp_whole_.push_back(tp_group_ != nullptr && b.tp_replicated);
    }
    shards_.push_back(sh);
  }
  // The masters of the shards (their low halves; the high halves are the shard values),
  // flat in segment order (the optimizer's whole-list ops coalesce runs that lie back to
  // back), copied from the model's, which the model then drops: only the shards keep masters.
  std::vector<Tensor> sources;
  for (const Parameter& s : shard_params_) {
    if (s.has_master()) sources.push_back(s.master_low);
  }
  std::vector<Tensor> own = flat_views(sources, DType::I16);
  size_t i = 0;
  for (Parameter& s : shard_params_) {
    if (!s.has_master()) continue;
    own[i].copy_from(s.master_low);
    s.master_low = own[i++];
  }
  for (Parameter& p : params) p.master_low = Tensor();
  opt_ = AdamW(shard_params_, adamw);
  if (shard_weights_) {
    for (Shard& sh : shards_) release(sh);
    const bool nccl = dense_group.backend() == "nccl";
    if (nccl && !model.device().is_cpu()) {
      make_comm_stream();
      for (Shard& sh : shards_) sh.ready = cuda::create_sync_event();
    }
    model.set_weight_hooks(this);
  }
}

FsdpContext::~FsdpContext() {
  if (model_.weight_hooks() == this) model_.set_weight_hooks(nullptr);
  if (comm_stream_) {
    try {
      cuda::stream_synchronize(comm_stream_);
      for (Shard& sh : shards_) {
        if (sh.ready) cuda::destroy_event(sh.ready);
      }
      for (UnitUpdate& u : updates_) {
        if (u.done) cuda::destroy_event(u.done);
      }
      cuda::destroy_event(compute_point_);
      cuda::destroy_stream(comm_stream_);
    } catch (const std::exception& e) {
      spdlog::error("FsdpContext: releasing the communication stream: {}", e.what());
    }
  }
}

void FsdpContext::make_comm_stream() {
  if (comm_stream_) return;
  comm_stream_ = cuda::create_stream();
  compute_point_ = cuda::create_sync_event();
}

bool FsdpContext::set_overlap(bool on) {
  drain();
  bool can = !shard_weights_ && tp_group_ == nullptr && (bridge_ == nullptr || !bridge_->crosses()) &&
             !model_.device().is_cpu();
  for (const Shard& sh : shards_) can = can && (sh.group->size() == 1 || sh.group->backend() == "nccl");
  overlap_ = on && can;
  if (overlap_) {
    MT_CHECK(model_.weight_hooks() == nullptr || model_.weight_hooks() == this,
             "FSDP overlap: the model already has other weight hooks");
    for (const Shard& sh : shards_) {  // in bucket order: the same on every rank of a group
      if (sh.group->size() > 1 && !overlap_groups_.count(sh.group)) {
        overlap_groups_[sh.group] = sh.group->split(0, sh.group->rank(), "overlap");
      }
    }
    make_comm_stream();
    for (UnitUpdate& u : updates_) {
      if (!u.done) u.done = cuda::create_sync_event();
    }
    model_.set_weight_hooks(this);
  } else if (!shard_weights_ && model_.weight_hooks() == this) {
    model_.set_weight_hooks(nullptr);
  }
  return overlap_;
}

void FsdpContext::drain() {
  bool any = false;
  for (UnitUpdate& u : updates_) {
    any = any || u.pending;
    u.pending = false;
  }
  if (!any) return;
  cuda::record_event(compute_point_, comm_stream_);
  cuda::stream_wait_event(cuda::current_stream(), compute_point_);
}

void FsdpContext::wait_for_update(int64_t layer) {
  auto it = std::lower_bound(units_.begin(), units_.end(), layer);
  if (it == units_.end() || *it != layer) return;
  UnitUpdate& u = updates_[static_cast<size_t>(it - units_.begin())];
  if (!u.pending) return;
  u.pending = false;
  if (u.gathers) {
    CollectiveTimer::wait(Collective::kAllGather, cuda::current_stream(), u.done);
  } else {
    cuda::stream_wait_event(cuda::current_stream(), u.done);
  }
}

void FsdpContext::reduce_scatter_early(int64_t layer) {
  std::vector<Shard*> todo;
  for (Shard* sh : unit(layer)) {
    if (sh->group->size() > 1) todo.push_back(sh);
  }
  if (todo.empty()) return;
  cuda::record_event(compute_point_, cuda::current_stream());
  cuda::stream_wait_event(comm_stream_, compute_point_);
  cuda::CurrentStreamScope on_comm(comm_stream_);
  for (Shard* sh : todo) {
    reduce_scatter(*sh, sh->grad, &overlap_group(*sh), comm_stream_);
    sh->reduced = true;
  }
}

int64_t FsdpContext::neighbour(int64_t layer, bool forward) const {
  auto it = std::lower_bound(units_.begin(), units_.end(), layer);
  if (it == units_.end() || *it != layer) return layer;
  if (forward) return it + 1 == units_.end() ? layer : *(it + 1);
  return it == units_.begin() ? layer : *(it - 1);
}

// Starts gathering `layer`'s buckets ahead of use. NCCL: on the communication stream, after
// the compute stream's work so far (the shards are final, freed memory may be reused); the
// compute stream waits for it in gather(). Gloo: gathered now.
void FsdpContext::prefetch(int64_t layer) {
  std::vector<Shard*> todo;
  for (Shard* sh : unit(layer)) {
    if (!sh->bucket->values.memory_resident()) todo.push_back(sh);
  }
  if (todo.empty()) return;
  if (!comm_stream_) {
    for (Shard* sh : todo) gather(*sh);
    return;
  }
  cuda::record_event(compute_point_, cuda::current_stream());
  cuda::stream_wait_event(comm_stream_, compute_point_);
  cuda::CurrentStreamScope on_comm(comm_stream_);  // the gathered buffer is allocated there too
  for (Shard* sh : todo) {
    sh->bucket->values.restore_memory();
    if (sh->group->size() == 1) {
      sh->bucket->values.copy_from(sh->value);
    } else {
      CollectiveScope timed(Collective::kAllGather, comm_stream_, /*on_compute=*/false);
      count_gather_bytes(*sh);
      sh->group->all_gather(sh->value, sh->bucket->values, comm_stream_);
    }
    cuda::record_event(sh->ready, comm_stream_);
    sh->in_flight = true;
  }
}

std::vector<FsdpContext::Shard*> FsdpContext::unit(int64_t layer) {
  std::vector<Shard*> out;
  for (Shard& sh : shards_) {
    if (sh.bucket->layer == layer) out.push_back(&sh);
  }
  return out;
}

// Whole weights from the shards (the bucket's padding gathers too: it is never read).
void FsdpContext::gather(Shard& sh) {
  if (sh.in_flight) {  // prefetched on the communication stream
    CollectiveTimer::wait(Collective::kAllGather, cuda::current_stream(), sh.ready);
    sh.in_flight = false;
    return;
  }
  if (sh.bucket->values.memory_resident()) return;
  sh.bucket->values.restore_memory();
  if (sh.group->size() == 1) {
    sh.bucket->values.copy_from(sh.value);
  } else {
    CollectiveScope timed(Collective::kAllGather);
    count_gather_bytes(sh);
    sh.group->all_gather(sh.value, sh.bucket->values);
  }
}

void FsdpContext::count_gather_bytes(const Shard& sh) const {
  CollectiveTimer::count_bytes(Collective::kAllGather, static_cast<double>(sh.value.nbytes()) * (sh.group->size() - 1));
}

namespace {

// Times a collective on the compute stream, or on `stream` (not the compute one) when given.
void time_on(std::optional<CollectiveScope>& scope, Collective k, cuda::Stream stream) {
  if (stream) {
    scope.emplace(k, stream, /*on_compute=*/false);
  } else {
    scope.emplace(k);
  }
}

}  // namespace

void FsdpContext::reduce_scatter(Shard& sh, Tensor& into, Communicator* group, cuda::Stream stream) {
  std::optional<CollectiveScope> timed;
  time_on(timed, Collective::kReduceScatter, stream);
  CollectiveTimer::count_bytes(Collective::kReduceScatter, static_cast<double>(into.nbytes()) * (sh.group->size() - 1));
  (group ? *group : *sh.group).reduce_scatter(sh.bucket->grads, into, ReduceOp::Sum, stream);
}

void FsdpContext::gather_into_bucket(Shard& sh, Communicator& group, cuda::Stream stream) {
  Tensor mine = sh.value.clone();
  std::optional<CollectiveScope> timed;
  time_on(timed, Collective::kAllGather, stream);
  count_gather_bytes(sh);
  group.all_gather(mine, sh.bucket->values, stream);
}

void FsdpContext::release(Shard& sh) {
  if (sh.in_flight) {  // prefetched and never used: the gather must end before the memory goes
    CollectiveTimer::wait(Collective::kAllGather, cuda::current_stream(), sh.ready);
    sh.in_flight = false;
  }
  sh.bucket->values.release_memory();
  sh.bucket->grads.release_memory();
}

void FsdpContext::before_forward(int64_t layer) {
  if (!shard_weights_) {
    wait_for_update(layer);
    return;
  }
  StageScope t(Stage::kOther);
  for (Shard* sh : unit(layer)) gather(*sh);
  prefetch(neighbour(layer, true));
}

void FsdpContext::after_forward(int64_t layer, bool backward_follows) {
  if (backward_follows || !shard_weights_) return;
  for (Shard* sh : unit(layer)) sh->bucket->values.release_memory();
}

void FsdpContext::before_backward(int64_t layer) {
  if (!shard_weights_) return;
  StageScope t(Stage::kOther);
  for (Shard* sh : unit(layer)) {
    gather(*sh);
    sh->bucket->grads.restore_memory();  // the model writes every gradient (accumulate off)
  }
  prefetch(neighbour(layer, false));
}

void FsdpContext::after_backward(int64_t layer) {
  if (!shard_weights_) {
    if (overlap_ && last_micro_batch_) reduce_scatter_early(layer);
    return;
  }
  StageScope t(Stage::kOther);
  for (Shard* sh : unit(layer)) {
    Tensor& into = first_micro_batch_ ? sh->grad : sh->scratch;
    if (sh->group->size() == 1) {
      into.copy_from(sh->bucket->grads);
    } else {
      reduce_scatter(*sh, into);
    }
    if (!first_micro_batch_) ops::add_(sh->grad, sh->scratch);
    release(*sh);
  }
}

void FsdpContext::reduce_scatter_grads() {
  // The overlap reduced the layers' gradients as the last backward made them: those finish first.
  bool early = false;
  for (const Shard& sh : shards_) early = early || sh.reduced;
  if (early) {
    cuda::record_event(compute_point_, comm_stream_);
    CollectiveTimer::wait(Collective::kReduceScatter, cuda::current_stream(), compute_point_);
  }
  last_micro_batch_ = false;
  for (Shard& sh : shards_) {
    // With shard_weights each layer's were reduced right after its backward.
    const bool reduced = sh.reduced;
    sh.reduced = false;
    if (!shard_weights_ && sh.group->size() > 1 && !reduced) reduce_scatter(sh, sh.grad);
    if (tp_group_ && sh.bucket->tp_replicated) {  // each tp rank's tokens' part of a weight all hold
      CollectiveScope timed(Collective::kTensorParallel);
      CollectiveTimer::count_bytes(Collective::kTensorParallel,
                                   static_cast<double>(sh.grad.nbytes()) * (tp_group_->size() - 1));
      tp_group_->all_reduce(sh.grad);
    }
    if (bridge_) {
      // Timed only where it crosses to another group (one group: the bridge does nothing).
      std::optional<CollectiveScope> timed;
      if (bridge_->crosses()) timed.emplace(Collective::kAllReduce);
      bridge_->all_reduce(sh.grad);
    }
  }
}

GradNorm FsdpContext::grad_norm(double max_norm) {
  std::vector<Tensor> grads;
  for (size_t i = 0; i < shard_params_.size(); ++i) {
    // A weight every tp rank holds whole counts once: on tp rank 0.
    if (!tp_whole_[i] || tp_group_->rank() == 0) grads.push_back(shard_params_[i].grad);
  }
  std::vector<double> sq{grads.empty() ? 0.0 : ops::sum_squares_all(grads)};
  // Every element is owned by one rank of the replica group (the replicas hold equal bits).
  all_reduce_doubles(replica_world_, sq, shards_.front().grad.device());
  GradNorm r;
  r.norm = std::sqrt(sq[0]);
  if (!std::isfinite(r.norm)) {
    for (const Parameter& s : shard_params_) {
      MT_CHECK(ops::all_finite(s.grad), "gradient of {} is not finite (NaN or Inf) on rank {}", s.name,
               replica_world_.rank());
    }
    MT_THROW("global gradient norm is not finite ({}): another rank holds the bad gradient", r.norm);
  }
  if (max_norm > 0 && r.norm > max_norm) r.clip_scale = max_norm / (r.norm + 1e-6);
  return r;
}

void FsdpContext::step(double lr, double grad_scale) {
  if (!overlap_) {
    opt_.step(shard_params_, lr, grad_scale);
    gather_values();
    return;
  }
  // Each layer's update and gather after the work so far (the gradients and their norm), in
  // the order the next forward needs them.
  opt_.advance();
  cuda::record_event(compute_point_, cuda::current_stream());
  cuda::stream_wait_event(comm_stream_, compute_point_);
  cuda::CurrentStreamScope on_comm(comm_stream_);
  for (size_t k = 0; k < units_.size(); ++k) {
    UnitUpdate& u = updates_[k];
    if (!u.params.empty()) opt_.update(shard_params_, u.params, lr, grad_scale);
    for (Shard* sh : unit(units_[k])) {
      if (sh->group->size() > 1) gather_into_bucket(*sh, overlap_group(*sh), comm_stream_);
    }
    cuda::record_event(u.done, comm_stream_);
    u.pending = true;
  }
}

void FsdpContext::gather_values() {
  if (shard_weights_) return;  // the shards are the weights; layers gather them on use
  drain();
  for (Shard& sh : shards_) {
    if (sh.group->size() > 1) gather_into_bucket(sh, *sh.group);
  }
}

}  // namespace moetrain
