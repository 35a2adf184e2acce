#include "engine/optim/layerwise.h"

#include <cmath>
#include <map>
#include <optional>

#include "core/log.h"
#include "engine/telemetry/stage_timer.h"
#include "ops/ops.h"

namespace moetrain {

LayerwiseOptimizer::LayerwiseOptimizer(Model& model, AdamW& opt, LayerwiseConfig cfg)
    : model_(model), opt_(opt), cfg_(cfg) {
  MT_CHECK(model.weight_hooks() == nullptr, "LayerwiseOptimizer: the model already has weight hooks (FSDP)");
  const std::vector<ParamBucket>& buckets = model.buckets();
  std::map<int64_t, size_t> by_layer;  // ascending: -1 (embedding, head) first, then the layers
  for (size_t b = 0; b < buckets.size(); ++b) by_layer.emplace(buckets[b].layer, 0);
  for (auto& [layer, index] : by_layer) {
    index = groups_.size();
    groups_.push_back(Group{layer, {}, {}});
  }
  for (size_t b = 0; b < buckets.size(); ++b) {
    Group& g = groups_[by_layer.at(buckets[b].layer)];
    g.buckets.push_back(b);
    for (const ParamBucket::Member& m : buckets[b].members) g.params.push_back(m.param);
  }
  size_t covered = 0;
  for (const Group& g : groups_) covered += g.params.size();
  MT_CHECK(covered == model.parameters().size(), "LayerwiseOptimizer: the buckets hold {} of the {} parameters",
           covered, model.parameters().size());
  norms_ = Tensor::zeros({static_cast<int64_t>(buckets.size())}, DType::F64, model.device());
  summed_.assign(buckets.size(), false);
  if (cfg_.overlap) make_stream();
  model.set_weight_hooks(this);
}

void LayerwiseOptimizer::make_stream() {
  if (stream_ || model_.device().is_cpu()) return;
  // With capped updates, high priority: an update's few blocks take the next free
  // multiprocessors ahead of the forward's pending ones (the forward waits for them; the
  // other way round is a priority inversion, docs/perf.md).
  stream_ = cfg_.update_sms > 0 ? cuda::create_high_priority_stream() : cuda::create_stream();
  grads_ready_ = cuda::create_sync_event();
  norms_ready_ = cuda::create_sync_event();
  for (Group& g : groups_) g.updated = cuda::create_sync_event();
}

LayerwiseOptimizer::~LayerwiseOptimizer() {
  model_.set_weight_hooks(nullptr);
  if (!stream_) return;
  try {
    cuda::stream_synchronize(stream_);
    for (Group& g : groups_) cuda::destroy_event(g.updated);
    cuda::destroy_event(grads_ready_);
    cuda::destroy_event(norms_ready_);
    cuda::destroy_stream(stream_);
  } catch (const std::exception& e) {
    spdlog::error("optimizer: releasing the optimizer stream: {}", e.what());
  }
}

void LayerwiseOptimizer::set_overlap(bool on) {
  drain();
  cfg_.overlap = on;
  if (on) make_stream();
}

LayerwiseOptimizer::Group* LayerwiseOptimizer::group_of(int64_t layer) {
  for (Group& g : groups_) {
    if (g.layer == layer) return &g;
  }
  return nullptr;
}

void LayerwiseOptimizer::sum_bucket(size_t b) {
  const ParamBucket& k = model_.buckets()[b];
  std::vector<Tensor> grads;
  if (k.used > 0) grads.push_back(k.grads.slice(0, k.used));
  ops::sum_squares_all_into(grads, norms_, static_cast<int64_t>(b));
  summed_[b] = true;
}

void LayerwiseOptimizer::after_backward(int64_t layer) {
  if (!armed_) return;
  Group* g = group_of(layer);
  if (!g) return;
  std::optional<StageScope> in_line;
  std::optional<cuda::CurrentStreamScope> on;
  if (!overlapping()) {
    in_line.emplace(Stage::kOptimizer);  // the stage table counts it where it belongs
  } else {
    // The layer's gradients are final on the current stream: sum them on the other one
    // while the backward goes on to the layer below.
    cuda::record_event(grads_ready_, cuda::current_stream());
    cuda::stream_wait_event(stream_, grads_ready_);
    on.emplace(stream_);
  }
  for (size_t b : g->buckets) {
    if (!summed_[b]) sum_bucket(b);
  }
}

ops::SumSquaresInto LayerwiseOptimizer::expert_grad_squares(int64_t layer) {
  if (!armed_) return {};
  Group* g = group_of(layer);
  if (!g) return {};
  for (size_t b : g->buckets) {
    // An experts bucket holds exactly the layer's three expert stacks (and zero padding).
    if (!model_.buckets()[b].experts || summed_[b]) continue;
    summed_[b] = true;  // written by the op on the current stream, before the step reads it
    return {&norms_, static_cast<int64_t>(b)};
  }
  return {};
}

double LayerwiseOptimizer::finish_norm() {
  const bool overlap = overlapping();
  if (overlap) {  // everything below follows the whole backward
    cuda::record_event(grads_ready_, cuda::current_stream());
    cuda::stream_wait_event(stream_, grads_ready_);
  }
  {
    std::optional<cuda::CurrentStreamScope> on;
    if (overlap) on.emplace(stream_);
    for (size_t b = 0; b < summed_.size(); ++b) {
      if (!summed_[b]) sum_bucket(b);  // buckets no hook reached (a step without armed backward)
    }
    if (overlap) cuda::record_event(norms_ready_, stream_);
  }
  if (overlap) cuda::stream_wait_event(cuda::current_stream(), norms_ready_);
  const std::vector<double> sq = norms_.to_double_vector();  // the step's one host wait
  double total = 0;
  for (double x : sq) total += x;  // bucket order, whatever order the parts finished in
  armed_ = false;
  summed_.assign(summed_.size(), false);
  return total;
}

GradNorm LayerwiseOptimizer::step(double lr, double max_norm) {
  const bool overlap = overlapping();
  ParameterList& params = model_.parameters();
  const double total = finish_norm();
  const GradNorm g = grad_norm_of(total, params, max_norm);

  opt_.advance();
  for (size_t k = 0; k < groups_.size(); ++k) {
    Group& gr = groups_[k];
    if (!overlap) {
      opt_.update(params, gr.params, lr, g.clip_scale);
      continue;
    }
    // The first two groups (the embedding's and the first layer's) have no forward to run
    // beside: the whole GPU. Later ones leave multiprocessors to the layers before them.
    cuda::CurrentStreamScope on(stream_);
    opt_.update(params, gr.params, lr, g.clip_scale, k < 2 ? 0 : cfg_.update_sms);
    cuda::record_event(gr.updated, stream_);
    gr.pending = true;
  }
  return g;
}

double LayerwiseOptimizer::discard() {
  return std::sqrt(finish_norm());  // the current stream follows the sums: the next step may write
}

void LayerwiseOptimizer::before_forward(int64_t layer) {
  Group* g = group_of(layer);
  if (!g || !g->pending) return;
  cuda::stream_wait_event(cuda::current_stream(), g->updated);
  g->pending = false;
}

void LayerwiseOptimizer::drain() {
  for (Group& g : groups_) {
    if (!g.pending) continue;
    cuda::stream_wait_event(cuda::current_stream(), g.updated);
    g.pending = false;
  }
}

}  // namespace moetrain
