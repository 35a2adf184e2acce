#include "engine/models/decoder_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "engine/parallel/context_attention.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {

namespace {
// Rows [part.first, part.first + part.n) of `whole` ([total, ...] like `piece`, made at the first piece).
void put_rows(Tensor& whole, const Tensor& piece, const RowPart& part, int64_t total) {
  if (!whole.defined() || whole.size(0) != total) {
    Shape shape = piece.shape();
    shape[0] = total;
    whole = Tensor::empty(shape, piece.dtype(), piece.device());
  }
  whole.slice(part.first, part.first + part.n).copy_from(piece);
}
}  // namespace

Tensor swiglu_mlp_forward(const Projections& proj, DispatchOut& in, const Tensor& w_gate, const Tensor& w_up,
                          const Tensor& w_down, const RowPart& part, ops::SwigluOut& out) {
  StageScope t(Stage::kExpertGemm);
  if (part.whole()) {
    out = proj.experts_forward(in.rows, in.counts, w_gate, w_up, w_down, in.rows_q);
    in.rows_q = {};  // the forward's input only: not kept for the backward
    return out.y;
  }
  const ops::SwigluOut o = proj.experts_forward(part.of(in.rows), part.counts, w_gate, w_up, w_down);
  for (auto [whole, piece] : {std::pair{&out.gate, &o.gate}, {&out.up, &o.up}, {&out.act, &o.act}}) {
    put_rows(*whole, *piece, part, in.rows.size(0));
  }
  return o.y;
}

Tensor swiglu_mlp_backward_input(const Projections& proj, const Tensor& d_rows_out, const ops::Fp8Tensor& d_rows_q,
                                 const DispatchOut& in, const ops::SwigluOut& fwd, const Tensor& w_gate,
                                 const Tensor& w_up, const Tensor& w_down, const RowPart& part,
                                 ops::SwigluInputGrads& grads) {
  StageScope t(Stage::kExpertGemm);
  if (part.whole()) {
    grads = proj.experts_backward_input(d_rows_out, in.counts, fwd.gate, fwd.up, w_gate, w_up, w_down, d_rows_q);
    return grads.dx;
  }
  const ops::SwigluInputGrads g = proj.experts_backward_input(part.of(d_rows_out), part.counts, part.of(fwd.gate),
                                                              part.of(fwd.up), w_gate, w_up, w_down);
  put_rows(grads.dgate, g.dgate, part, d_rows_out.size(0));
  put_rows(grads.dup, g.dup, part, d_rows_out.size(0));
  return g.dx;
}

namespace {

// Two paired passes' steps in turn (each returns whether its pass has more), until both are
// done; `more_a` / `more_b`: whether each has a step left to start with.
template <typename A, typename B>
void in_turn(bool more_a, bool more_b, A&& step_a, B&& step_b) {
  while (more_a || more_b) {
    if (more_a) more_a = step_a();
    if (more_b) more_b = step_b();
  }
}

}  // namespace

Tensor RouterTotals::pack() const {
  const std::vector<Tensor> host = to_host({selections, prob_sum, z_sum, seq_sum});
  std::vector<double> v = host[0].to_double_vector(), p = host[1].to_double_vector();
  v.insert(v.end(), p.begin(), p.end());
  v.push_back(static_cast<double>(rows));
  v.push_back(host[2].item());
  v.push_back(static_cast<double>(seq_count));
  v.push_back(host[3].item());
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

RouterTotals RouterTotals::unpack(const Tensor& packed, int64_t E, DType stat, Device device) {
  MT_CHECK(packed.numel() == 2 * E + 4, "router totals message holds {} values, expected 2 * {} experts + 4",
           packed.numel(), E);
  MT_CHECK(packed.dtype() == DType::F64, "router totals message is {}, expected f64", dtype_name(packed.dtype()));
  const Tensor host = packed.device().is_cpu() ? packed : packed.to(Device::cpu());
  RouterTotals t;
  t.selections = host.slice(0, E).to(stat).to(device);  // to() copies
  t.prob_sum = host.slice(E, 2 * E).to(stat).to(device);
  t.rows = static_cast<int64_t>(std::llround(host.item(2 * E)));
  t.z_sum = host.slice(2 * E + 1, 2 * E + 2).to(stat).to(device);
  t.seq_count = static_cast<int64_t>(std::llround(host.item(2 * E + 2)));
  t.seq_sum = host.slice(2 * E + 3, 2 * E + 4).to(stat).to(device);
  return t;
}

void ExpertWeightGrads::backward_weight(ops::SwigluWgradRows rows, bool moe, bool accumulate,
                                        ops::SumSquaresInto squares, bool defer, int64_t layer_id, Tensor& g_gate,
                                        Tensor& g_up, Tensor& g_down, bool fp8) {
  if (!accumulate) drop();  // a step's first micro-batch: anything kept is stale
  if (moe && defer) {
    MT_CHECK(squares.out == nullptr, "layer {}: expert weight gradients deferred where their sum of squares is "
             "wanted (the step's last micro-batch must not defer)", layer_id);
    if (pending_.empty()) pending_accumulate_ = accumulate;
    if (rows.act.defined()) rows.gate = rows.up = Tensor();  // only act is read: not kept
    pending_.push_back(std::move(rows));
  } else if (!pending_.empty()) {
    pending_.push_back(std::move(rows));
    const ops::SumSquaresInto group_squares = pending_accumulate_ ? ops::SumSquaresInto{} : squares;
    if (fp8) {
      ops::grouped_swiglu_backward_weight_fp8(pending_, g_gate, g_up, g_down, pending_accumulate_, group_squares);
    } else {
      ops::grouped_swiglu_backward_weight_group(pending_, g_gate, g_up, g_down, pending_accumulate_, group_squares);
    }
    pending_.clear();
  } else {
    swiglu_weight_grads(rows, g_gate, g_up, g_down, accumulate, moe && !accumulate ? squares : ops::SumSquaresInto{},
                        fp8);
  }
}

void swiglu_weight_grads(const ops::SwigluWgradRows& rows, Tensor& g_gate, Tensor& g_up, Tensor& g_down,
                         bool accumulate, ops::SumSquaresInto squares, bool fp8) {
  if (fp8 && rows.act.defined()) {
    ops::grouped_swiglu_backward_weight_fp8({rows}, g_gate, g_up, g_down, accumulate, squares);
  } else {
    ops::grouped_swiglu_backward_weight(rows.dy, rows.x, rows.counts, rows.gate, rows.up, rows.dgate, rows.dup, g_gate,
                                        g_up, g_down, accumulate, squares, rows.act);
  }
}

Tensor swiglu_expert_reference(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down) {
  const std::vector<double> g = ops::linear_forward(x, w_gate).to_double_vector();
  const std::vector<double> u = ops::linear_forward(x, w_up).to_double_vector();
  std::vector<double> a(g.size());
  for (size_t i = 0; i < g.size(); ++i) a[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
  return ops::linear_forward(Tensor::from_vector(a, {1, w_gate.size(0)}).to(x.dtype()), w_down);
}

Tensor attention_output(const Projections& proj, const Tensor& attn_out, const Tensor& wo, const Tensor& x,
                        const BatchShape& b) {
  if (b.tensor == nullptr) return proj.forward(attn_out, wo, x);  // residual added in the GEMM epilogue
  Tensor h = b.tensor->reduce_scatter_rows(
      b.tokens(), [&](int64_t r0, int64_t n) { return proj.forward(attn_out.slice(r0, r0 + n), wo); });
  ops::add_(h, x);
  return h;
}

Tensor attention_output_backward(const Projections& proj, const Tensor& d_h, const Tensor& wo, const BatchShape& b,
                                 Tensor* d_h_all) {
  if (b.tensor == nullptr) return proj.backward_input(d_h, wo);
  return b.tensor->map_rows(d_h, [&](const Tensor& rows) { return proj.backward_input(rows, wo); }, d_h_all);
}

MoeDecoderModel::MoeDecoderModel(DecoderSpec spec, DType dtype, Device device, ModelPlacement placement)
    : spec_(spec), dtype_(dtype), device_(device), placement_(std::move(placement)) {}

void MoeDecoderModel::build(const std::function<std::unique_ptr<DecoderLayer>(int64_t id)>& make_layer) {
  MT_CHECK(placement_.ep_size >= 1 && placement_.ep_rank >= 0 && placement_.ep_rank < placement_.ep_size,
           "expert-parallel rank {} of {} is not a valid placement", placement_.ep_rank, placement_.ep_size);
  std::vector<int64_t>& ids = placement_.layers;
  const int64_t all_layers = spec_.num_layers + spec_.mtp_layers;  // the modules' layers last
  if (ids.empty()) {
    for (int64_t i = 0; i < all_layers; ++i) ids.push_back(i);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < all_layers && (i == 0 || ids[i] > ids[i - 1]),
             "placement: layer ids must ascend within [0, num_hidden_layers + MTP modules = {}), got {} at position {}",
             all_layers, ids[i], i);
    MT_CHECK(ids[i] < spec_.num_layers || placement_.head,
             "placement: layer {} is a multi-token prediction module's, which lives with the head", ids[i]);
  }
  MT_CHECK(spec_.mtp_layers == 0 || !placement_.head || (ids.size() >= static_cast<size_t>(spec_.mtp_layers) &&
                                                          ids[ids.size() - spec_.mtp_layers] == spec_.num_layers),
           "placement: the head's rank must hold every multi-token prediction module (layers {} .. {})",
           spec_.num_layers, all_layers - 1);
  const bool embed = placement_.embed, head = placement_.head;
  MT_CHECK(!spec_.tie_word_embeddings || embed == head,
           "[model].tie_word_embeddings needs the embedding and the head on one rank, but this pipeline rank holds "
           "only the {}: use the dualpipev schedule (its V puts both on rank 0) or untied embeddings",
           embed ? "embedding" : "head");
  const int64_t V = spec_.vocab_size, H = spec_.hidden_size;
  const double std = spec_.initializer_range;
  // Tensor parallelism: the embedding's and the head's vocabulary rows split over the tp
  // ranks; the final norm held whole by each (its own bucket: its gradient sums over them).
  const int64_t tp = placement_.tp_size, tp_rank = placement_.tp_rank;
  MT_CHECK(tp >= 1 && V % tp == 0, "placement: a vocabulary of {} does not split over tp = {} ranks", V, tp);
  const int64_t Vl = V / tp;
  // The embedding, final norm and head share one bucket; each layer brings its own.
  if (embed || head) {
    BucketBuilder outer("model.embed_norm_head", false), norm("model.norm", false, /*tp_replicated=*/true);
    if (embed) outer.add(&embed_, &g_embed_, {Vl, H});
    if (head) (tp > 1 ? norm : outer).add(&final_norm_w_, &g_final_norm_w_, {H});
    if (head && !spec_.tie_word_embeddings) outer.add(&lm_head_, &g_lm_head_, {Vl, H});
    buckets_.push_back(outer.build(dtype_, device_, placement_.bucket_pad));
    if (!norm.empty()) buckets_.push_back(norm.build(dtype_, device_, placement_.bucket_pad));
  }
  if (embed) params_.push_back(tp_piece({"model.embed_tokens.weight", embed_, g_embed_, true, std}, 0, tp_rank, tp));
  for (const int64_t i : ids) {
    layers_.push_back(make_layer(i));
    layers_.back()->collect_parameters(params_);
    for (ParamBucket& b : layers_.back()->buckets()) {
      b.layer = i;
      buckets_.push_back(std::move(b));
    }
    layers_.back()->buckets().clear();
    if (i >= spec_.num_layers) {  // a multi-token prediction module around this layer
      MT_CHECK(tp == 1, "multi-token prediction modules under tensor parallelism are not built yet (tp = {})", tp);
      mtp_.push_back(std::make_unique<MtpModule>(i, i - spec_.num_layers + 1, V, H, spec_.rms_norm_eps, dtype_,
                                                 device_, placement_.bucket_pad));
      mtp_.back()->collect_parameters(params_, std);
      buckets_.push_back(std::move(mtp_.back()->bucket()));
      mtp_.back()->bucket() = ParamBucket();
    }
  }
  if (head) params_.push_back({"model.norm.weight", final_norm_w_, g_final_norm_w_, false, 0.0});
  if (head && spec_.tie_word_embeddings) {
    lm_head_ = embed_;
    g_lm_head_ = g_embed_;
  } else if (head) {
    params_.push_back(tp_piece({"lm_head.weight", lm_head_, g_lm_head_, true, std}, 0, tp_rank, tp));
  }
  index_buckets(buckets_, params_);
  attach_masters(params_);
}
size_t MoeDecoderModel::local_layer(int64_t id) const {
  const std::vector<int64_t>& ids = placement_.layers;
  auto it = std::lower_bound(ids.begin(), ids.end(), id);
  MT_CHECK(it != ids.end() && *it == id, "decoder layer {} is not held by this rank (it holds {} layers)", id,
           ids.size());
  return static_cast<size_t>(it - ids.begin());
}

MtpModule* MoeDecoderModel::mtp_of(int64_t id) const {
  if (id < spec_.num_layers) return nullptr;
  for (const auto& m : mtp_) {
    if (m->layer_id() == id) return m.get();
  }
  MT_THROW("multi-token prediction layer {} has no module on this rank", id);
}

ChunkSpec MoeDecoderModel::whole() const {
  const std::vector<int64_t>& ids = placement_.layers;
  ChunkSpec c{ids.empty() ? 0 : ids.front(), ids.empty() ? 0 : ids.back() + 1, placement_.embed, placement_.head};
  MT_CHECK(c.last_layer - c.first_layer == static_cast<int64_t>(ids.size()),
           "this rank's layers are not one contiguous chunk: run them chunk by chunk");
  return c;
}

RouterTotals MoeDecoderModel::unpack_totals(const Tensor& packed) const {
  return RouterTotals::unpack(packed, spec_.num_experts, grad_dtype_for(dtype_), device_);
}

RouterTotals MoeDecoderModel::new_totals() const {
  const DType stat = grad_dtype_for(dtype_);  // router statistics are f32 on the GPU
  const int64_t E = spec_.num_experts;
  return {Tensor::zeros({E}, stat, device_), Tensor::zeros({E}, stat, device_), 0, Tensor::zeros({1}, stat, device_),
          Tensor::zeros({1}, stat, device_), 0};
}

// A chunk pass cut at the expert exchanges: each call of forward_piece / backward_piece runs
// the compute between two exchanges and starts the next one (with a dispatcher that defers
// its waits, the exchange is still in flight when the call returns).
struct MoeDecoderModel::ForwardCursor {
  const ChunkSpec& c;
  const Batch& batch;
  BatchShape b;
  ChunkActivations& a;
  RouterTotals& totals;
  ChunkPass pass;
  MicroBatchLoss* loss;  // a head chunk's
  int64_t n;       // layers to run (a head chunk's modules only when training)
  Tensor x;        // the hidden state between layers
  int64_t j = 0;   // the layer (within the chunk) being run
  int piece = 0;   // 0: attn + dispatch start, 1: dispatch finish + mlp + combine, 2: aggregate
  bool head_done = false;  // the main head ran (before the first module, which reads its input)
  Tensor mtp_ce;           // the modules' token cross-entropy sum
};

struct MoeDecoderModel::BackwardCursor {
  const ChunkSpec& c;
  const Batch& batch;
  BatchShape b;
  ChunkActivations& a;
  double aux_scale;
  bool weights_now, accumulate;
  Tensor dx;       // the gradient between layers
  int64_t j;       // the layer (within the chunk) being run, counting down
  int piece = 0;   // 0: aggregate + combine backward, 1: mlp + dispatch backward, 2: attn
  Tensor d_rows, d_mlp_in, d_topk_weight;
};

bool MoeDecoderModel::forward_piece(ForwardCursor& f, ExpertDispatcher& d) {
  const int64_t n = f.n;
  if (f.j == n) return false;
  const int64_t id = f.c.first_layer + f.j;
  const DecoderLayer& layer = *layers_[local_layer(id)];
  LayerState& s = *f.a.layers[f.j];
  switch (f.piece) {
    case 0:
      if (hooks_) hooks_->before_forward(id);
      if (MtpModule* m = mtp_of(id)) {  // the module's input from the hidden state before it
        if (!f.head_done) main_head(f);
        s.mtp = std::make_shared<MtpState>();
        f.x = m->input_forward(f.batch, f.x, *s.mtp);
      }
      if (f.pass.training && recompute_mode(id) == RecomputeMode::kFull) s.recompute_input = f.x;  // all it keeps
      layer.attn_forward(f.x, f.batch.positions, f.b, s);  // 1: attn
      if (layer.is_moe()) {  // 2: dispatch, the part that needs no host wait
        s.dispatch.fp8_rows = layer.experts_read_fp8();
        s.dispatch.tokens_q = std::exchange(s.mlp_in_q, {});
        d.dispatch_start(s.mlp_in, s.route.topk_idx, s.route.topk_weight, spec_.num_experts, s.dispatch);
      }
      break;
    case 1: {
      if (!layer.is_moe()) {  // 3: a dense MLP (under tp gathered, sliced and reduce-scattered)
        s.mlp_out = dense_mlp_forward(layer, s, f.b);
        break;
      }
      s.expert_in = d.dispatch_finish(s.dispatch);  // 2: the rows (the host waits for their count here)
      d.wait(s.dispatch);
      d.combine_start(layer.mlp_forward(s), s.dispatch);  // 3: mlp; 4: combine, under way
      break;
    }
    case 2:
      if (layer.is_moe()) {
        f.x = d.combine_finish(s.residual, s.dispatch);  // 4 + 5: residual + the weighted sum
      } else {
        StageScope t(Stage::kCombine);  // 5: residual + MLP
        f.x = tensor_ ? std::move(s.mlp_out) : s.mlp_out.clone();  // (under tp: this rank's rows, summed)
        ops::add_(f.x, s.residual);
      }
      if (layer.is_moe() && f.pass.router_stats) {  // this layer's share of the router totals (see RouterTotals)
        StageScope t(Stage::kLoss);
        ops::load_balance_accumulate(s.route.probs, s.route.topk_idx, f.totals.selections, f.totals.prob_sum);
        f.totals.rows += s.route.probs.size(0);
        if (spec_.router_z_loss_coef > 0) {
          s.z = ops::router_z_loss_forward(s.router_logits);
          ops::add_(f.totals.z_sum, s.z.loss_sum);
        }
        if (spec_.seq_aux_loss_coef > 0) {
          const ops::SeqBalanceWhole whole = whole_sequences(s.route.topk_idx, f.b);
          ops::add_(f.totals.seq_sum, ops::seq_balance_loss_sum(s.route.probs, s.route.topk_idx, f.b.batch, whole));
          f.totals.seq_count = f.b.batch;  // every layer's term counts: a sum over layers, a mean over sequences
        }
        f.a.expert_counts.push_back(s.expert_in.counts);  // read after the pass (no host wait here)
        if (router_entropy_) f.a.router_entropy.push_back(ops::router_entropy_sum(s.route.probs));
      }
      if (MtpModule* m = mtp_of(id)) mtp_loss(f, *m, *s.mtp);
      if (hooks_) hooks_->after_forward(id, f.pass.training && f.c.head && f.j + 1 == n);
      if (s.recompute_input.defined()) {  // the rest is made again before the backward
        Tensor in = std::move(s.recompute_input);
        f.a.layers[f.j] = layer.new_state();
        f.a.layers[f.j]->recompute_input = std::move(in);
      } else if (f.pass.training && recompute_mode(id) == RecomputeMode::kSelective) {
        layer.drop_recomputable(s);
        s.selective_dropped = true;
        // The expert input rows: mlp_in itself (a dense layer), or its permutation when the
        // experts are all here (rows that came over an exchange stay).
        if (!layer.is_moe() || dynamic_cast<LocalDispatcher*>(&d) != nullptr) {
          s.expert_in.rows = Tensor();
          s.rows_dropped = true;
        }
      }
      ++f.j;
      break;
  }
  f.piece = (f.piece + 1) % 3;
  return true;
}

bool MoeDecoderModel::backward_piece(BackwardCursor& g, ExpertDispatcher& d) {
  if (g.j < 0) return false;
  const int64_t id = g.c.first_layer + g.j;
  DecoderLayer& layer = *layers_[local_layer(id)];
  if (g.piece == 0) {
    if (hooks_) hooks_->before_backward(id);  // the weights are whole from here (ZeRO-3)
    recompute_before_backward(layer, g, d);
  }
  LayerState& s = *g.a.layers[g.j];
  switch (g.piece) {
    case 0: {
      if (mtp_of(id)) {  // a module's output gradient: its own loss's, and the next module's
        Tensor& own = s.mtp->d_out;
        if (g.dx.defined()) ops::add_(g.dx, own);
        else g.dx = own;
        own = Tensor();
      }
      if (layer.is_moe()) {  // 5 + 4: d weights, and d rows on their way back to the experts
        ExpertDispatcher::CombineGrads cg = d.combine_backward_weighted(g.dx, s.dispatch);
        g.d_rows = std::move(cg.d_rows);
        g.d_topk_weight = std::move(cg.d_weight);
      } else {
        g.d_rows = g.dx;  // 5: d mlp_out = d residual = dy
      }
      break;
    }
    case 1: {
      if (!layer.is_moe()) {  // 3 (and under tp the gather of dy and the reduce-scatter of d mlp_in)
        g.d_mlp_in = dense_mlp_backward_input(layer, s, g);
        g.d_rows = Tensor();
        break;
      }
      d.wait(s.dispatch);
      g.d_mlp_in = d.dispatch_backward(layer.mlp_backward_input(g.d_rows, s), s.dispatch);  // 3, 2
      g.d_rows = Tensor();
      break;
    }
    case 2: {
      if (layer.is_moe()) d.wait(s.dispatch);
      const int64_t T = g.b.rows();
      Tensor d_probs, d_logits_z;
      if (layer.is_moe()) {
        StageScope t(Stage::kRouterPermute);
        if (spec_.router_aux_loss_coef > 0) {
          d_probs = ops::load_balance_backward(g.a.totals.selections, T, g.a.totals.rows,
                                               spec_.router_aux_loss_coef * g.aux_scale);
        }
        if (spec_.router_z_loss_coef > 0) {
          d_logits_z = ops::router_z_loss_backward(
              s.route.probs, s.z.lse, spec_.router_z_loss_coef * g.aux_scale / static_cast<double>(g.a.totals.rows));
        }
        if (spec_.seq_aux_loss_coef > 0) {  // each layer's, a mean over the sequences
          Tensor d = ops::seq_balance_backward(s.route.probs, s.route.topk_idx, g.b.batch,
                                               spec_.seq_aux_loss_coef * g.aux_scale /
                                                   static_cast<double>(g.a.totals.seq_count),
                                               whole_sequences(s.route.topk_idx, g.b));
          if (d_probs.defined()) ops::add_(d_probs, d);
          else d_probs = std::move(d);
        }
      }
      g.dx = layer.attn_backward_input(g.dx, std::move(g.d_mlp_in), g.d_topk_weight, d_probs, d_logits_z,
                                       g.batch.positions, g.b, s);  // 1
      g.d_mlp_in = g.d_topk_weight = Tensor();
      MtpModule* m = mtp_of(id);
      if (m) {  // through the module's input: d h_{k-1}, plus the main head's at the first
        g.dx = m->backward_input(g.dx, *s.mtp);
        if (id == spec_.num_layers) {
          ops::add_(g.dx, g.a.d_out);
          g.a.d_out = Tensor();
        }
      }
      if (g.weights_now) {
        const bool writes = layer.writes_expert_grads(g.accumulate, defer_expert_weights_);
        layer.backward_weight(s, g.accumulate, expert_squares(id, !writes), defer_expert_weights_);
        if (m) m->backward_weight(*s.mtp, g.accumulate);
        g.a.layers[g.j].reset();
        if (hooks_) hooks_->after_backward(id);
      }
      --g.j;
      break;
    }
  }
  g.piece = (g.piece + 1) % 3;
  return true;
}

// What recomputation dropped from layer g.j's state, made again with the same kernels in the
// same order (so the same bits) before its backward.
// Full: the layer's forward again from its kept input, the expert exchange included, done
// before the backward goes on (its exchanges are not overlapped). The router totals, losses
// and expert counts were taken in the first forward and are not again; the z-loss's terms
// are state the backward reads.
// Selective: the family's norm/rotary outputs, and the expert input rows where they were a
// local permutation of the MLP input (the same dispatch again) or the MLP input itself.
void MoeDecoderModel::recompute_before_backward(const DecoderLayer& layer, BackwardCursor& g, ExpertDispatcher& d) {
  LayerState& kept = *g.a.layers[g.j];
  if (kept.selective_dropped) {
    StageScope t(Stage::kNorms);
    layer.recompute_dropped(kept, g.batch.positions);
    if (kept.rows_dropped && layer.is_moe()) {
      DispatchState again;
      again.fp8_rows = layer.experts_read_fp8();  // the rows as the forward's: FP8 codes' values
      kept.expert_in.rows = d.dispatch(kept.mlp_in, kept.route.topk_idx, spec_.num_experts, again).rows;
    } else if (kept.rows_dropped) {
      kept.expert_in.rows = dense_rows(kept.mlp_in);
    }
    kept.selective_dropped = kept.rows_dropped = false;
  }
  if (!kept.recompute_input.defined()) return;
  std::unique_ptr<LayerState> fresh = layer.new_state();
  LayerState& s = *fresh;
  layer.attn_forward(kept.recompute_input, g.batch.positions, g.b, s);
  if (layer.is_moe()) {
    s.dispatch.fp8_rows = layer.experts_read_fp8();
    s.dispatch.tokens_q = std::exchange(s.mlp_in_q, {});
    d.dispatch_start(s.mlp_in, s.route.topk_idx, s.route.topk_weight, spec_.num_experts, s.dispatch);
    s.expert_in = d.dispatch_finish(s.dispatch);
    d.wait(s.dispatch);
    d.combine_start(layer.mlp_forward(s), s.dispatch);
    d.combine_finish(s.residual, s.dispatch);
    if (spec_.router_z_loss_coef > 0) s.z = ops::router_z_loss_forward(s.router_logits);
  } else {
    s.mlp_out = dense_mlp_forward(layer, s, g.b);
  }
  g.a.layers[g.j] = std::move(fresh);
}

// Under tensor parallelism the dense MLP's gather, its GEMMs and its reduce-scatter go round
// one ring, slice by slice (TensorParallel::gather_map_reduce_rows); every row's activations
// are kept for the backward as they are made.
Tensor MoeDecoderModel::dense_mlp_forward(const DecoderLayer& layer, LayerState& s, const BatchShape& b) const {
  if (!tensor_) {
    s.expert_in = {s.mlp_in, dense_counts(b.tokens())};
    return layer.mlp_forward(s);
  }
  const int64_t n = s.mlp_in.size(0);
  s.expert_in.counts = dense_counts(b.tokens());
  const Tensor& counts = dense_counts(n);
  return tensor_->gather_map_reduce_rows(s.mlp_in, s.expert_in.rows, [&](int64_t first, const Tensor&) {
    return layer.mlp_forward(s, {first, n, counts});
  });
}

Tensor MoeDecoderModel::dense_mlp_backward_input(const DecoderLayer& layer, LayerState& s, BackwardCursor& g) const {
  if (!tensor_) return layer.mlp_backward_input(g.d_rows, s);
  const int64_t n = g.d_rows.size(0);
  const Tensor& counts = dense_counts(n);
  Tensor d_all;  // every row's d mlp_out, filled slice by slice (the weight gradients read it whole)
  return tensor_->gather_map_reduce_rows(g.d_rows, d_all, [&](int64_t first, const Tensor&) {
    return layer.mlp_backward_input(d_all, s, {first, n, counts});
  });
}

void MoeDecoderModel::set_context_group(Communicator* group) {
  context_ = group != nullptr && group->size() > 1 ? std::make_unique<ContextAttention>(*group) : nullptr;
}

void MoeDecoderModel::set_tensor_group(Communicator* group) {
  const int64_t n = group != nullptr ? group->size() : 1;
  MT_CHECK(n == placement_.tp_size && (group == nullptr || group->rank() == placement_.tp_rank),
           "tensor parallelism: a tp group of {} ranks (this one rank {}) for a model built as piece {} of {}", n,
           group != nullptr ? group->rank() : 0, placement_.tp_rank, placement_.tp_size);
  tensor_ = n > 1 ? std::make_unique<TensorParallel>(*group) : nullptr;
}

int64_t BatchShape::rows() const { return tensor != nullptr ? tensor->slice_rows(tokens()) : tokens(); }

BatchShape MoeDecoderModel::shape_of(const Batch& batch) const {
  MT_CHECK(placement_.tp_size == 1 || tensor_ != nullptr,
           "a model built as tensor-parallel piece {} of {} has no tp group (set_tensor_group)", placement_.tp_rank,
           placement_.tp_size);
  BatchShape b{batch.batch, batch.seq, batch.segment_ids};
  b.tensor = tensor_.get();
  if (batch.places.defined()) {
    MT_CHECK(context_ != nullptr, "a batch of context-parallel chunks (places) on a model with no CP group");
    b.places = batch.places;
    b.context = context_.get();
  }
  return b;
}

ops::SeqBalanceWhole MoeDecoderModel::whole_sequences(const Tensor& topk_idx, const BatchShape& b) const {
  if (b.context == nullptr) return {};
  return b.context->whole_sequences(topk_idx, b.batch, b.seq, spec_.num_experts);
}

void MoeDecoderModel::set_recompute(const std::vector<int64_t>& layers, RecomputeMode mode) {
  recompute_.assign(static_cast<size_t>(spec_.num_layers), RecomputeMode::kNone);
  for (int64_t id : layers) {
    MT_CHECK(id >= 0 && id < spec_.num_layers, "recompute: layer {} is not one of the model's decoder layers 0..{}",
             id, spec_.num_layers - 1);
    recompute_[static_cast<size_t>(id)] = mode;
  }
}

MoeDecoderModel::ForwardCursor MoeDecoderModel::begin_forward(const ChunkSpec& c, const Batch& batch, const Tensor& x,
                                                          ChunkActivations& a, RouterTotals& totals,
                                                          const ChunkPass& pass, MicroBatchLoss* loss) {
  const int64_t end = run_end(c, pass.training);
  a.layers.clear();
  for (int64_t id = c.first_layer; id < end; ++id) a.layers.push_back(layers_[local_layer(id)]->new_state());
  ForwardCursor f{c, batch, shape_of(batch), a, totals, pass, loss,
                  end - c.first_layer, x};
  if (c.embed) {
    MT_CHECK(placement_.embed, "an embed chunk on a rank without the embedding");
    if (hooks_) hooks_->before_forward(-1);
    if (tensor_) {  // every row's lookup in this rank's vocabulary rows, summed into this rank's rows
      const ops::VocabShard shard = tensor_->vocab(spec_.vocab_size);
      f.x = tensor_->reduce_scatter_rows(batch.inputs.numel(), [&](int64_t r0, int64_t n) {
        return ops::embedding_forward(batch.inputs.slice(r0, r0 + n), embed_, shard);
      });
    } else {
      f.x = ops::embedding_forward(batch.inputs, embed_);
    }
  }
  return f;
}

// The main model's loss: the final norm, the head and the cross-entropy.
void MoeDecoderModel::main_head(ForwardCursor& f) {
  MT_CHECK(placement_.head && f.loss != nullptr, "a head chunk needs the head and somewhere to put the loss");
  f.head_done = true;
  // A chunk with the embedding waited for the head's weights there (one bucket group); a
  // pipeline's head chunk without it waits here (FSDP's overlapped updates).
  if (hooks_ && !f.c.embed) hooks_->before_forward(-1);
  ChunkActivations& a = f.a;
  const Batch& batch = f.batch;
  const ChunkPass& pass = f.pass;
  MicroBatchLoss& out = *f.loss;
  a.final_in = f.x;
  {
    StageScope t(Stage::kNorms);
    a.final_norm = ops::rmsnorm_forward(f.x, final_norm_w_, spec_.rms_norm_eps);
  }
  const Tensor& h = a.final_norm.y;
  if (tensor_) {
    Tensor d_norm = vocab_parallel_head(f, h);
    if (!pass.training) return;
    StageScope t(Stage::kNorms);
    ops::rmsnorm_backward_weight(d_norm, a.final_in, a.final_norm.rstd, g_final_norm_w_, pass.head_accumulate);
    a.d_out = ops::rmsnorm_backward_input(d_norm, a.final_in, final_norm_w_, a.final_norm.rstd);
    return;
  }
  if (!pass.training) {
    StageScope t(Stage::kLoss);
    out.on_device.ce_sum = ops::linear_cross_entropy(h, lm_head_, batch.targets, 1.0, nullptr, nullptr).loss_sum;
    if (hooks_) hooks_->after_forward(-1, false);
    return;
  }
  // Head: logits = norm(x) W^T and cross-entropy, forward and backward in one chunked pass,
  // so the head's gradients are made here and the chunk's backward starts from a.d_out.
  if (hooks_) hooks_->before_backward(-1);
  const int64_t T = h.shape()[0];
  if (pass.head_rows >= 0 && pass.head_rows < T) {
    // A pipeline's head helper takes the last rows (PipelineExecutor): this rank's rows now,
    // the final norm's backward once the helper's gradient is back (finish_head).
    MT_CHECK(spec_.mtp_layers == 0, "a pipeline head helper with multi-token prediction modules");
    const int64_t k = pass.head_rows;
    a.d_norm = Tensor::empty(h.shape(), h.dtype(), h.device());
    a.head_tail = h.slice(k, T);
    StageScope t(Stage::kLoss);
    Tensor d_kept;
    ops::LinearCrossEntropyOut head =
        ops::linear_cross_entropy(h.slice(0, k), lm_head_, batch.targets.view({T}).slice(0, k), pass.ce_scale,
                                  &d_kept, &g_lm_head_, /*chunk_rows=*/0, pass.head_accumulate);
    out.on_device.ce_sum = head.loss_sum;
    if (k > 0) a.d_norm.slice(0, k).copy_from(d_kept);
    return;
  }
  Tensor d_norm;
  {
    StageScope t(Stage::kLoss);
    ops::LinearCrossEntropyOut head = ops::linear_cross_entropy(h, lm_head_, batch.targets, pass.ce_scale, &d_norm,
                                                                &g_lm_head_, /*chunk_rows=*/0, pass.head_accumulate);
    out.on_device.ce_sum = head.loss_sum;
  }
  {
    StageScope t(Stage::kNorms);
    ops::rmsnorm_backward_weight(d_norm, a.final_in, a.final_norm.rstd, g_final_norm_w_, pass.head_accumulate);
    a.d_out = ops::rmsnorm_backward_input(d_norm, a.final_in, final_norm_w_, a.final_norm.rstd);
  }
}

void MoeDecoderModel::finish_head(ChunkActivations& a, const Tensor& d_tail, bool accumulate) {
  MT_CHECK(a.d_norm.defined() && a.head_tail.defined(), "finish_head: the head chunk's forward kept no helper rows");
  const int64_t T = a.d_norm.shape()[0], k = T - a.head_tail.shape()[0];
  MT_CHECK(d_tail.shape() == a.head_tail.shape(), "finish_head: the helper's gradient is {}, expected {}",
           shape_str(d_tail.shape()), shape_str(a.head_tail.shape()));
  a.d_norm.slice(k, T).copy_from(d_tail);
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(a.d_norm, a.final_in, a.final_norm.rstd, g_final_norm_w_, accumulate);
  a.d_out = ops::rmsnorm_backward_input(a.d_norm, a.final_in, final_norm_w_, a.final_norm.rstd);
  a.d_norm = a.head_tail = Tensor();
}

Tensor MoeDecoderModel::head_weight() {
  MT_CHECK(placement_.head, "head_weight: this rank holds no head");
  return lm_head_;
}

Tensor MoeDecoderModel::head_weight_grad() {
  MT_CHECK(placement_.head, "head_weight_grad: this rank holds no head");
  return g_lm_head_;
}

// Under tensor parallelism each rank multiplies every row (gathered) by its vocabulary rows of
// the head: logits [T, V/tp]. Per row, its columns' log-sum-exp and the target's logit where
// it holds the target, gathered over the tp ranks (2T numbers a rank), give the whole rows'
// lse; the rank counts the loss of its own slice of rows (Batch::slice_targets: the step's
// loss sums over the stage's ranks) and makes its columns' gradient for every row. d h is
// every row's partial sum, reduce-scattered back to this rank's rows.
Tensor MoeDecoderModel::vocab_parallel_head(ForwardCursor& f, const Tensor& h) {
  const Batch& batch = f.batch;
  MT_CHECK(batch.slice_targets.defined(),
           "tensor parallelism: the batch has no slice_targets (a loader without TensorSliceLoader)");
  const ops::VocabShard shard = tensor_->vocab(spec_.vocab_size);
  if (f.pass.training && hooks_) hooks_->before_backward(-1);
  StageScope t(Stage::kLoss);
  const int64_t T = batch.targets.numel();
  Tensor h_all;
  const Tensor logits =
      tensor_->map_rows(h, [&](const Tensor& rows) { return ops::linear_forward(rows, lm_head_); }, &h_all);
  const ops::VocabShardStats stats = ops::vocab_shard_stats(logits, batch.targets, shard);
  const Tensor lse = tensor_->gather_rows(stats.lse.view({1, T}));
  const Tensor target_logit = tensor_->gather_rows(stats.target_logit.view({1, T}));
  ops::CrossEntropyOut ce = ops::vocab_parallel_loss(lse, target_logit, batch.slice_targets);
  f.loss->on_device.ce_sum = ce.loss_sum;
  if (!f.pass.training) {
    if (hooks_) hooks_->after_forward(-1, false);
    return Tensor();
  }
  const Tensor d_logits = ops::vocab_shard_backward(logits, batch.targets, ce.lse, shard, f.pass.ce_scale);
  ops::linear_backward_weight(d_logits, h_all, g_lm_head_, f.pass.head_accumulate);
  return tensor_->reduce_scatter_rows(
      T, [&](int64_t r0, int64_t n) { return ops::linear_backward_input(d_logits.slice(r0, r0 + n), lm_head_); });
}

// Module k's loss, weighted mtp_loss_weight / D and divided as the main cross-entropy; its
// head's gradients are made with it (the layer's gradient buffers are needed from here on).
void MoeDecoderModel::mtp_loss(ForwardCursor& f, MtpModule& m, MtpState& s) {
  const double scale = f.pass.ce_scale * spec_.mtp_loss_weight / static_cast<double>(spec_.mtp_layers);
  if (f.pass.training && hooks_) hooks_->before_backward(m.layer_id());
  Tensor ce = m.loss_forward(f.x, f.batch, f.pass.training, scale, f.pass.head_accumulate, s);
  if (f.mtp_ce.defined()) ops::add_(f.mtp_ce, ce);
  else f.mtp_ce = ce;
}

Tensor MoeDecoderModel::end_forward(ForwardCursor& f) {
  if (!f.c.head) return f.x;
  if (!f.head_done) main_head(f);
  MicroBatchLoss& out = *f.loss;
  out.targets = f.batch.num_targets;
  // The router totals are final only now, the modules' layers counted.
  router_losses(f.totals, out);
  f.a.totals = f.totals;
  if (f.mtp_ce.defined()) {  // a term of the step's mean, as the trainer averages terms over micro-batches
    const double w = spec_.mtp_loss_weight / static_cast<double>(spec_.mtp_layers) * f.pass.ce_scale /
                     f.pass.aux_scale;
    out.on_device.terms.push_back({"mtp_loss", /*global=*/false, {f.mtp_ce},
                                   [w](const std::vector<Tensor>& host) { return w * host[0].item(); }});
  }
  return Tensor();
}

MoeDecoderModel::BackwardCursor MoeDecoderModel::begin_backward(const ChunkSpec& c, const Batch& batch, const Tensor& dy,
                                                            ChunkActivations& a, double aux_scale, bool weights_now,
                                                            bool accumulate) {
  const int64_t n = static_cast<int64_t>(a.layers.size());
  // A head chunk whose modules ran starts from the last module's loss (backward_piece adds
  // each module's own, and the main head's a.d_out below the first).
  const bool modules = c.head && n > 0 && c.first_layer + n > spec_.num_layers;
  BackwardCursor g{c, batch, shape_of(batch), a, aux_scale, weights_now,
                   accumulate, c.head ? (modules ? Tensor() : a.d_out) : dy, n - 1};
  MT_CHECK(g.dx.defined() || modules, "backward of layers [{}, {}): no output gradient", c.first_layer, c.last_layer);
  if (!modules) a.d_out = Tensor();
  return g;
}

Tensor MoeDecoderModel::end_backward(BackwardCursor& g) {
  if (!g.c.embed) return g.dx;
  g.a.d_embed_out = dense_rows(g.dx);  // every row's, under tensor parallelism
  if (g.weights_now) {
    backward_chunk_weight(ChunkSpec{g.c.first_layer, g.c.first_layer, true, false}, g.batch, g.a, g.accumulate);
    if (hooks_) hooks_->after_backward(-1);
  }
  return Tensor();
}

Tensor MoeDecoderModel::forward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& x, ExpertDispatcher& d,
                                    ChunkActivations& a, RouterTotals& totals, const ChunkPass& pass,
                                    MicroBatchLoss* loss) {
  ForwardCursor f = begin_forward(c, batch, x, a, totals, pass, loss);
  while (forward_piece(f, d)) {
  }
  return end_forward(f);
}

Tensor MoeDecoderModel::backward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ExpertDispatcher& d,
                                     ChunkActivations& a, double aux_scale, bool weights_now, bool accumulate) {
  BackwardCursor g = begin_backward(c, batch, dy, a, aux_scale, weights_now, accumulate);
  while (backward_piece(g, d)) {
  }
  return end_backward(g);
}

std::pair<Tensor, Tensor> MoeDecoderModel::forward_backward_overlapped(
    const ChunkSpec& fc, const Batch& fbatch, const Tensor& x, ChunkActivations& fa, RouterTotals& totals,
    const ChunkPass& pass, MicroBatchLoss* loss, const ChunkSpec& bc, const Batch& bbatch, const Tensor& dy,
    ChunkActivations& ba, ExpertDispatcher& d) {
  ForwardCursor f = begin_forward(fc, fbatch, x, fa, totals, pass, loss);
  BackwardCursor g = begin_backward(bc, bbatch, dy, ba, pass.aux_scale, /*weights_now=*/false, false);
  // Alternate steps of the two passes, each step's compute running while the exchange that
  // the other pass's last step started is in flight. A step ends where it starts an
  // exchange: the forward's at the dispatch (after attention) and the combine (after the
  // MLP), the backward's at the dispatch backward (after the MLP) and the combine backward
  // (after attention, starting the next layer); a piece that starts none (the forward's
  // residual sum, the backward's attention) runs on into the next. So the GPU runs the
  // forward's attention, the backward's MLP, the forward's MLP, the backward's attention,
  // and so on, and the host waits for a dispatch's row count (dispatch_finish, at the
  // forward's MLP step) with the backward's MLP queued ahead of it.
  const bool more_b = backward_piece(g, d);  // the first combine backward starts
  in_turn(true, more_b, [&] { return forward_step(f, d); }, [&] { return backward_step(g, d); });
  Tensor out = end_forward(f);
  return {out, end_backward(g)};
}

// A forward step ends at the dispatch (after attention) or the combine (after the MLP); the
// residual sum, which starts none, runs on into the next layer's attention.
bool MoeDecoderModel::forward_step(ForwardCursor& f, ExpertDispatcher& d) {
  bool more;
  do more = forward_piece(f, d);
  while (more && f.piece == 0);
  return more;
}

// A backward step ends at the dispatch backward (after the MLP) or, the attention done, at
// the next layer's combine backward.
bool MoeDecoderModel::backward_step(BackwardCursor& g, ExpertDispatcher& d) {
  bool more;
  do more = backward_piece(g, d);
  while (more && g.piece == 0);
  return more;
}

// Two forwards in turn, step by step: each one's exchange in flight under the other's
// attention or MLP (the first's dispatch host wait with the second's attention queued).
std::pair<Tensor, Tensor> MoeDecoderModel::forwards_overlapped(const ChunkSpec& c1, const Batch& b1, const Tensor& x1,
                                                               ChunkActivations& a1, RouterTotals& t1,
                                                               MicroBatchLoss* loss1, const ChunkSpec& c2,
                                                               const Batch& b2, const Tensor& x2, ChunkActivations& a2,
                                                               RouterTotals& t2, MicroBatchLoss* loss2,
                                                               const ChunkPass& pass, ExpertDispatcher& d) {
  ForwardCursor f1 = begin_forward(c1, b1, x1, a1, t1, pass, loss1);
  ForwardCursor f2 = begin_forward(c2, b2, x2, a2, t2, pass, loss2);
  in_turn(true, true, [&] { return forward_step(f1, d); }, [&] { return forward_step(f2, d); });
  Tensor out1 = end_forward(f1);
  return {out1, end_forward(f2)};
}

// Two input gradients in turn, as two forwards: both first combine backwards start, then
// each one's MLP and attention alternate with the other's.
std::pair<Tensor, Tensor> MoeDecoderModel::backwards_overlapped(const ChunkSpec& c1, const Batch& b1,
                                                                const Tensor& dy1, ChunkActivations& a1,
                                                                const ChunkSpec& c2, const Batch& b2,
                                                                const Tensor& dy2, ChunkActivations& a2,
                                                                double aux_scale, ExpertDispatcher& d) {
  BackwardCursor g1 = begin_backward(c1, b1, dy1, a1, aux_scale, /*weights_now=*/false, false);
  BackwardCursor g2 = begin_backward(c2, b2, dy2, a2, aux_scale, /*weights_now=*/false, false);
  const bool more1 = backward_piece(g1, d), more2 = backward_piece(g2, d);
  in_turn(more1, more2, [&] { return backward_step(g1, d); }, [&] { return backward_step(g2, d); });
  Tensor dx1 = end_backward(g1);
  return {dx1, end_backward(g2)};
}

void MoeDecoderModel::backward_chunk_weight(const ChunkSpec& c, const Batch& batch, ChunkActivations& a,
                                          bool accumulate, bool defer_experts) {
  for (int64_t j = run_end(c, /*training=*/true) - c.first_layer; j-- > 0;) {
    const int64_t id = c.first_layer + j;
    DecoderLayer& layer = *layers_[local_layer(id)];
    const bool writes = layer.writes_expert_grads(accumulate, defer_experts);
    layer.backward_weight(*a.layers[j], accumulate, expert_squares(id, !writes), defer_experts);
    if (MtpModule* m = mtp_of(id)) m->backward_weight(*a.layers[j]->mtp, accumulate);
    a.layers[j].reset();
  }
  if (c.embed) {
    // Tied: the head has already written (or added to) this gradient.
    ops::embedding_backward_weight(batch.inputs, a.d_embed_out, g_embed_, accumulate || spec_.tie_word_embeddings,
                                   tensor_ ? tensor_->vocab(spec_.vocab_size) : ops::VocabShard{});
    a.d_embed_out = Tensor();
  }
}

Tensor MoeDecoderModel::forward_logits(const Tensor& ids, const Tensor& positions, const BatchShape& b,
                                     ExpertDispatcher& dispatcher) {
  MT_CHECK(!tensor_, "logits under tensor parallelism are not built (each rank holds some vocabulary columns): "
           "convert the checkpoint and score or sample it in one process");
  Batch batch;
  batch.inputs = ids;
  batch.positions = positions;
  batch.segment_ids = b.segment_ids;
  batch.batch = b.batch;
  batch.seq = b.seq;
  ChunkSpec c = whole();
  c.head = false;
  ChunkActivations a;
  RouterTotals totals = new_totals();
  ChunkPass logits_only;
  logits_only.training = false;
  logits_only.router_stats = false;  // no loss reads them here
  Tensor x = forward_chunk(c, batch, Tensor(), dispatcher, a, totals, logits_only, nullptr);
  a = ChunkActivations();
  Tensor h;
  {
    StageScope t(Stage::kNorms);
    h = ops::rmsnorm_forward(x, final_norm_w_, spec_.rms_norm_eps).y;
  }
  StageScope t(Stage::kLoss);
  Tensor logits = ops::linear_forward(h, lm_head_);
  if (hooks_) hooks_->after_forward(-1, false);
  return logits;
}

Tensor MoeDecoderModel::reference_forward(const Tensor& ids, const Tensor& positions, const BatchShape& b) const {
  MT_CHECK(placement_.tp_size == 1, "reference_forward needs the whole model in one process (tp = {})",
           placement_.tp_size);
  Tensor x = ops::embedding_forward(ids, embed_);
  for (const auto& layer : layers_) {
    if (layer->layer_id() < spec_.num_layers) x = layer->reference_forward(x, positions, b);  // not the modules'
  }
  Tensor n = ops::rmsnorm_forward(x, final_norm_w_, spec_.rms_norm_eps).y;
  return ops::linear_forward(n, lm_head_);
}

// The router losses over the rows of all MoE layers (HF concatenates every layer's gate
// logits before computing the load-balancing loss, so n_e and P_e are totals over layers
// and R = moe_layers * T). The cross-entropy is the head's (linear_cross_entropy).
void MoeDecoderModel::router_losses(RouterTotals& totals, MicroBatchLoss& out) const {
  StageScope t(Stage::kLoss);
  const int64_t E = spec_.num_experts;
  int64_t assumed_rows = 0;  // with a data group: the global count, checked at the step's end
  if (data_group_ != nullptr) {
    // The load-balancing loss is a product of batch means: every rank needs the global ones.
    // One all-reduce of both statistics and no host wait (the host never waits inside a
    // pass: MicroBatchLoss). The global row count is this rank's times the data ranks: every
    // data rank runs micro-batches of the same B x S tokens through the same layers; the
    // reduced selections (K per row) say at the step's end whether that held.
    Tensor both = Tensor::empty({2 * E}, totals.selections.dtype(), totals.selections.device());
    Tensor sel = both.slice(0, E), prob = both.slice(E, 2 * E);
    sel.copy_from(totals.selections);
    prob.copy_from(totals.prob_sum);
    data_group_->all_reduce(both);
    int64_t ranks = data_group_->size();
    if (bridge_ != nullptr && bridge_->crosses()) {  // and over the other replica groups
      bridge_->all_reduce(both);
      ranks *= bridge_->replicas();
    }
    totals.selections.copy_from(sel);
    totals.prob_sum.copy_from(prob);
    totals.rows *= ranks;
    // The sequence-wise loss: a mean over every data rank's sequences (the cp ranks of a
    // place share theirs, each adding its part of every one).
    totals.seq_count *= ranks / (context_ ? context_->size() : 1);
    assumed_rows = totals.rows;
  }
  if (totals.rows > 0) {
    const double R = static_cast<double>(totals.rows);
    // The load-balancing loss is E * sum_e (n_e / R)(P_e / R), of the batch's totals (the
    // same on every data rank); the z-loss sums over this rank's rows, a share of the batch's.
    // The totals are final here: the backward only reads them.
    const double aux_factor = spec_.router_aux_loss_coef * static_cast<double>(E) / (R * R);
    const int64_t K = spec_.experts_per_token;
    out.on_device.terms.push_back({"aux_loss", /*global=*/true, {totals.selections, totals.prob_sum},
                                   [aux_factor, assumed_rows, K](const std::vector<Tensor>& host) {
                                     const std::vector<double> n = host[0].to_double_vector();
                                     const std::vector<double> p = host[1].to_double_vector();
                                     double dotp = 0, selected = 0;
                                     for (size_t e = 0; e < n.size(); ++e) {
                                       dotp += n[e] * p[e];
                                       selected += n[e];
                                     }
                                     // (f32 counts are exact below 2^24 per expert; past that, within rounding)
                                     const double want = static_cast<double>(assumed_rows * K);
                                     MT_CHECK(assumed_rows == 0 || std::abs(selected - want) <= 1e-6 * want,
                                              "router losses: the data ranks routed {} rows in all, but {} were "
                                              "assumed (the same micro-batch tokens on every data rank)",
                                              selected / static_cast<double>(K), assumed_rows);
                                     return aux_factor * dotp;
                                   }});
    if (spec_.seq_aux_loss_coef > 0 && totals.seq_count > 0) {  // this rank's sequences: a share
      const double seq_factor = spec_.seq_aux_loss_coef / static_cast<double>(totals.seq_count);
      out.on_device.terms.push_back({"seq_aux_loss", /*global=*/false, {totals.seq_sum},
                                     [seq_factor](const std::vector<Tensor>& host) {
                                       return seq_factor * host[0].item();
                                     }});
    }
    if (spec_.router_z_loss_coef > 0) {
      const double z_factor = spec_.router_z_loss_coef / R;
      out.on_device.terms.push_back({"z_loss", /*global=*/false, {totals.z_sum},
                                     [z_factor](const std::vector<Tensor>& host) { return z_factor * host[0].item(); }});
    }
  }
}

LossTerms MoeDecoderModel::loss_terms() const {
  LossTerms t{{"aux_loss", 0.0, true}};
  if (spec_.router_z_loss_coef > 0) t.push_back({"z_loss", 0.0, false});
  if (spec_.seq_aux_loss_coef > 0) t.push_back({"seq_aux_loss", 0.0, false});
  if (spec_.mtp_layers > 0) t.push_back({"mtp_loss", 0.0, false});
  return t;
}

std::vector<NamedBuffer> MoeDecoderModel::buffers() {
  std::vector<NamedBuffer> out;
  for (auto& l : layers_) {
    if (Tensor* b = l->routing_bias()) {
      out.push_back({fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", l->layer_id()), *b});
    }
  }
  return out;
}

// Aux-loss-free balancing (DeepSeek-V3 §2.1.2): an expert that got more than the mean load
// is chosen less from the next step on, one that got less is chosen more; the weights a
// token gives its experts stay the router's, so the gradient never sees the bias.
void MoeDecoderModel::balance_experts(const std::vector<std::vector<int64_t>>& expert_counts) {
  const double speed = spec_.router_bias_update_speed;
  if (speed <= 0) return;
  // Every layer's steps in one host vector, uploaded once (one copy a step, not one a layer).
  std::vector<Tensor*> biases;
  std::vector<float> steps;
  size_t k = 0;
  for (auto& l : layers_) {
    if (!l->is_moe()) continue;
    MT_CHECK(k < expert_counts.size(), "balance_experts: {} expert loads for more MoE layers (layer {})",
             expert_counts.size(), l->layer_id());
    const std::vector<int64_t>& load = expert_counts[k++];
    Tensor* bias = l->routing_bias();
    if (bias == nullptr) continue;
    MT_CHECK(static_cast<int64_t>(load.size()) == bias->numel(),
             "balance_experts: layer {} has {} experts' loads for a routing bias of {}", l->layer_id(), load.size(),
             bias->numel());
    double total = 0;
    for (int64_t c : load) total += static_cast<double>(c);
    const double mean = total / static_cast<double>(load.size());
    for (int64_t c : load) {
      const double d = static_cast<double>(c);
      steps.push_back(static_cast<float>(d < mean ? speed : d > mean ? -speed : 0.0));
    }
    biases.push_back(bias);
  }
  MT_CHECK(k == expert_counts.size(), "balance_experts: {} expert loads for {} MoE layers", expert_counts.size(), k);
  if (biases.empty()) return;
  const Tensor all = Tensor::from_vector(steps, {static_cast<int64_t>(steps.size())}).to(biases.front()->device());
  int64_t at = 0;
  for (Tensor* bias : biases) {
    ops::add_(*bias, all.slice(at, at + bias->numel()));
    at += bias->numel();
  }
}

void MicroBatchLoss::read_device_values() {
  OnDevice& d = on_device;
  std::vector<Tensor> pending{d.ce_sum};
  for (const DeviceTerm& t : d.terms) pending.insert(pending.end(), t.inputs.begin(), t.inputs.end());
  const size_t counts_at = pending.size();
  pending.insert(pending.end(), d.expert_counts.begin(), d.expert_counts.end());
  const size_t entropy_at = pending.size();
  pending.insert(pending.end(), d.router_entropy.begin(), d.router_entropy.end());
  const std::vector<Tensor> host = to_host(pending);  // one wait for everything
  if (host[0].defined()) ce_sum += host[0].item();
  size_t at = 1;
  for (const DeviceTerm& t : d.terms) {
    const std::vector<Tensor> in(host.begin() + static_cast<std::ptrdiff_t>(at),
                                 host.begin() + static_cast<std::ptrdiff_t>(at + t.inputs.size()));
    at += t.inputs.size();
    add_loss_term(terms, {t.name, t.value(in), t.global});
  }
  for (size_t k = counts_at; k < entropy_at; ++k) expert_counts.push_back(host[k].to_vector<int64_t>());
  for (size_t k = entropy_at; k < host.size(); ++k) router_entropy.push_back(host[k].item());
  d = OnDevice();
}

double term_value(const LossTerms& terms, const std::string& name) {
  for (const LossTerm& t : terms) {
    if (t.name == name) return t.value;
  }
  return 0.0;
}

double MicroBatchLoss::term(const std::string& name) const { return term_value(terms, name); }

void add_loss_term(LossTerms& into, const LossTerm& t, double divisor) {
  for (LossTerm& have : into) {
    if (have.name == t.name) {
      have.value += t.value / divisor;
      return;
    }
  }
  into.push_back({t.name, t.value / divisor, t.global});
}

double total_of(const LossTerms& terms) {
  double sum = 0;
  for (const LossTerm& t : terms) sum += t.value;
  return sum;
}

MicroBatchLoss MoeDecoderModel::forward_loss(const Batch& batch, ExpertDispatcher& dispatcher) {
  ChunkActivations a;
  RouterTotals totals = new_totals();
  MicroBatchLoss out;
  forward_chunk(whole(), batch, Tensor(), dispatcher, a, totals, ChunkPass{false}, &out);
  out.on_device.expert_counts = std::move(a.expert_counts);
  out.on_device.router_entropy = std::move(a.router_entropy);
  out.read_device_values();
  return out;
}

void MoeDecoderModel::drop_deferred_expert_weights() {
  for (auto& layer : layers_) layer->drop_deferred_expert_weights();
}

MicroBatchLoss MoeDecoderModel::forward_backward(const Batch& batch, ExpertDispatcher& d, double ce_scale,
                                               double aux_scale, bool accumulate_grads, bool defer_expert_weights) {
  const ChunkSpec c = whole();
  ChunkActivations a;
  RouterTotals totals = new_totals();
  MicroBatchLoss out;
  forward_chunk(c, batch, Tensor(), d, a, totals, ChunkPass{true, ce_scale, aux_scale, accumulate_grads}, &out);
  defer_expert_weights_ = defer_expert_weights;
  try {
    backward_chunk(c, batch, Tensor(), d, a, aux_scale, /*weights_now=*/true, accumulate_grads);
  } catch (...) {  // a broken micro-batch: nothing it or the ones before it kept is to be paired
    defer_expert_weights_ = false;
    drop_deferred_expert_weights();
    throw;
  }
  defer_expert_weights_ = false;
  out.on_device.expert_counts = std::move(a.expert_counts);
  out.on_device.router_entropy = std::move(a.router_entropy);
  out.read_device_values();  // the micro-batch's one host wait, its work all queued
  return out;
}

}  // namespace moetrain
