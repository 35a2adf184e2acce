#include "engine/models/qwen3_moe.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "engine/parallel/context_attention.h"
#include "engine/parallel/layout.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {

// ---- decoder layer ---------------------------------------------------------------------

Qwen3MoeDecoderLayer::Qwen3MoeDecoderLayer(const Qwen3MoeConfig& cfg, int64_t layer_id, DType dtype, Device device,
                                           const ModelPlacement& placement, const Projections* projections)
    : cfg_(cfg), id_(layer_id), moe_(cfg.is_moe_layer(layer_id)), tp_(placement.tp_size),
      proj_(projections != nullptr ? projections : &bf16_projections()) {
  const int64_t H = cfg.hidden_size, hd = cfg.head_dim;
  // Tensor parallelism: this rank's heads (q, and k/v of its query heads' groups) and, for a
  // dense MLP, its columns of the intermediate width (docs/parallel.md). With fewer key/value
  // heads than tp ranks, tp / kv heads ranks share each key/value head: all its query heads'
  // groups are on those ranks, since the heads per rank divide the heads per group.
  const int64_t kv_heads = cfg.num_key_value_heads;
  MT_CHECK(cfg.num_attention_heads % tp_ == 0 && (kv_heads % tp_ == 0 || tp_ % kv_heads == 0) &&
               cfg.intermediate_size % tp_ == 0,
           "layer {}: {} heads, {} key/value heads and an MLP width of {} do not split over tp = {} ranks", layer_id,
           cfg.num_attention_heads, kv_heads, cfg.intermediate_size, tp_);
  tp_rank_ = placement.tp_rank;
  if (kv_heads < tp_) {
    kv_ranks_per_head_ = tp_ / kv_heads;
    kv_row_ = tp_rank_ / kv_ranks_per_head_ * hd;
  }
  const int64_t qd = cfg.num_attention_heads / tp_ * hd, kvd = kv_ranks_per_head_ > 0 ? kv_heads * hd : kv_heads / tp_ * hd;
  int64_t E = 1;
  if (moe_) {
    const Layout::ExpertRange mine = expert_range(cfg.num_experts, placement.ep_size, placement.ep_rank);
    E = mine.count;
    first_expert_ = mine.first;
  }
  inter_ = moe_ ? cfg.moe_intermediate_size : cfg.intermediate_size / tp_;
  // Attention and router weights are replicated over expert-parallel ranks, experts are
  // not: they go into separate buckets (a dense MLP stays with the attention). Under tensor
  // parallelism the weights every tp rank holds whole (norms, router) get a third bucket.
  const std::string name = fmt::format("model.layers.{}", layer_id);
  BucketBuilder dense(name, false), experts(name + ".experts", true, placement.experts_over_tp),
      whole(name + ".tp_whole", false, true);
  BucketBuilder& held = tp_ > 1 ? whole : dense;
  // Key/value heads shared by tp ranks are held whole like the norms: each rank's gradient
  // has only its head's rows, and the sum over tp that keeps the copies equal adds the
  // head's partial gradients of the ranks that share it.
  BucketBuilder& kv = kv_ranks_per_head_ > 0 ? whole : dense;
  held.add(&ln1_w_, &g_ln1_w_, {H});
  dense.add(&wq_, &g_wq_, {qd, H});
  kv.add(&wk_, &g_wk_, {kvd, H});
  kv.add(&wv_, &g_wv_, {kvd, H});
  dense.add(&wo_, &g_wo_, {H, qd});
  held.add(&q_norm_w_, &g_q_norm_w_, {hd});
  held.add(&k_norm_w_, &g_k_norm_w_, {hd});
  held.add(&ln2_w_, &g_ln2_w_, {H});
  if (moe_) held.add(&gate_w_, &g_gate_w_, {cfg.num_experts, H});
  BucketBuilder& mlp = moe_ ? experts : dense;
  mlp.add(&w_gate_, &g_w_gate_, {E, inter_, H});
  mlp.add(&w_up_, &g_w_up_, {E, inter_, H});
  mlp.add(&w_down_, &g_w_down_, {E, H, inter_});
  if (moe_ && cfg.router_bias_update_speed > 0) score_bias_ = Tensor::zeros({cfg.num_experts}, DType::F32, device);
  buckets_.push_back(dense.build(dtype, device, placement.bucket_pad));
  if (!whole.empty()) buckets_.push_back(whole.build(dtype, device, placement.bucket_pad));
  if (moe_) buckets_.push_back(experts.build(dtype, device, placement.bucket_pad));
}

Tensor Qwen3MoeDecoderLayer::kv_rows(const Tensor& w) const {
  return kv_ranks_per_head_ > 0 ? w.slice(kv_row_, kv_row_ + cfg_.head_dim) : w;
}

void Qwen3MoeDecoderLayer::collect_parameters(ParameterList& out) {
  const std::string p = fmt::format("model.layers.{}.", id_);
  const double std = cfg_.initializer_range;
  // split_dim: under tensor parallelism, the dimension this rank's piece of the weight cuts
  // (-1: held whole).
  auto add = [&](const std::string& name, const Tensor& w, const Tensor& g, bool is_norm, int split_dim = -1) {
    Parameter param{p + name, w, g, !is_norm, is_norm ? 0.0 : std};
    out.push_back(split_dim < 0 ? param : tp_piece(std::move(param), split_dim, tp_rank_, tp_));
  };
  add("input_layernorm.weight", ln1_w_, g_ln1_w_, true);
  add("self_attn.q_proj.weight", wq_, g_wq_, false, 0);  // by heads: column-parallel
  const int kv_split = kv_ranks_per_head_ > 0 ? -1 : 0;  // shared heads: held whole
  add("self_attn.k_proj.weight", wk_, g_wk_, false, kv_split);
  add("self_attn.v_proj.weight", wv_, g_wv_, false, kv_split);
  add("self_attn.o_proj.weight", wo_, g_wo_, false, 1);  // row-parallel
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
    add("mlp.gate_proj.weight", w_gate_.select(0), g_w_gate_.select(0), false, 0);
    add("mlp.up_proj.weight", w_up_.select(0), g_w_up_.select(0), false, 0);
    add("mlp.down_proj.weight", w_down_.select(0), g_w_down_.select(0), false, 1);
  }
}

ops::AttentionShape Qwen3MoeDecoderLayer::attn_shape(const BatchShape& b) const {
  const int64_t kv_heads = kv_ranks_per_head_ > 0 ? 1 : cfg_.num_key_value_heads / tp_;
  return {b.batch, b.seq, cfg_.num_attention_heads / tp_, kv_heads, cfg_.head_dim,
          1.0 / std::sqrt(static_cast<double>(cfg_.head_dim))};
}

// Stage 1. h = x + Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1) with n1 = rms(x);
// the MLP input is rms(h), and the router picks top-k experts from softmax(Wg·rms(h)).
// Tensor parallelism: x, h and the norms are this rank's rows; n1 is gathered over the tp
// ranks for this rank's heads' q/k/v of every row, and o_proj's partial sums (this rank's
// heads) are reduce-scattered back to its rows before the residual.
void Qwen3MoeDecoderLayer::attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b,
                                        LayerState& state) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  const double eps = cfg_.rms_norm_eps;
  s.x = x;
  {
    StageScope t(Stage::kNorms);
    // Under tensor parallelism the rows are gathered first and quantized there.
    s.ln1 = b.tensor ? ops::rmsnorm_forward(x, ln1_w_, eps) : proj_->norm(x, ln1_w_, eps);
  }
  if (b.tensor) {  // every row's q/k/v of this rank's heads, a slice's GEMMs under the next slice's transfer
    StageScope t(Stage::kAttention);
    const int64_t T = b.tokens();
    s.q_raw = Tensor::empty({T, wq_.size(0)}, x.dtype(), x.device());
    const Tensor wk = kv_rows(wk_), wv = kv_rows(wv_);
    s.k_raw = Tensor::empty({T, wk.size(0)}, x.dtype(), x.device());
    s.v = Tensor::empty({T, wv.size(0)}, x.dtype(), x.device());
    s.ln1_all = b.tensor->gather_rows(s.ln1.y, [&](int64_t r0, const Tensor& rows) {
      const Projections::Input in = proj_->rows(rows);
      const int64_t r1 = r0 + rows.size(0);
      s.q_raw.slice(r0, r1).copy_from(proj_->forward(in, wq_));
      s.k_raw.slice(r0, r1).copy_from(proj_->forward(in, wk));
      s.v.slice(r0, r1).copy_from(proj_->forward(in, wv));
    });
  } else {
    StageScope t(Stage::kAttention);
    const Projections::Input in = proj_->rows(s.ln1);  // quantized once for the three (with the norm)
    s.q_raw = proj_->forward(in, wq_);
    s.k_raw = proj_->forward(in, wk_);
    s.v = proj_->forward(in, wv_);
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
    s.attn = attend(s.q, s.k, s.v, b, attn_shape(b));
    s.h = attention_output(*proj_, s.attn.out, wo_, x, b);
  }
  {
    StageScope t(Stage::kNorms);
    // FP8 experts: the tokens quantized with the norm, for the dispatch.
    s.ln2 = proj_->norm(s.h, ln2_w_, eps, experts_read_fp8());
    s.mlp_in = s.ln2.y;
    s.mlp_in_q = std::exchange(s.ln2.y_q, {});
    s.residual = s.h;
  }
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    s.router_logits = ops::linear_forward(s.ln2.y, gate_w_);
    s.route = ops::router_forward(s.router_logits, cfg_.num_experts_per_tok, cfg_.norm_topk_prob, score_bias_);
  }
}

// Stage 3. Per expert e over its rows: W_down[e] (silu(W_gate[e] x) * W_up[e] x).
Tensor Qwen3MoeDecoderLayer::mlp_forward(LayerState& state, const RowPart& part) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  return swiglu_mlp_forward(*proj_, s.expert_in, w_gate_, w_up_, w_down_, part, s.mlp);
}

Tensor Qwen3MoeDecoderLayer::mlp_backward_input(const Tensor& d_rows_out, LayerState& state, const RowPart& part) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  s.d_mlp_out = d_rows_out;
  return swiglu_mlp_backward_input(*proj_, d_rows_out, std::exchange(s.dispatch.d_rows_q, {}), s.expert_in, s.mlp,
                                   w_gate_, w_up_, w_down_, part, s.d_mlp);
}

// Backward of stage 1, in reverse: router -> ln2 (+ residual) -> o_proj -> attention ->
// RoPE -> q/k norms -> q/k/v projections -> ln1 (+ residual).
Tensor Qwen3MoeDecoderLayer::attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in,
                                                 const Tensor& d_topk_weight, const Tensor& d_probs_extra,
                                                 const Tensor& d_logits_extra, const Tensor& positions,
                                                 const BatchShape& b, LayerState& state) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
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
    const Tensor d_attn = attention_output_backward(*proj_, s.d_h, wo_, b, &s.d_h_all);
    ops::AttentionGrads g =
        attend_backward(d_attn, s.q, s.k, s.v, b, s.attn.out, s.attn.lse, attn_shape(b));
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
    // d n1 of rows [r0, r0 + n): this rank's heads' part (summed over the ranks under tp).
    auto d_ln1 = [&](int64_t r0, int64_t n) {
      auto rows = [&](const Tensor& d) { return n == s.d_q_raw.size(0) ? d : d.slice(r0, r0 + n); };
      Tensor d = proj_->backward_input(rows(s.d_q_raw), wq_);
      proj_->backward_input_add(rows(s.d_k_raw), kv_rows(wk_), d);
      proj_->backward_input_add(rows(s.d_v), kv_rows(wv_), d);
      return d;
    };
    s.d_ln1_out = b.tensor ? b.tensor->reduce_scatter_rows(b.tokens(), d_ln1) : d_ln1(0, s.d_q_raw.size(0));
  }
  StageScope t(Stage::kNorms);
  return ops::rmsnorm_backward_input(s.d_ln1_out, s.x, ln1_w_, s.ln1.rstd, s.d_h);
}

void Qwen3MoeDecoderLayer::backward_weight(LayerState& state, bool accumulate, ops::SumSquaresInto squares,
                                           bool defer_experts) {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    ops::linear_backward_weight(s.d_router_logits, s.ln2.y, g_gate_w_, accumulate);
  }
  {
    StageScope t(Stage::kExpertGemm);
    expert_grads_.backward_weight({s.d_mlp_out, s.expert_in.rows, s.expert_in.counts, s.mlp.gate, s.mlp.up,
                                   s.d_mlp.dgate, s.d_mlp.dup, s.mlp.act},
                                  moe_, accumulate, squares, defer_experts, id_, g_w_gate_, g_w_up_, g_w_down_,
                                  proj_->fp8_experts_wgrad(w_gate_.size(2), w_gate_.size(1)));
  }
  {
    StageScope t(Stage::kAttention);
    proj_->backward_weight(s.d_h_all.defined() ? s.d_h_all : s.d_h, s.attn.out, g_wo_, accumulate);
    const Projections::Input in = proj_->tokens(s.ln1_all.defined() ? s.ln1_all : s.ln1.y);
    proj_->backward_weight(s.d_q_raw, in, g_wq_, accumulate);
    for (auto [d, g] : {std::pair{&s.d_k_raw, &g_wk_}, std::pair{&s.d_v, &g_wv_}}) {
      if (kv_ranks_per_head_ > 0 && !accumulate) g->zero_();  // the heads of other ranks: none from here
      Tensor rows = kv_rows(*g);
      proj_->backward_weight(*d, in, rows, accumulate || kv_ranks_per_head_ > 0);
    }
  }
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(s.d_ln2_out, s.h, s.ln2.rstd, g_ln2_w_, accumulate);
  for (auto [g, dw] : {std::pair{&g_q_norm_w_, &s.dw_q_norm}, std::pair{&g_k_norm_w_, &s.dw_k_norm}}) {
    if (accumulate) ops::add_(*g, *dw);
    else g->copy_from(*dw);
  }
  ops::rmsnorm_backward_weight(s.d_ln1_out, s.x, s.ln1.rstd, g_ln1_w_, accumulate);
}

// Selective recomputation: the two norms' outputs and the queries/keys after their norms and
// RoPE, made again from x, h, q_raw and k_raw (their rstd are the same bits again).
void Qwen3MoeDecoderLayer::drop_recomputable(LayerState& state) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  s.ln1.y = s.ln2.y = s.mlp_in = s.q = s.k = Tensor();
}

void Qwen3MoeDecoderLayer::recompute_dropped(LayerState& state, const Tensor& positions) const {
  auto& s = static_cast<Qwen3MoeLayerState&>(state);
  const double eps = cfg_.rms_norm_eps;
  s.ln1 = ops::rmsnorm_forward(s.x, ln1_w_, eps);
  s.q = ops::rmsnorm_rope_forward(s.q_raw, q_norm_w_, eps, positions, cfg_.head_dim, cfg_.rope_theta).y;
  s.k = ops::rmsnorm_rope_forward(s.k_raw, k_norm_w_, eps, positions, cfg_.head_dim, cfg_.rope_theta).y;
  s.ln2 = ops::rmsnorm_forward(s.h, ln2_w_, eps);
  s.mlp_in = s.ln2.y;
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
    return swiglu_expert_reference(row, w_gate_.select(e), w_up_.select(e), w_down_.select(e));
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

namespace {

DecoderSpec decoder_spec(const Qwen3MoeConfig& c) {
  DecoderSpec s;
  s.vocab_size = c.vocab_size;
  s.hidden_size = c.hidden_size;
  s.num_layers = c.num_hidden_layers;
  s.num_experts = c.num_experts;
  s.experts_per_token = c.num_experts_per_tok;
  s.rms_norm_eps = c.rms_norm_eps;
  s.initializer_range = c.initializer_range;
  s.tie_word_embeddings = c.tie_word_embeddings;
  s.router_aux_loss_coef = c.router_aux_loss_coef;
  s.router_z_loss_coef = c.router_z_loss_coef;
  s.router_bias_update_speed = c.router_bias_update_speed;
  return s;
}

}  // namespace

Qwen3MoeModel::Qwen3MoeModel(Qwen3MoeConfig cfg, DType dtype, Device device, ModelPlacement placement)
    : MoeDecoderModel(decoder_spec(cfg), dtype, device, std::move(placement)), cfg_(std::move(cfg)) {
  cfg_.validate("model");
  build([&](int64_t id) {
    return std::make_unique<Qwen3MoeDecoderLayer>(cfg_, id, this->dtype(), this->device(), this->placement(),
                                                 &this->projections());
  });
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
