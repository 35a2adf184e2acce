#include "engine/models/qwen3_moe.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "engine/telemetry/stage_timer.h"

namespace moetrain {

// ---- decoder layer ---------------------------------------------------------------------

Qwen3MoeDecoderLayer::Qwen3MoeDecoderLayer(const Qwen3MoeConfig& cfg, int64_t layer_id, DType dtype, Device device,
                                           const ModelPlacement& placement)
    : cfg_(cfg), id_(layer_id), moe_(cfg.is_moe_layer(layer_id)) {
  const int64_t H = cfg.hidden_size, hd = cfg.head_dim;
  const int64_t qd = cfg.num_attention_heads * hd, kvd = cfg.num_key_value_heads * hd;
  int64_t E = 1;
  if (moe_) {
    MT_CHECK(cfg.num_experts % placement.ep_size == 0,
             "[model].num_experts = {} cannot be split evenly over [parallel].ep = {} expert-parallel ranks",
             cfg.num_experts, placement.ep_size);
    E = cfg.num_experts / placement.ep_size;
    first_expert_ = placement.ep_rank * E;
  }
  inter_ = moe_ ? cfg.moe_intermediate_size : cfg.intermediate_size;
  // Attention and router weights are replicated over expert-parallel ranks, experts are
  // not: they go into separate buckets (a dense MLP stays with the attention).
  const std::string name = fmt::format("model.layers.{}", layer_id);
  BucketBuilder dense(name, false), experts(name + ".experts", true);
  dense.add(&ln1_w_, &g_ln1_w_, {H});
  dense.add(&wq_, &g_wq_, {qd, H});
  dense.add(&wk_, &g_wk_, {kvd, H});
  dense.add(&wv_, &g_wv_, {kvd, H});
  dense.add(&wo_, &g_wo_, {H, qd});
  dense.add(&q_norm_w_, &g_q_norm_w_, {hd});
  dense.add(&k_norm_w_, &g_k_norm_w_, {hd});
  dense.add(&ln2_w_, &g_ln2_w_, {H});
  if (moe_) dense.add(&gate_w_, &g_gate_w_, {cfg.num_experts, H});
  BucketBuilder& mlp = moe_ ? experts : dense;
  mlp.add(&w_gate_, &g_w_gate_, {E, inter_, H});
  mlp.add(&w_up_, &g_w_up_, {E, inter_, H});
  mlp.add(&w_down_, &g_w_down_, {E, H, inter_});
  buckets_.push_back(dense.build(dtype, device, placement.bucket_pad));
  if (moe_) buckets_.push_back(experts.build(dtype, device, placement.bucket_pad));
}

void Qwen3MoeDecoderLayer::collect_parameters(ParameterList& out) {
  const std::string p = fmt::format("model.layers.{}.", id_);
  const double std = cfg_.initializer_range;
  auto add = [&](const std::string& name, const Tensor& w, const Tensor& g, bool is_norm) {
    out.push_back({p + name, w, g, !is_norm, is_norm ? 0.0 : std});
  };
  add("input_layernorm.weight", ln1_w_, g_ln1_w_, true);
  add("self_attn.q_proj.weight", wq_, g_wq_, false);
  add("self_attn.k_proj.weight", wk_, g_wk_, false);
  add("self_attn.v_proj.weight", wv_, g_wv_, false);
  add("self_attn.o_proj.weight", wo_, g_wo_, false);
  add("self_attn.q_norm.weight", q_norm_w_, g_q_norm_w_, true);
  add("self_attn.k_norm.weight", k_norm_w_, g_k_norm_w_, true);
  add("post_attention_layernorm.weight", ln2_w_, g_ln2_w_, true);
  if (moe_) {
    add("mlp.gate.weight", gate_w_, g_gate_w_, false);
    for (int64_t e = 0; e < w_gate_.size(0); ++e) {
      const std::string ep = fmt::format("mlp.experts.{}.", first_expert_ + e);
      add(ep + "gate_proj.weight", w_gate_.select(e), g_w_gate_.select(e), false);
      add(ep + "up_proj.weight", w_up_.select(e), g_w_up_.select(e), false);
      add(ep + "down_proj.weight", w_down_.select(e), g_w_down_.select(e), false);
    }
  } else {
    add("mlp.gate_proj.weight", w_gate_.select(0), g_w_gate_.select(0), false);
    add("mlp.up_proj.weight", w_up_.select(0), g_w_up_.select(0), false);
    add("mlp.down_proj.weight", w_down_.select(0), g_w_down_.select(0), false);
  }
}

ops::AttentionShape Qwen3MoeDecoderLayer::attn_shape(const BatchShape& b) const {
  return {b.batch, b.seq, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim,
          1.0 / std::sqrt(static_cast<double>(cfg_.head_dim))};
}

// Stage 1. h = x + Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1) with n1 = rms(x);
// the MLP input is rms(h), and the router picks top-k experts from softmax(Wg·rms(h)).
void Qwen3MoeDecoderLayer::attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b,
                                        Qwen3MoeLayerState& s) const {
  const double eps = cfg_.rms_norm_eps;
  s.x = x;
  {
    StageScope t(Stage::kNorms);
    s.ln1 = ops::rmsnorm_forward(x, ln1_w_, eps);
  }
  {
    StageScope t(Stage::kAttention);
    s.q_raw = ops::linear_forward(s.ln1.y, wq_);
    s.k_raw = ops::linear_forward(s.ln1.y, wk_);
    s.v = ops::linear_forward(s.ln1.y, wv_);
  }
  {
    StageScope t(Stage::kNorms);  // the per-head norms with RoPE in one op (ops.h)
    s.q_norm = ops::rmsnorm_rope_forward(s.q_raw, q_norm_w_, eps, positions, cfg_.head_dim, cfg_.rope_theta);
    s.k_norm = ops::rmsnorm_rope_forward(s.k_raw, k_norm_w_, eps, positions, cfg_.head_dim, cfg_.rope_theta);
    s.q = std::move(s.q_norm.y);
    s.k = std::move(s.k_norm.y);
  }
  {
    StageScope t(Stage::kAttention);
    s.attn = ops::attention_forward(s.q, s.k, s.v, b.segment_ids, attn_shape(b));
    s.h = ops::linear_forward(s.attn.out, wo_, x);  // residual added in the GEMM epilogue
  }
  {
    StageScope t(Stage::kNorms);
    s.ln2 = ops::rmsnorm_forward(s.h, ln2_w_, eps);
  }
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    s.router_logits = ops::linear_forward(s.ln2.y, gate_w_);
    s.route = ops::router_forward(s.router_logits, cfg_.num_experts_per_tok, cfg_.norm_topk_prob);
  }
}

// Stage 3. Per expert e over its rows: W_down[e] (silu(W_gate[e] x) * W_up[e] x).
void Qwen3MoeDecoderLayer::mlp_forward(Qwen3MoeLayerState& s) const {
  StageScope t(Stage::kExpertGemm);
  s.mlp = ops::grouped_swiglu_forward(s.expert_in.rows, s.expert_in.counts, w_gate_, w_up_, w_down_);
}

// Stage 5. y = h + sum_k w[t,k] * expert_out[t,k] (dense: y = h + mlp); expert_out read in
// expert order through expert_order where the dispatcher left it there.
Tensor Qwen3MoeDecoderLayer::aggregate_forward(Qwen3MoeLayerState& s) const {
  StageScope t(Stage::kCombine);
  if (moe_) return ops::combine_forward(s.expert_out, s.route.topk_weight, s.h, s.expert_order);
  Tensor y = s.expert_out.clone();
  ops::add_(y, s.h);
  return y;
}

Qwen3MoeDecoderLayer::AggregateGrads Qwen3MoeDecoderLayer::aggregate_backward(const Tensor& dy,
                                                                              Qwen3MoeLayerState& s) const {
  StageScope t(Stage::kCombine);
  if (!moe_) return {dy, Tensor()};
  ops::CombineGrads g = ops::combine_backward(dy, s.expert_out, s.route.topk_weight, s.expert_order);
  return {g.dexpert_out, g.dweight};
}

Tensor Qwen3MoeDecoderLayer::mlp_backward_input(const Tensor& d_rows_out, Qwen3MoeLayerState& s) const {
  StageScope t(Stage::kExpertGemm);
  s.d_mlp_out = d_rows_out;
  s.d_mlp = ops::grouped_swiglu_backward_input(d_rows_out, s.expert_in.counts, s.mlp.gate, s.mlp.up, w_gate_,
                                               w_up_, w_down_);
  return s.d_mlp.dx;
}

// Backward of stage 1, in reverse: router -> ln2 (+ residual) -> o_proj -> attention ->
// RoPE -> q/k norms -> q/k/v projections -> ln1 (+ residual).
Tensor Qwen3MoeDecoderLayer::attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in,
                                                 const Tensor& d_topk_weight, const Tensor& d_probs_extra,
                                                 const Tensor& d_logits_extra, const Tensor& positions,
                                                 const BatchShape& b, Qwen3MoeLayerState& s) const {
  s.d_ln2_out = std::move(d_mlp_in);  // no copy (a [T, H] pass): the caller lets go of it
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    s.d_router_logits = ops::router_backward(d_topk_weight, d_probs_extra, s.route, cfg_.norm_topk_prob);
    if (d_logits_extra.defined()) ops::add_(s.d_router_logits, d_logits_extra);
    ops::linear_backward_input_add(s.d_router_logits, gate_w_, s.d_ln2_out);
  }
  {
    StageScope t(Stage::kNorms);
    s.d_h = ops::rmsnorm_backward_input(s.d_ln2_out, s.h, ln2_w_, s.ln2.rstd, dy_residual);
  }
  Tensor d_q, d_k;
  {
    StageScope t(Stage::kAttention);
    Tensor d_attn = ops::linear_backward_input(s.d_h, wo_);
    ops::AttentionGrads g =
        ops::attention_backward(d_attn, s.q, s.k, s.v, b.segment_ids, s.attn.out, s.attn.lse, attn_shape(b));
    s.d_v = g.dv;
    d_q = std::move(g.dq);
    d_k = std::move(g.dk);
  }
  {
    StageScope t(Stage::kNorms);  // their weight gradients too, kept for backward_weight
    ops::RmsNormRopeGrads q = ops::rmsnorm_rope_backward(d_q, s.q_raw, q_norm_w_, s.q_norm.rstd, positions,
                                                         cfg_.head_dim, cfg_.rope_theta);
    ops::RmsNormRopeGrads k = ops::rmsnorm_rope_backward(d_k, s.k_raw, k_norm_w_, s.k_norm.rstd, positions,
                                                         cfg_.head_dim, cfg_.rope_theta);
    s.d_q_raw = std::move(q.dx);
    s.d_k_raw = std::move(k.dx);
    s.dw_q_norm = std::move(q.dw);
    s.dw_k_norm = std::move(k.dw);
  }
  {
    StageScope t(Stage::kAttention);
    s.d_ln1_out = ops::linear_backward_input(s.d_q_raw, wq_);
    ops::linear_backward_input_add(s.d_k_raw, wk_, s.d_ln1_out);
    ops::linear_backward_input_add(s.d_v, wv_, s.d_ln1_out);
  }
  StageScope t(Stage::kNorms);
  return ops::rmsnorm_backward_input(s.d_ln1_out, s.x, ln1_w_, s.ln1.rstd, s.d_h);
}

void Qwen3MoeDecoderLayer::backward_weight(Qwen3MoeLayerState& s, bool accumulate, ops::SumSquaresInto squares,
                                           bool defer_experts) {
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    ops::linear_backward_weight(s.d_router_logits, s.ln2.y, g_gate_w_, accumulate);
  }
  if (!accumulate) drop_deferred_expert_weights();  // a step's first micro-batch: anything kept is stale
  {
    StageScope t(Stage::kExpertGemm);
    ops::SwigluWgradRows rows{s.d_mlp_out, s.expert_in.rows, s.expert_in.counts, s.mlp.gate,
                              s.mlp.up,    s.d_mlp.dgate,    s.d_mlp.dup,        s.mlp.act};
    if (moe_ && defer_experts) {
      MT_CHECK(squares.out == nullptr, "layer {}: expert weight gradients deferred where their sum of squares is "
               "wanted (the step's last micro-batch must not defer)", id_);
      if (expert_pending_.empty()) expert_pending_accumulate_ = accumulate;
      if (rows.act.defined()) rows.gate = rows.up = Tensor();  // only act is read: not kept
      expert_pending_.push_back(std::move(rows));
    } else if (!expert_pending_.empty()) {
      expert_pending_.push_back(std::move(rows));
      ops::grouped_swiglu_backward_weight_group(expert_pending_, g_w_gate_, g_w_up_, g_w_down_,
                                                expert_pending_accumulate_,
                                                expert_pending_accumulate_ ? ops::SumSquaresInto{} : squares);
      expert_pending_.clear();
    } else {
      ops::grouped_swiglu_backward_weight(rows.dy, rows.x, rows.counts, rows.gate, rows.up, rows.dgate, rows.dup,
                                          g_w_gate_, g_w_up_, g_w_down_, accumulate,
                                          moe_ && !accumulate ? squares : ops::SumSquaresInto{}, rows.act);
    }
  }
  {
    StageScope t(Stage::kAttention);
    ops::linear_backward_weight(s.d_h, s.attn.out, g_wo_, accumulate);
    ops::linear_backward_weight(s.d_q_raw, s.ln1.y, g_wq_, accumulate);
    ops::linear_backward_weight(s.d_k_raw, s.ln1.y, g_wk_, accumulate);
    ops::linear_backward_weight(s.d_v, s.ln1.y, g_wv_, accumulate);
  }
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(s.d_ln2_out, s.h, s.ln2.rstd, g_ln2_w_, accumulate);
  for (auto [g, dw] : {std::pair{&g_q_norm_w_, &s.dw_q_norm}, std::pair{&g_k_norm_w_, &s.dw_k_norm}}) {
    if (accumulate) ops::add_(*g, *dw);
    else g->copy_from(*dw);
  }
  ops::rmsnorm_backward_weight(s.d_ln1_out, s.x, s.ln1.rstd, g_ln1_w_, accumulate);
}

Tensor Qwen3MoeDecoderLayer::reference_forward(const Tensor& x, const Tensor& positions, const BatchShape& b) const {
  MT_CHECK(!moe_ || local_experts() == cfg_.num_experts,
           "reference_forward needs every expert of layer {} in this process (expert parallelism holds {} of {})",
           id_, local_experts(), cfg_.num_experts);
  Qwen3MoeLayerState s;
  attn_forward(x, positions, b, s);
  const int64_t T = b.tokens();
  Tensor y = s.h.clone();
  auto expert = [&](const Tensor& row, int64_t e) {  // row [1, H] -> [1, H]
    Tensor g = ops::linear_forward(row, w_gate_.select(e));
    Tensor u = ops::linear_forward(row, w_up_.select(e));
    std::vector<double> gv = g.to_double_vector(), uv = u.to_double_vector(), a(gv.size());
    for (size_t i = 0; i < gv.size(); ++i) a[i] = gv[i] / (1.0 + std::exp(-gv[i])) * uv[i];
    Tensor at = Tensor::from_vector(a, {1, inter_}).to(x.dtype());
    return ops::linear_forward(at, w_down_.select(e));
  };
  for (int64_t t = 0; t < T; ++t) {
    Tensor row = s.ln2.y.slice(t, t + 1);
    Tensor yt = y.slice(t, t + 1);
    if (!moe_) {
      ops::add_(yt, expert(row, 0));
      continue;
    }
    const int64_t K = cfg_.num_experts_per_tok;
    for (int64_t k = 0; k < K; ++k) {
      int64_t e = static_cast<int64_t>(s.route.topk_idx.item(t * K + k));
      Tensor out = expert(row, e);
      ops::scale_(out, s.route.topk_weight.item(t * K + k));
      ops::add_(yt, out);
    }
  }
  return y;
}

// ---- model -------------------------------------------------------------------------------

Tensor RouterTotals::pack() const {
  const std::vector<Tensor> host = to_host({selections, prob_sum, z_sum});
  std::vector<double> v = host[0].to_double_vector(), p = host[1].to_double_vector();
  v.insert(v.end(), p.begin(), p.end());
  v.push_back(static_cast<double>(rows));
  v.push_back(host[2].item());
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

RouterTotals RouterTotals::unpack(const Tensor& packed, int64_t E, DType stat, Device device) {
  MT_CHECK(packed.numel() == 2 * E + 2, "router totals message holds {} values, expected 2 * {} experts + 2",
           packed.numel(), E);
  MT_CHECK(packed.dtype() == DType::F64, "router totals message is {}, expected f64", dtype_name(packed.dtype()));
  const Tensor host = packed.device().is_cpu() ? packed : packed.to(Device::cpu());
  RouterTotals t;
  t.selections = host.slice(0, E).to(stat).to(device);  // to() copies
  t.prob_sum = host.slice(E, 2 * E).to(stat).to(device);
  t.rows = static_cast<int64_t>(std::llround(host.item(2 * E)));
  t.z_sum = host.slice(2 * E + 1, 2 * E + 2).to(stat).to(device);
  return t;
}

Qwen3MoeModel::Qwen3MoeModel(Qwen3MoeConfig cfg, DType dtype, Device device, ModelPlacement placement)
    : cfg_(std::move(cfg)), dtype_(dtype), device_(device), placement_(std::move(placement)) {
  cfg_.validate("model");
  MT_CHECK(placement_.ep_size >= 1 && placement_.ep_rank >= 0 && placement_.ep_rank < placement_.ep_size,
           "expert-parallel rank {} of {} is not a valid placement", placement_.ep_rank, placement_.ep_size);
  std::vector<int64_t>& ids = placement_.layers;
  if (ids.empty()) {
    for (int64_t i = 0; i < cfg_.num_hidden_layers; ++i) ids.push_back(i);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < cfg_.num_hidden_layers && (i == 0 || ids[i] > ids[i - 1]),
             "placement: layer ids must ascend within [0, num_hidden_layers = {}), got {} at position {}",
             cfg_.num_hidden_layers, ids[i], i);
  }
  const bool embed = placement_.embed, head = placement_.head;
  MT_CHECK(!cfg_.tie_word_embeddings || embed == head,
           "[model].tie_word_embeddings needs the embedding and the head on one rank, but this pipeline rank holds "
           "only the {}: use the dualpipev schedule (its V puts both on rank 0) or untied embeddings",
           embed ? "embedding" : "head");
  const int64_t V = cfg_.vocab_size, H = cfg_.hidden_size;
  const double std = cfg_.initializer_range;
  // The embedding, final norm and head share one bucket; each layer brings its own.
  if (embed || head) {
    BucketBuilder outer("model.embed_norm_head", false);
    if (embed) outer.add(&embed_, &g_embed_, {V, H});
    if (head) outer.add(&final_norm_w_, &g_final_norm_w_, {H});
    if (head && !cfg_.tie_word_embeddings) outer.add(&lm_head_, &g_lm_head_, {V, H});
    buckets_.push_back(outer.build(dtype, device, placement_.bucket_pad));
  }
  if (embed) params_.push_back({"model.embed_tokens.weight", embed_, g_embed_, true, std});
  for (const int64_t i : ids) {
    layers_.push_back(std::make_unique<Qwen3MoeDecoderLayer>(cfg_, i, dtype, device, placement_));
    layers_.back()->collect_parameters(params_);
    for (ParamBucket& b : layers_.back()->buckets()) {
      b.layer = i;
      buckets_.push_back(std::move(b));
    }
    layers_.back()->buckets().clear();
  }
  if (head) params_.push_back({"model.norm.weight", final_norm_w_, g_final_norm_w_, false, 0.0});
  if (head && cfg_.tie_word_embeddings) {
    lm_head_ = embed_;
    g_lm_head_ = g_embed_;
  } else if (head) {
    params_.push_back({"lm_head.weight", lm_head_, g_lm_head_, true, std});
  }
  index_buckets(buckets_, params_);
  attach_masters(params_);
}

size_t Qwen3MoeModel::local_layer(int64_t id) const {
  const std::vector<int64_t>& ids = placement_.layers;
  auto it = std::lower_bound(ids.begin(), ids.end(), id);
  MT_CHECK(it != ids.end() && *it == id, "decoder layer {} is not held by this rank (it holds {} layers)", id,
           ids.size());
  return static_cast<size_t>(it - ids.begin());
}

ChunkSpec Qwen3MoeModel::whole() const {
  const std::vector<int64_t>& ids = placement_.layers;
  ChunkSpec c{ids.empty() ? 0 : ids.front(), ids.empty() ? 0 : ids.back() + 1, placement_.embed, placement_.head};
  MT_CHECK(c.last_layer - c.first_layer == static_cast<int64_t>(ids.size()),
           "this rank's layers are not one contiguous chunk: run them chunk by chunk");
  return c;
}

const Tensor& Qwen3MoeModel::dense_counts(int64_t tokens) const {
  Tensor& t = dense_counts_[tokens];
  if (!t.defined()) t = Tensor::full({1}, static_cast<double>(tokens), DType::I64, device_);
  return t;
}

RouterTotals Qwen3MoeModel::new_totals() const {
  const DType stat = grad_dtype_for(dtype_);  // router statistics are f32 on the GPU
  const int64_t E = cfg_.num_experts;
  return {Tensor::zeros({E}, stat, device_), Tensor::zeros({E}, stat, device_), 0, Tensor::zeros({1}, stat, device_)};
}

// A chunk pass cut at the expert exchanges: each call of forward_piece / backward_piece runs
// the compute between two exchanges and starts the next one (with a dispatcher that defers
// its waits, the exchange is still in flight when the call returns).
struct Qwen3MoeModel::ForwardCursor {
  const ChunkSpec& c;
  const Batch& batch;
  BatchShape b;
  ChunkActivations& a;
  RouterTotals& totals;
  ChunkPass pass;
  Tensor x;        // the hidden state between layers
  int64_t j = 0;   // the layer (within the chunk) being run
  int piece = 0;   // 0: attn + dispatch, 1: mlp + combine, 2: aggregate
};

struct Qwen3MoeModel::BackwardCursor {
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

bool Qwen3MoeModel::forward_piece(ForwardCursor& f, ExpertDispatcher& d) const {
  const int64_t n = f.c.last_layer - f.c.first_layer;
  if (f.j == n) return false;
  const int64_t id = f.c.first_layer + f.j;
  const Qwen3MoeDecoderLayer& layer = *layers_[local_layer(id)];
  Qwen3MoeLayerState& s = f.a.layers[f.j];
  switch (f.piece) {
    case 0:
      if (hooks_) hooks_->before_forward(id);
      layer.attn_forward(f.x, f.batch.positions, f.b, s);  // 1: attn
      if (layer.is_moe()) {
        s.expert_in = d.dispatch(s.ln2.y, s.route.topk_idx, cfg_.num_experts, s.dispatch);  // 2: dispatch
      } else {
        s.expert_in = {s.ln2.y, dense_counts(f.b.tokens())};
      }
      break;
    case 1:
      if (layer.is_moe()) d.wait(s.dispatch);
      layer.mlp_forward(s);                                                    // 3: mlp
      if (layer.is_moe()) {  // 4: combine (rows left in expert order where the dispatcher can)
        ExpertDispatcher::PlacedRows placed = d.combine_in_place(s.mlp.y, s.dispatch);
        s.expert_out = placed.rows;
        s.expert_order = placed.order;
      } else {
        s.expert_out = s.mlp.y;
      }
      break;
    case 2:
      if (layer.is_moe()) d.wait(s.dispatch);
      f.x = layer.aggregate_forward(s);  // 5: aggregate
      if (layer.is_moe() && f.pass.router_stats) {  // this layer's share of the router totals (see RouterTotals)
        StageScope t(Stage::kLoss);
        ops::load_balance_accumulate(s.route.probs, s.route.topk_idx, f.totals.selections, f.totals.prob_sum);
        f.totals.rows += s.route.probs.size(0);
        if (cfg_.router_z_loss_coef > 0) {
          s.z = ops::router_z_loss_forward(s.router_logits);
          ops::add_(f.totals.z_sum, s.z.loss_sum);
        }
        f.a.expert_counts.push_back(s.expert_in.counts);  // read after the pass (no host wait here)
      }
      if (hooks_) hooks_->after_forward(id, f.pass.training && f.c.head && f.j + 1 == n);
      ++f.j;
      break;
  }
  f.piece = (f.piece + 1) % 3;
  return true;
}

bool Qwen3MoeModel::backward_piece(BackwardCursor& g, ExpertDispatcher& d) {
  if (g.j < 0) return false;
  const int64_t id = g.c.first_layer + g.j;
  Qwen3MoeDecoderLayer& layer = *layers_[local_layer(id)];
  Qwen3MoeLayerState& s = g.a.layers[g.j];
  switch (g.piece) {
    case 0: {
      if (hooks_) hooks_->before_backward(id);
      auto ag = layer.aggregate_backward(g.dx, s);  // 5
      g.d_topk_weight = ag.d_topk_weight;
      if (!layer.is_moe()) {
        g.d_rows = ag.d_expert_out;
      } else if (s.expert_order.defined()) {  // the gradient is in the placed rows' order already
        g.d_rows = d.combine_in_place_backward(ag.d_expert_out, s.dispatch);  // 4
      } else {
        g.d_rows = d.combine_backward(ag.d_expert_out, s.dispatch);  // 4
      }
      break;
    }
    case 1: {
      if (layer.is_moe()) d.wait(s.dispatch);
      Tensor d_in_rows = layer.mlp_backward_input(g.d_rows, s);                                  // 3
      g.d_mlp_in = layer.is_moe() ? d.dispatch_backward(d_in_rows, s.dispatch) : d_in_rows;  // 2
      g.d_rows = Tensor();
      break;
    }
    case 2: {
      if (layer.is_moe()) d.wait(s.dispatch);
      const int64_t T = g.b.tokens();
      Tensor d_probs, d_logits_z;
      if (layer.is_moe()) {
        StageScope t(Stage::kRouterPermute);
        if (cfg_.router_aux_loss_coef > 0) {
          d_probs = ops::load_balance_backward(g.a.totals.selections, T, g.a.totals.rows,
                                               cfg_.router_aux_loss_coef * g.aux_scale);
        }
        if (cfg_.router_z_loss_coef > 0) {
          d_logits_z = ops::router_z_loss_backward(
              s.route.probs, s.z.lse, cfg_.router_z_loss_coef * g.aux_scale / static_cast<double>(g.a.totals.rows));
        }
      }
      g.dx = layer.attn_backward_input(g.dx, std::move(g.d_mlp_in), g.d_topk_weight, d_probs, d_logits_z,
                                       g.batch.positions, g.b, s);  // 1
      g.d_mlp_in = g.d_topk_weight = Tensor();
      if (g.weights_now) {
        const bool writes = layer.writes_expert_grads(g.accumulate, defer_expert_weights_);
        layer.backward_weight(s, g.accumulate, expert_squares(id, !writes), defer_expert_weights_);
        s = Qwen3MoeLayerState();
        if (hooks_) hooks_->after_backward(id);
      }
      --g.j;
      break;
    }
  }
  g.piece = (g.piece + 1) % 3;
  return true;
}

Qwen3MoeModel::ForwardCursor Qwen3MoeModel::begin_forward(const ChunkSpec& c, const Batch& batch, const Tensor& x,
                                                          ChunkActivations& a, RouterTotals& totals,
                                                          const ChunkPass& pass) {
  a.layers.assign(static_cast<size_t>(c.last_layer - c.first_layer), {});
  ForwardCursor f{c, batch, BatchShape{batch.batch, batch.seq, batch.segment_ids}, a, totals, pass, x};
  if (c.embed) {
    MT_CHECK(placement_.embed, "an embed chunk on a rank without the embedding");
    if (hooks_) hooks_->before_forward(-1);
    f.x = ops::embedding_forward(batch.inputs, embed_);
  }
  return f;
}

Tensor Qwen3MoeModel::end_forward(ForwardCursor& f, const ChunkPass& pass, MicroBatchLoss* loss) {
  if (!f.c.head) return f.x;
  MT_CHECK(placement_.head && loss != nullptr, "a head chunk needs the head and somewhere to put the loss");
  ChunkActivations& a = f.a;
  const Batch& batch = f.batch;
  MicroBatchLoss& out = *loss;
  a.final_in = f.x;
  {
    StageScope t(Stage::kNorms);
    a.final_norm = ops::rmsnorm_forward(f.x, final_norm_w_, cfg_.rms_norm_eps);
  }
  out.targets = batch.num_targets;
  router_losses(f.totals, out);
  a.totals = f.totals;
  const Tensor& h = a.final_norm.y;
  if (!pass.training) {
    StageScope t(Stage::kLoss);
    out.on_device.ce_sum = ops::linear_cross_entropy(h, lm_head_, batch.targets, 1.0, nullptr, nullptr).loss_sum;
    if (hooks_) hooks_->after_forward(-1, false);
    return Tensor();
  }
  // Head: logits = norm(x) W^T and cross-entropy, forward and backward in one chunked pass,
  // so the head's gradients are made here and the chunk's backward starts from a.d_out.
  if (hooks_) hooks_->before_backward(-1);
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
  return Tensor();
}

Qwen3MoeModel::BackwardCursor Qwen3MoeModel::begin_backward(const ChunkSpec& c, const Batch& batch, const Tensor& dy,
                                                            ChunkActivations& a, double aux_scale, bool weights_now,
                                                            bool accumulate) {
  BackwardCursor g{c, batch, BatchShape{batch.batch, batch.seq, batch.segment_ids}, a, aux_scale, weights_now,
                   accumulate, c.head ? a.d_out : dy, c.last_layer - c.first_layer - 1};
  MT_CHECK(g.dx.defined(), "backward of layers [{}, {}): no output gradient", c.first_layer, c.last_layer);
  a.d_out = Tensor();
  return g;
}

Tensor Qwen3MoeModel::end_backward(BackwardCursor& g) {
  if (!g.c.embed) return g.dx;
  g.a.d_embed_out = g.dx;
  if (g.weights_now) {
    backward_chunk_weight(ChunkSpec{g.c.first_layer, g.c.first_layer, true, false}, g.batch, g.a, g.accumulate);
    if (hooks_) hooks_->after_backward(-1);
  }
  return Tensor();
}

Tensor Qwen3MoeModel::forward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& x, ExpertDispatcher& d,
                                    ChunkActivations& a, RouterTotals& totals, const ChunkPass& pass,
                                    MicroBatchLoss* loss) {
  ForwardCursor f = begin_forward(c, batch, x, a, totals, pass);
  while (forward_piece(f, d)) {
  }
  return end_forward(f, pass, loss);
}

Tensor Qwen3MoeModel::backward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ExpertDispatcher& d,
                                     ChunkActivations& a, double aux_scale, bool weights_now, bool accumulate) {
  BackwardCursor g = begin_backward(c, batch, dy, a, aux_scale, weights_now, accumulate);
  while (backward_piece(g, d)) {
  }
  return end_backward(g);
}

std::pair<Tensor, Tensor> Qwen3MoeModel::forward_backward_overlapped(
    const ChunkSpec& fc, const Batch& fbatch, const Tensor& x, ChunkActivations& fa, RouterTotals& totals,
    const ChunkPass& pass, MicroBatchLoss* loss, const ChunkSpec& bc, const Batch& bbatch, const Tensor& dy,
    ChunkActivations& ba, ExpertDispatcher& d) {
  ForwardCursor f = begin_forward(fc, fbatch, x, fa, totals, pass);
  BackwardCursor g = begin_backward(bc, bbatch, dy, ba, pass.aux_scale, /*weights_now=*/false, false);
  // Alternate: each piece computes while the other pass's exchange, started by its last
  // piece, is in flight.
  for (bool more_f = true, more_b = true; more_f || more_b;) {
    if (more_f) more_f = forward_piece(f, d);
    if (more_b) more_b = backward_piece(g, d);
  }
  Tensor out = end_forward(f, pass, loss);
  return {out, end_backward(g)};
}

void Qwen3MoeModel::backward_chunk_weight(const ChunkSpec& c, const Batch& batch, ChunkActivations& a,
                                          bool accumulate) {
  for (int64_t j = c.last_layer - c.first_layer; j-- > 0;) {
    const int64_t id = c.first_layer + j;
    layers_[local_layer(id)]->backward_weight(a.layers[j], accumulate, expert_squares(id, accumulate));
    a.layers[j] = Qwen3MoeLayerState();
  }
  if (c.embed) {
    // Tied: the head has already written (or added to) this gradient.
    ops::embedding_backward_weight(batch.inputs, a.d_embed_out, g_embed_, accumulate || cfg_.tie_word_embeddings);
    a.d_embed_out = Tensor();
  }
}

Tensor Qwen3MoeModel::forward_logits(const Tensor& ids, const Tensor& positions, const BatchShape& b,
                                     ExpertDispatcher& dispatcher) {
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
    h = ops::rmsnorm_forward(x, final_norm_w_, cfg_.rms_norm_eps).y;
  }
  StageScope t(Stage::kLoss);
  Tensor logits = ops::linear_forward(h, lm_head_);
  if (hooks_) hooks_->after_forward(-1, false);
  return logits;
}

Tensor Qwen3MoeModel::reference_forward(const Tensor& ids, const Tensor& positions, const BatchShape& b) const {
  Tensor x = ops::embedding_forward(ids, embed_);
  for (const auto& layer : layers_) x = layer->reference_forward(x, positions, b);
  Tensor n = ops::rmsnorm_forward(x, final_norm_w_, cfg_.rms_norm_eps).y;
  return ops::linear_forward(n, lm_head_);
}

// The router losses over the rows of all MoE layers (HF concatenates every layer's gate
// logits before computing the load-balancing loss, so n_e and P_e are totals over layers
// and R = moe_layers * T). The cross-entropy is the head's (linear_cross_entropy).
void Qwen3MoeModel::router_losses(RouterTotals& totals, MicroBatchLoss& out) const {
  StageScope t(Stage::kLoss);
  const int64_t E = cfg_.num_experts;
  if (data_group_ != nullptr) {
    // The load-balancing loss is a product of batch means: every rank needs the global ones.
    data_group_->all_reduce(totals.selections);
    data_group_->all_reduce(totals.prob_sum);
    Tensor r = Tensor::full({1}, static_cast<double>(totals.rows), DType::F64);
    if (!device_.is_cpu() && data_group_->backend() != "gloo") r = r.to(device_);
    data_group_->all_reduce(r);
    totals.rows = static_cast<int64_t>(std::llround(r.item()));
  }
  if (totals.rows > 0) {
    const double R = static_cast<double>(totals.rows);
    out.on_device.selections = totals.selections;  // final: the backward only reads them
    out.on_device.prob_sum = totals.prob_sum;
    out.on_device.aux_factor = cfg_.router_aux_loss_coef * static_cast<double>(E) / (R * R);
    if (cfg_.router_z_loss_coef > 0) {
      out.on_device.z_sum = totals.z_sum;
      out.on_device.z_factor = cfg_.router_z_loss_coef / R;
    }
  }
}

void MicroBatchLoss::read_device_values() {
  OnDevice& d = on_device;
  std::vector<Tensor> pending{d.ce_sum, d.selections, d.prob_sum, d.z_sum};
  pending.insert(pending.end(), d.expert_counts.begin(), d.expert_counts.end());
  const std::vector<Tensor> host = to_host(pending);
  if (host[0].defined()) ce_sum += host[0].item();
  if (host[1].defined()) {
    const std::vector<double> n = host[1].to_double_vector(), p = host[2].to_double_vector();
    double dotp = 0;
    for (size_t e = 0; e < n.size(); ++e) dotp += n[e] * p[e];
    aux_loss += d.aux_factor * dotp;
  }
  if (host[3].defined()) z_loss += d.z_factor * host[3].item();
  for (size_t k = 4; k < host.size(); ++k) expert_counts.push_back(host[k].to_vector<int64_t>());
  d = OnDevice();
}

MicroBatchLoss Qwen3MoeModel::forward_loss(const Batch& batch, ExpertDispatcher& dispatcher) {
  ChunkActivations a;
  RouterTotals totals = new_totals();
  MicroBatchLoss out;
  forward_chunk(whole(), batch, Tensor(), dispatcher, a, totals, ChunkPass{false}, &out);
  out.on_device.expert_counts = std::move(a.expert_counts);
  out.read_device_values();
  return out;
}

MicroBatchLoss Qwen3MoeModel::forward_backward(const Batch& batch, ExpertDispatcher& d, double ce_scale,
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
    for (auto& layer : layers_) layer->drop_deferred_expert_weights();
    throw;
  }
  defer_expert_weights_ = false;
  out.on_device.expert_counts = std::move(a.expert_counts);
  out.read_device_values();  // the micro-batch's one host wait, its work all queued
  return out;
}

int64_t Qwen3MoeModel::active_matmul_params() const {
  const int64_t H = cfg_.hidden_size, hd = cfg_.head_dim;
  const int64_t attn = H * hd * (2 * cfg_.num_attention_heads + 2 * cfg_.num_key_value_heads);
  int64_t n = cfg_.vocab_size * H;  // lm_head (the embedding lookup is no matmul)
  for (int64_t i = 0; i < cfg_.num_hidden_layers; ++i) {
    n += attn;
    if (cfg_.is_moe_layer(i)) {
      n += H * cfg_.num_experts + cfg_.num_experts_per_tok * 3 * H * cfg_.moe_intermediate_size;
    } else {
      n += 3 * H * cfg_.intermediate_size;
    }
  }
  return n;
}

double Qwen3MoeModel::flops_per_token(int64_t seq) const {
  return 6.0 * static_cast<double>(active_matmul_params()) +
         12.0 * static_cast<double>(cfg_.num_hidden_layers * cfg_.num_attention_heads * cfg_.head_dim * seq);
}

}  // namespace moetrain
