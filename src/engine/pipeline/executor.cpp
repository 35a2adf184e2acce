#include "engine/pipeline/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <tuple>

#include <fmt/format.h>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/parallel/peer_arena.h"
#include "engine/pipeline/peer_transport.h"
#include "engine/telemetry/collective_timer.h"
#include "ops/ops.h"

namespace moetrain {

double head_weight_in_layers(const ModelConfig& model) {
  const ModelShape shape = model.shape();
  double layers = 0;
  for (int64_t id = 0; id < shape.num_layers; ++id) {
    const LayerFootprint f = model.layer_footprint(id, 2);
    layers += static_cast<double>(f.params + f.top_k * f.expert_params);
  }
  const double head = static_cast<double>(shape.vocab_size) * static_cast<double>(shape.hidden_size);
  return layers > 0 ? head * static_cast<double>(shape.num_layers) / layers : 1.0;
}

std::vector<ChunkSpec> partition_layers(int64_t num_layers, int num_chunks, int64_t mtp_layers, double head_layers) {
  MT_CHECK(num_chunks >= 1 && num_layers >= num_chunks,
           "pipeline: {} decoder layers cannot fill {} chunks (each needs at least one layer); lower [parallel].pp, "
           "or use schedule = \"1f1b\" (pp chunks rather than DualPipeV's 2 * pp)",
           num_layers, num_chunks);
  const int C = num_chunks;
  std::vector<int64_t> n(static_cast<size_t>(C), 1);
  // The head weighs head_layers, and each multi-token prediction module a layer and a head.
  const double tail = head_layers + static_cast<double>(mtp_layers) * (1.0 + head_layers);
  auto cost = [&](int i) { return static_cast<double>(n[i]) + (i == C - 1 ? tail : 0.0); };
  const double middle = (C - 1) / 2.0;
  for (int64_t left = num_layers - C; left > 0; --left) {
    int pick = 0;
    for (int i = 1; i < C; ++i) {
      // The cheapest chunk; on a tie the one with fewer layers, then the one nearer the middle.
      if (cost(i) != cost(pick)) {
        if (cost(i) < cost(pick)) pick = i;
      } else if (n[i] != n[pick]) {
        if (n[i] < n[pick]) pick = i;
      } else if (std::abs(i - middle) < std::abs(pick - middle)) {
        pick = i;
      }
    }
    ++n[pick];
  }
  std::vector<ChunkSpec> chunks;
  int64_t first = 0;
  for (int i = 0; i < C; ++i) {
    chunks.push_back({first, first + n[i] + (i == C - 1 ? mtp_layers : 0), i == 0, i == C - 1});
    first += n[i];
  }
  return chunks;
}

HeadHelp choose_head_helper(const std::vector<ChunkSpec>& chunks, const PipelineSchedule& schedule,
                            double head_layers, double setting) {
  HeadHelp h;
  if (setting == 0 || schedule.pp < 2 || schedule.forward_only() || chunks.empty()) return h;
  // Under 1F1B the head rank runs a micro-batch's F, B and W in a row: an H elsewhere sits on
  // its path and gains nothing (the simulation: schedule tests). Asked for, it runs anyway.
  if (setting < 0 && !schedule.v_shape) return h;
  const int last = schedule.num_chunks - 1;
  const int head_rank = schedule.rank_of_chunk(last);
  std::vector<double> layers(static_cast<size_t>(schedule.pp), 0.0);
  for (int c = 0; c < schedule.num_chunks; ++c) {
    layers[static_cast<size_t>(schedule.rank_of_chunk(c))] +=
        static_cast<double>(chunks[static_cast<size_t>(c)].last_layer - chunks[static_cast<size_t>(c)].first_layer);
  }
  for (int r = 0; r < schedule.pp; ++r) {
    if (r != head_rank && (h.helper < 0 || layers[static_cast<size_t>(r)] < layers[static_cast<size_t>(h.helper)])) {
      h.helper = r;
    }
  }
  // A layer's F + B + W weighs 3 against the head's forward and backward of 3 head_layers.
  const double share = setting > 0 ? setting
                                   : balancing_head_share(layers[static_cast<size_t>(head_rank)],
                                                          layers[static_cast<size_t>(h.helper)], head_layers);
  if (setting < 0 && share < 0.05) return HeadHelp{};
  h.share = std::min(share, 0.95);
  const double per_chunk = std::max(
      1.0, static_cast<double>(chunks.back().last_layer - chunks.front().first_layer) / schedule.num_chunks);
  h.head_cost = 3.0 * head_layers / per_chunk;
  return h;
}

ModelPlacement pipeline_placement(const std::vector<ChunkSpec>& chunks, const PipelineSchedule& schedule, int rank,
                                  ModelPlacement base) {
  MT_CHECK(static_cast<int>(chunks.size()) == schedule.num_chunks, "pipeline: {} chunks for a schedule of {}",
           chunks.size(), schedule.num_chunks);
  base.layers.clear();
  base.embed = base.head = false;
  for (const int c : schedule.chunks_of_rank(rank)) {  // ascending chunks: ascending layer ids
    const ChunkSpec& s = chunks[c];
    for (int64_t l = s.first_layer; l < s.last_layer; ++l) base.layers.push_back(l);
    base.embed = base.embed || s.embed;
    base.head = base.head || s.head;
  }
  return base;
}

namespace {

// Message tags: what (2 bits), the destination chunk (11 bits), the micro-batch (19 bits).
enum : uint32_t { kActivation = 0, kActivationTotals = 1, kGradient = 2, kGradientTotals = 3 };
uint32_t tag(uint32_t what, int chunk, int mb) {
  MT_CHECK(chunk >= 0 && chunk < (1 << 11) && mb >= 0 && mb < (1 << 19),
           "pipeline: chunk {} / micro-batch {} out of the message tag's range", chunk, mb);
  return (what << 30) | (static_cast<uint32_t>(chunk) << 19) | static_cast<uint32_t>(mb);
}

}  // namespace

uint32_t pipeline_message_tag(bool gradient, int chunk, int mb) {
  return tag(gradient ? kGradient : kActivation, chunk, mb);
}

std::vector<OrderedTransport::Message> pipeline_message_order(const PipelineSchedule& s, int rank,
                                                              const std::vector<int64_t>& rows) {
  struct Sent {
    double time;
    int from, op, half;
    int to;
    uint32_t tag;
    int64_t rows;
  };
  const int last = s.num_chunks - 1;
  const int head_rank = s.rank_of_chunk(last);
  auto helper_rows = [&](int m) {
    const int64_t t = rows[static_cast<size_t>(m)];
    return t - head_rows_kept(t, s.head_share);
  };
  const std::vector<std::vector<double>> finish = finish_times(s);
  std::vector<Sent> all;
  for (int p = 0; p < s.pp; ++p) {
    for (int i = 0; i < static_cast<int>(s.ops[p].size()); ++i) {
      const PipeOp& op = s.ops[p][i];
      const double t = finish[p][i];
      auto forward = [&](int c, int m) {
        if (c + 1 < s.num_chunks && s.rank_of_chunk(c + 1) != p) {
          all.push_back({t, p, i, 0, s.rank_of_chunk(c + 1), tag(kActivation, c + 1, m), rows[static_cast<size_t>(m)]});
        }
        if (c == last && s.head_helper >= 0) {  // the helper's rows of the final norm's output
          all.push_back({t, p, i, 0, s.head_helper, tag(kActivation, last + 1, m), helper_rows(m)});
        }
      };
      auto backward = [&](int c, int m) {
        if (c > 0 && s.rank_of_chunk(c - 1) != p) {
          all.push_back({t, p, i, 1, s.rank_of_chunk(c - 1), tag(kGradient, c - 1, m), rows[static_cast<size_t>(m)]});
        }
      };
      PipeOp half[2];
      for (int h = 0, n = op.halves(half); h < n; ++h) {  // a pair's first half's message first
        if (half[h].kind == PipeOpKind::F) forward(half[h].chunk, half[h].mb);
        if (half[h].kind == PipeOpKind::B) backward(half[h].chunk, half[h].mb);
        if (half[h].kind == PipeOpKind::H) {  // their gradient back to the head
          all.push_back({t, p, i, 0, head_rank, tag(kGradient, last, half[h].mb), helper_rows(half[h].mb)});
        }
      }
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Sent& a, const Sent& b) {
    return std::tie(a.time, a.from, a.op, a.half) < std::tie(b.time, b.from, b.op, b.half);
  });
  std::vector<OrderedTransport::Message> out;
  for (const Sent& m : all) {
    if (m.from == rank) out.push_back({m.to, true, m.tag, m.rows});
    if (m.to == rank) out.push_back({m.from, false, m.tag, m.rows});
  }
  return out;
}

PipelineExecutor::PipelineExecutor(Model& model, ExpertDispatcher& dispatcher, Communicator* pp_group,
                                   std::vector<ChunkSpec> chunks)
    : model_(model), dispatcher_(dispatcher), pp_(pp_group), chunks_(std::move(chunks)) {
  rank_ = pp_ ? pp_->rank() : 0;
  if (pp_ && pp_->backend() != "gloo") {
    // Among the GPUs of one host, copies into the peers' memory; else (or when asked) NCCL.
    const char* env = std::getenv("MOETRAIN_PIPELINE_TRANSPORT");
    const bool nccl = env != nullptr && std::string(env) == "nccl";
    const int64_t H = model_.model_config().shape().hidden_size;
    if (!nccl && PeerArena::usable(*pp_)) {
      transport_ = std::make_unique<PeerTransport>(*pp_, model_.device(), H, model_.dtype(),
                                                   model_.totals_message_size());
    } else {
      transport_ = std::make_unique<OrderedTransport>(*pp_, model_.device(), H, model_.dtype(),
                                                      model_.totals_message_size());
    }
    spdlog::info("pipeline: messages {}", dynamic_cast<PeerTransport*>(transport_.get())
                                              ? "copied into the peers' memory (one host)"
                                              : "over NCCL (send / receive in one order)");
  }
}

Tensor PipelineExecutor::for_comm(const Tensor& t) const {
  if (pp_->backend() == "gloo" && !t.device().is_cpu()) return t.to(Device::cpu());
  if (pp_->backend() != "gloo" && t.device() != model_.device()) return t.to(model_.device());
  return t;
}

PipelineExecutor::Handoff PipelineExecutor::take(std::map<Key, Handoff>& local, Key key, bool backward,
                                                 const Batch& batch) {
  if (auto it = local.find(key); it != local.end()) {
    Handoff h = std::move(it->second);
    local.erase(it);
    return h;
  }
  const int from = rank_of(backward ? key.first + 1 : key.first - 1);
  MT_CHECK(pp_ != nullptr && from != rank_, "no {} was handed over for chunk {} micro-batch {}",
           backward ? "output gradient" : "input", key.first, key.second);
  if (transport_) {
    auto [hidden, packed] = transport_->receive(tag(backward ? kGradient : kActivation, key.first, key.second));
    mark_inputs_in();
    return {hidden, model_.unpack_totals(packed)};
  }
  const bool on_host = pp_->backend() == "gloo";
  const Device where = on_host ? Device::cpu() : model_.device();
  Tensor hidden = Tensor::empty({token_rows(batch), model_.model_config().shape().hidden_size}, model_.dtype(), where);
  Tensor packed = Tensor::empty({model_.totals_message_size()}, DType::F64, where);
  {  // waited for on the host: all of it exposed (with the bubble)
    CollectiveScope timed(Collective::kPipeline);
    auto rh = pp_->irecv(hidden, from, tag(backward ? kGradient : kActivation, key.first, key.second));
    auto rt = pp_->irecv(packed, from, tag(backward ? kGradientTotals : kActivationTotals, key.first, key.second));
    rh->wait();
    rt->wait();
  }
  mark_inputs_in();
  Handoff h;
  h.hidden = where == model_.device() ? hidden : hidden.to(model_.device());
  h.totals = model_.unpack_totals(packed);
  return h;
}

void PipelineExecutor::give(std::map<Key, Handoff>& local, Key key, bool backward, Handoff h) {
  const int to = rank_of(key.first);
  if (to == rank_) {
    local[key] = std::move(h);
    return;
  }
  MT_CHECK(h.hidden.dtype() == model_.dtype(), "chunk {} {} is {}, expected the model's {}", key.first,
           backward ? "gradient" : "activation", dtype_name(h.hidden.dtype()), dtype_name(model_.dtype()));
  const uint32_t hidden_tag = tag(backward ? kGradient : kActivation, key.first, key.second);
  sent_.push_back({to, hidden_tag});
  if (transport_) {
    transport_->send(to, hidden_tag, for_comm(h.hidden), for_comm(model_.pack_totals(h.totals)));
    return;
  }
  sends_.push_back(pp_->isend(for_comm(h.hidden), to, hidden_tag));
  sends_.push_back(pp_->isend(for_comm(model_.pack_totals(h.totals)), to,
                              tag(backward ? kGradientTotals : kActivationTotals, key.first, key.second)));
}

PipelineExecutor::Handoff PipelineExecutor::forward_input(int chunk, int mb, const Batch& batch) {
  if (chunks_[chunk].embed) return {Tensor(), model_.new_totals()};
  return take(inputs_, {chunk, mb}, false, batch);
}

void PipelineExecutor::forward_output(int chunk, int mb, Handoff out, const MicroBatchLoss& loss, bool training,
                                      Result& r) {
  ChunkActivations& a = acts_.at({chunk, mb});
  if (chunks_[chunk].head && a.head_tail.defined()) {  // the helper's rows (kept until finish_head)
    send_rows(schedule_->head_helper, tag(kActivation, chunk + 1, mb), a.head_tail);
  }
  // This chunk's expert counts (and, at the head, the loss terms) stay on the device until
  // the step's end (read_results): a host wait here would drain this rank's queue at every
  // forward, and the host could not run ahead of the GPU to issue the next steps' messages.
  Unread u{chunk};
  if (chunks_[chunk].head) u.loss = loss;
  u.loss.on_device.expert_counts = std::move(a.expert_counts);
  u.loss.on_device.router_entropy = std::move(a.router_entropy);
  a.expert_counts.clear();
  a.router_entropy.clear();
  unread_.push_back(std::move(u));
  if (!training) acts_.erase({chunk, mb});  // nothing to go back through
  if (chunks_[chunk].head) {
    r.has_head = true;
    head_written_ = training;
    return;
  }
  give(inputs_, {chunk + 1, mb}, false, std::move(out));
}

void PipelineExecutor::read_results(Result& r) {
  for (Unread& u : unread_) {
    MicroBatchLoss& read = u.loss;
    read.read_device_values();
    auto& counts = counts_[u.chunk];
    auto& entropy = entropy_[u.chunk];
    if (counts.empty()) {
      counts = std::move(read.expert_counts);
      entropy = std::move(read.router_entropy);
    } else {
      for (size_t k = 0; k < counts.size(); ++k) {
        for (size_t e = 0; e < counts[k].size(); ++e) counts[k][e] += read.expert_counts[k][e];
        if (k < entropy.size() && k < read.router_entropy.size()) entropy[k] += read.router_entropy[k];
      }
    }
    if (chunks_[u.chunk].head) {
      r.ce_sum += read.ce_sum;
      for (const LossTerm& t : read.terms) add_loss_term(r.terms, t);
    }
  }
  unread_.clear();
  for (const Tensor& ce : helper_ce_) r.ce_sum += ce.to(Device::cpu()).to_double_vector()[0];
  helper_ce_.clear();
}

Tensor PipelineExecutor::backward_input(int chunk, int mb, const Batch& batch, ChunkActivations*& a) {
  auto it = acts_.find({chunk, mb});
  MT_CHECK(it != acts_.end(), "B before F for chunk {} micro-batch {}", chunk, mb);
  a = &it->second;
  if (chunks_[chunk].head) {  // the head's gradient was made with its loss
    if (a->head_tail.defined()) {  // but for the helper's rows
      const Tensor d_tail = receive_rows(schedule_->head_helper, tag(kGradient, chunk, mb), a->head_tail.shape()[0]);
      model_.finish_head(*a, d_tail, norm_written_);
      norm_written_ = true;
    }
    return Tensor();
  }
  Handoff g = take(grads_, {chunk, mb}, true, batch);
  a->totals = g.totals;  // the final totals, from the head
  return g.hidden;
}

void PipelineExecutor::backward_output(int chunk, int mb, Tensor dx, const ChunkActivations& a) {
  if (!chunks_[chunk].embed) give(grads_, {chunk - 1, mb}, true, {std::move(dx), a.totals});
}

int64_t PipelineExecutor::head_rows(const Batch& batch) const {
  if (!helped()) return -1;
  return head_rows_kept(token_rows(batch), schedule_->head_share);
}

void PipelineExecutor::send_rows(int to, uint32_t t, const Tensor& rows) {
  sent_.push_back({to, t});
  if (transport_) {
    transport_->send(to, t, for_comm(rows), for_comm(model_.pack_totals(model_.new_totals())));
    return;
  }
  sends_.push_back(pp_->isend(for_comm(rows), to, t));
}

Tensor PipelineExecutor::receive_rows(int from, uint32_t t, int64_t rows) {
  if (transport_) {
    Tensor hidden = transport_->receive(t).first;
    mark_inputs_in();
    return hidden;
  }
  const bool on_host = pp_->backend() == "gloo";
  const Device where = on_host ? Device::cpu() : model_.device();
  Tensor hidden = Tensor::empty({rows, model_.model_config().shape().hidden_size}, model_.dtype(), where);
  {
    CollectiveScope timed(Collective::kPipeline);
    pp_->irecv(hidden, from, t)->wait();
  }
  mark_inputs_in();
  return where == model_.device() ? hidden : hidden.to(model_.device());
}

// The helper's part of micro-batch mb's head: the cross-entropy of the last rows with the copy
// of the head, their gradient sent back, the copy's weight gradient written or added.
void PipelineExecutor::head_help_step(int mb, const Batch& batch, double ce_scale) {
  const int last = schedule_->num_chunks - 1;
  const int head_rank = rank_of(last);
  const int64_t T = token_rows(batch);
  const int64_t kept = head_rows_kept(T, schedule_->head_share);
  const Tensor h = receive_rows(head_rank, tag(kActivation, last + 1, mb), T - kept);
  Tensor dh;
  const ops::LinearCrossEntropyOut out =
      ops::linear_cross_entropy(h, helper_w_, batch.targets.view({T}).slice(kept, T), ce_scale, &dh, &helper_g_,
                                /*chunk_rows=*/0, helper_written_);
  helper_written_ = true;
  helper_ce_.push_back(out.loss_sum);
  send_rows(head_rank, tag(kGradient, last, mb), dh);
}

// At the step's start the head's rank sends the head's weights (as the optimizer left them)
// to the helper, which keeps them for the step's H steps.
void PipelineExecutor::sync_head_weights() {
  const int last = schedule_->num_chunks - 1;
  const int head_rank = rank_of(last), helper = schedule_->head_helper;
  if (rank_ == head_rank) {
    if (WeightHooks* hooks = model_.weight_hooks()) hooks->before_forward(-1);  // FSDP's overlapped update
    const Tensor w = for_comm(model_.head_weight());
    pp_->isend(w, helper, tag(kActivationTotals, last + 1, 0))->wait();
  } else if (rank_ == helper) {
    const ModelShape shape = model_.model_config().shape();
    if (!helper_w_.defined()) {
      helper_w_ = Tensor::empty({shape.vocab_size, shape.hidden_size}, model_.dtype(), model_.device());
      helper_g_ = Tensor::empty({shape.vocab_size, shape.hidden_size}, model_.parameters().front().grad.dtype(),
                                model_.device());
    }
    Tensor into = pp_->backend() == "gloo" && !model_.device().is_cpu() ? Tensor::empty(helper_w_.shape(),
                                                                                       helper_w_.dtype(), Device::cpu())
                                                                        : helper_w_;
    pp_->irecv(into, head_rank, tag(kActivationTotals, last + 1, 0))->wait();
    if (into.raw() != helper_w_.raw()) helper_w_.copy_from(into);
  }
}

// At the step's end the helper's weight gradient of its rows is added into the head's.
void PipelineExecutor::add_helper_gradient() {
  const int last = schedule_->num_chunks - 1;
  const int head_rank = rank_of(last), helper = schedule_->head_helper;
  if (rank_ == helper) {
    pp_->isend(for_comm(helper_g_), head_rank, tag(kGradientTotals, last + 1, 0))->wait();
  } else if (rank_ == head_rank) {
    Tensor g = model_.head_weight_grad();
    const Device where = pp_->backend() == "gloo" ? Device::cpu() : model_.device();
    Tensor got = Tensor::empty(g.shape(), g.dtype(), where);
    pp_->irecv(got, helper, tag(kGradientTotals, last + 1, 0))->wait();
    ops::add_(g, where == g.device() ? got : got.to(g.device()));
  }
}

void PipelineExecutor::forward_step(int chunk, int mb, const Batch& batch, ChunkPass pass, Result& r) {
  Handoff in = forward_input(chunk, mb, batch);
  pass.head_accumulate = head_written_;
  pass.head_rows = pass.training ? head_rows(batch) : -1;
  MicroBatchLoss loss;
  const ChunkSpec& spec = chunks_[chunk];
  Tensor out = model_.forward_chunk(spec, batch, in.hidden, dispatcher_, acts_[{chunk, mb}], in.totals, pass,
                                    spec.head ? &loss : nullptr);
  forward_output(chunk, mb, {out, in.totals}, loss, pass.training, r);
}

void PipelineExecutor::input_grad_step(int chunk, int mb, const Batch& batch, double aux_scale) {
  ChunkActivations* a = nullptr;
  Tensor dy = backward_input(chunk, mb, batch, a);
  Tensor dx = model_.backward_chunk(chunks_[chunk], batch, dy, dispatcher_, *a, aux_scale, /*weights_now=*/false, false);
  backward_output(chunk, mb, std::move(dx), *a);
}

void PipelineExecutor::overlapped_step(const PipeOp& op, const std::vector<Batch>& batches, ChunkPass pass,
                                       Result& r) {
  // Both passes' inputs first: the interleaving needs them all.
  Handoff in = forward_input(op.chunk, op.mb, batches[op.mb]);
  ChunkActivations& fa = acts_[{op.chunk, op.mb}];
  ChunkActivations* ba = nullptr;
  Tensor dy = backward_input(op.chunk2, op.mb2, batches[op.mb2], ba);
  pass.head_accumulate = head_written_;
  pass.head_rows = pass.training ? head_rows(batches[op.mb]) : -1;
  MicroBatchLoss loss;
  const ChunkSpec& fc = chunks_[op.chunk];
  auto [out, dx] = model_.forward_backward_overlapped(fc, batches[op.mb], in.hidden, fa, in.totals, pass,
                                                      fc.head ? &loss : nullptr, chunks_[op.chunk2],
                                                      batches[op.mb2], dy, *ba, dispatcher_);
  // The forward's output leaves first, as when the pair runs in turn: an ordered transport
  // (NCCL) expects each rank's messages in the order pipeline_message_order() lists them.
  forward_output(op.chunk, op.mb, {out, in.totals}, loss, pass.training, r);
  backward_output(op.chunk2, op.mb2, std::move(dx), *ba);
}

void PipelineExecutor::forwards_overlapped_step(const PipeOp& op, const std::vector<Batch>& batches, ChunkPass pass,
                                                Result& r) {
  Handoff in1 = forward_input(op.chunk, op.mb, batches[op.mb]);
  Handoff in2 = forward_input(op.chunk2, op.mb2, batches[op.mb2]);
  ChunkActivations& a1 = acts_[{op.chunk, op.mb}];
  ChunkActivations& a2 = acts_[{op.chunk2, op.mb2}];
  pass.head_accumulate = head_written_;
  pass.head_rows = pass.training ? head_rows(batches[chunks_[op.chunk].head ? op.mb : op.mb2]) : -1;
  MicroBatchLoss loss1, loss2;
  const ChunkSpec &c1 = chunks_[op.chunk], &c2 = chunks_[op.chunk2];
  MT_CHECK(!(c1.head && c2.head), "pipeline: two forwards of the head chunk paired ({})", to_string(op));
  auto [out1, out2] = model_.forwards_overlapped(c1, batches[op.mb], in1.hidden, a1, in1.totals,
                                                 c1.head ? &loss1 : nullptr, c2, batches[op.mb2], in2.hidden, a2,
                                                 in2.totals, c2.head ? &loss2 : nullptr, pass, dispatcher_);
  forward_output(op.chunk, op.mb, {out1, in1.totals}, loss1, pass.training, r);
  forward_output(op.chunk2, op.mb2, {out2, in2.totals}, loss2, pass.training, r);
}

void PipelineExecutor::backwards_overlapped_step(const PipeOp& op, const std::vector<Batch>& batches,
                                                 double aux_scale) {
  ChunkActivations *a1 = nullptr, *a2 = nullptr;
  Tensor dy1 = backward_input(op.chunk, op.mb, batches[op.mb], a1);
  Tensor dy2 = backward_input(op.chunk2, op.mb2, batches[op.mb2], a2);
  auto [dx1, dx2] = model_.backwards_overlapped(chunks_[op.chunk], batches[op.mb], dy1, *a1, chunks_[op.chunk2],
                                                batches[op.mb2], dy2, *a2, aux_scale, dispatcher_);
  backward_output(op.chunk, op.mb, std::move(dx1), *a1);
  backward_output(op.chunk2, op.mb2, std::move(dx2), *a2);
}

void PipelineExecutor::weight_step(int chunk, int mb, const Batch& batch) {
  auto it = acts_.find({chunk, mb});
  MT_CHECK(it != acts_.end(), "W before F for chunk {} micro-batch {}", chunk, mb);
  // The experts' weight gradients of a chunk's W steps in groups of expert_wgrad_group, one
  // pass over f32 dW each (the step's last W of the chunk ends the last group).
  const int64_t group = model_.expert_wgrad_group();
  const int done = ++weights_done_[chunk];
  const bool defer = group > 1 && done % group != 0 && done < schedule_->micro_batches;
  model_.backward_chunk_weight(chunks_[chunk], batch, it->second, weights_written_[chunk], defer);
  weights_written_[chunk] = true;
  acts_.erase(it);
}

PipelineExecutor::Result PipelineExecutor::run(const PipelineSchedule& s, const std::vector<Batch>& batches,
                                               const ChunkPass& pass) {
  MT_CHECK(s.num_chunks == static_cast<int>(chunks_.size()), "pipeline: schedule {} has {} chunks, the model {}",
           s.name, s.num_chunks, chunks_.size());
  MT_CHECK(s.micro_batches == static_cast<int>(batches.size()), "pipeline: schedule {} runs {} micro-batches, got {}",
           s.name, s.micro_batches, batches.size());
  MT_CHECK(s.pp == (pp_ ? pp_->size() : 1), "pipeline: schedule {} is for {} ranks, the pipeline group has {}", s.name,
           s.pp, pp_ ? pp_->size() : 1);
  schedule_ = &s;
  sent_.clear();
  MT_CHECK(!helped() || pass.training, "pipeline: schedule {} has a head helper but runs forward only", s.name);
  if (helped()) sync_head_weights();  // before the step's messages (NCCL: one order on every rank)
  if (transport_) {
    std::vector<int64_t> rows;
    for (const Batch& b : batches) rows.push_back(token_rows(b));
    std::vector<std::vector<PipelineMessage>> orders;
    for (int r = 0; r < s.pp; ++r) orders.push_back(pipeline_message_order(s, r, rows));
    transport_->begin_step(orders, *std::max_element(rows.begin(), rows.end()));
  }
  weights_written_.assign(chunks_.size(), false);
  weights_done_.assign(chunks_.size(), 0);
  head_written_ = false;
  norm_written_ = false;
  helper_written_ = false;
  helper_ce_.clear();
  counts_.clear();
  entropy_.clear();
  unread_.clear();
  Result r;
  // Timing (bench): an event pair per op on the GPU, read once at the end of the step.
  const bool gpu_clock = timing_on_ && !model_.device().is_cpu();
  struct OpEvents {
    cuda::Event start, inputs_in, end;  // inputs_in: after the op's last receive (or == start)
  };
  std::vector<OpEvents> events;
  std::vector<PipeOpKind> kinds;
  timing_ = Timing();
  const auto step_start = std::chrono::steady_clock::now();
  cuda::Event step_begin = nullptr;
  if (gpu_clock) {
    step_begin = cuda::create_event();
    cuda::record_event(step_begin, cuda::current_stream());
  }
  static const bool trace = [] {
    const char* v = std::getenv("MOETRAIN_PIPELINE_TRACE");
    return v != nullptr && std::string(v) == "1";
  }();
  for (const PipeOp& op : s.ops[rank_]) {
    if (trace) {  // a warning, so that every rank prints it
      spdlog::warn("pipeline trace: rank {} {}{}", rank_, to_string(op),
                   transport_ ? " |" + transport_->pending() : std::string());
    }
    inputs_in_ = std::chrono::steady_clock::now();
    if (gpu_clock) {
      events.push_back({cuda::create_event(), cuda::create_event(), cuda::create_event()});
      kinds.push_back(op.kind);
      cuda::record_event(events.back().start, cuda::current_stream());
      cuda::record_event(events.back().inputs_in, cuda::current_stream());
      inputs_in_event_ = events.back().inputs_in;
    }
    try {
      // A single step, or a pair's halves in turn when pairs are not overlapped.
      auto single = [&](const PipeOp& o) {
        switch (o.kind) {
          case PipeOpKind::F: forward_step(o.chunk, o.mb, batches[o.mb], pass, r); break;
          case PipeOpKind::B: input_grad_step(o.chunk, o.mb, batches[o.mb], pass.aux_scale); break;
          case PipeOpKind::W: weight_step(o.chunk, o.mb, batches[o.mb]); break;
          case PipeOpKind::H: head_help_step(o.mb, batches[o.mb], pass.ce_scale); break;
          default: MT_THROW("pipeline: {} is not a single step", to_string(o));
        }
      };
      if (!op.paired() || !overlap_) {
        PipeOp half[2];
        for (int h = 0, n = op.halves(half); h < n; ++h) single(half[h]);
      } else if (op.kind == PipeOpKind::FB) {
        overlapped_step(op, batches, pass, r);
      } else if (op.kind == PipeOpKind::FF) {
        forwards_overlapped_step(op, batches, pass, r);
      } else {
        backwards_overlapped_step(op, batches, pass.aux_scale);
      }
    } catch (const Error& e) {
      model_.drop_deferred_expert_weights();
      MT_THROW("pipeline rank {} of {}, step {} of schedule {}: {}", rank_, s.pp, to_string(op), s.name, e.what());
    }
    if (gpu_clock) cuda::record_event(events.back().end, cuda::current_stream());
    else if (timing_on_) {
      add_time(op.kind, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - inputs_in_).count());
    }
  }
  for (auto& q : sends_) q->wait();
  sends_.clear();
  read_results(r);
  if (transport_) transport_->end_step();
  if (helped()) add_helper_gradient();
  if (gpu_clock) {
    cuda::Event step_end = cuda::create_event();
    cuda::record_event(step_end, cuda::current_stream());
    timing_.step_ms = cuda::elapsed_ms(step_begin, step_end);
    for (size_t i = 0; i < events.size(); ++i) {
      add_time(kinds[i], cuda::elapsed_ms(events[i].inputs_in, events[i].end));
      for (cuda::Event e : {events[i].start, events[i].inputs_in, events[i].end}) cuda::destroy_event(e);
    }
    inputs_in_event_ = nullptr;
    cuda::destroy_event(step_begin);
    cuda::destroy_event(step_end);
  } else if (timing_on_) {
    timing_.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count();
  }
  MT_CHECK(acts_.empty() && inputs_.empty() && grads_.empty(),
           "pipeline rank {}: schedule {} left {} activations and {} hand-overs unused", rank_, s.name, acts_.size(),
           inputs_.size() + grads_.size());
  for (auto& [chunk, counts] : counts_) {
    for (auto& layer : counts) r.expert_counts.push_back(std::move(layer));
    for (double h : entropy_[chunk]) r.router_entropy.push_back(h);
  }
  schedule_ = nullptr;
  return r;
}

// A receive ended: compute time of the current op counts from here (on the GPU, from when the
// compute stream has waited for it).
void PipelineExecutor::mark_inputs_in() {
  if (!timing_on_) return;
  inputs_in_ = std::chrono::steady_clock::now();
  if (inputs_in_event_) cuda::record_event(inputs_in_event_, cuda::current_stream());
}

void PipelineExecutor::add_time(PipeOpKind kind, double ms) {
  switch (kind) {
    case PipeOpKind::F: timing_.f_ms += ms, ++timing_.f; break;
    case PipeOpKind::B: timing_.b_ms += ms, ++timing_.b; break;
    case PipeOpKind::W: timing_.w_ms += ms, ++timing_.w; break;
    case PipeOpKind::FB: timing_.fb_ms += ms, ++timing_.fb; break;
    case PipeOpKind::FF: timing_.f_ms += ms, timing_.f += 2; break;  // two forwards' time
    case PipeOpKind::BB: timing_.b_ms += ms, timing_.b += 2; break;
    case PipeOpKind::H: timing_.h_ms += ms, ++timing_.h; break;
  }
}

PipelineExecutor::Result PipelineExecutor::train(const PipelineSchedule& s, const std::vector<Batch>& batches,
                                                 double ce_scale, double aux_scale) {
  return run(s, batches, ChunkPass{true, ce_scale, aux_scale, false});
}

PipelineExecutor::Result PipelineExecutor::forward(const PipelineSchedule& s, const std::vector<Batch>& batches) {
  return run(s, batches, ChunkPass{false});
}

}  // namespace moetrain
