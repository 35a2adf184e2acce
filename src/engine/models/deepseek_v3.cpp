#include "engine/models/deepseek_v3.h"

#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "core/log.h"
#include "engine/parallel/context_attention.h"
#include "engine/parallel/layout.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {

namespace {
// The query and key/value latents' RMSNorms take 1e-6 whatever rms_norm_eps says: Hugging
// Face's DeepseekV3Attention (and DeepSeek's reference model) build them with the default.
constexpr double kLatentNormEps = 1e-6;
}  // namespace

// ---- decoder layer ---------------------------------------------------------------------

DeepseekV3DecoderLayer::DeepseekV3DecoderLayer(const DeepseekV3Config& cfg, int64_t layer_id, DType dtype,
                                               Device device, const ModelPlacement& placement,
                                               const Projections* projections)
    : cfg_(cfg), id_(layer_id), moe_(cfg.is_moe_layer(layer_id)), tp_(placement.tp_size),
      tp_rank_(placement.tp_rank), proj_(projections != nullptr ? projections : &bf16_projections()) {
  MT_CHECK(cfg.num_attention_heads % tp_ == 0 && cfg.intermediate_size % tp_ == 0,
           "layer {}: {} heads and an MLP width of {} do not split over tp = {} ranks", layer_id,
           cfg.num_attention_heads, cfg.intermediate_size, tp_);
  heads_ = cfg.num_attention_heads / tp_;
  const int64_t H = cfg.hidden_size, heads = heads_, qk = cfg.qk_head_dim();
  const int64_t rope = cfg.qk_rope_head_dim, r = cfg.kv_lora_rank;
  int64_t E = 1;
  if (moe_) {
    const Layout::ExpertRange mine = expert_range(cfg.n_routed_experts, placement.ep_size, placement.ep_rank);
    E = mine.count;
    first_expert_ = mine.first;
  }
  inter_ = moe_ ? cfg.moe_intermediate_size : cfg.intermediate_size / tp_;
  // Attention, router and shared experts are replicated over expert-parallel ranks, the
  // routed experts are not: separate buckets (a dense MLP stays with the attention). Under
  // tensor parallelism what every tp rank holds whole gets a third bucket.
  const std::string name = fmt::format("model.layers.{}", layer_id);
  BucketBuilder dense(name, false), experts(name + ".experts", true, placement.experts_over_tp),
      whole(name + ".tp_whole", false, true);
  BucketBuilder& held = tp_ > 1 ? whole : dense;
  held.add(&ln1_w_, &g_ln1_w_, {H});
  if (cfg.q_lora_rank > 0) {
    held.add(&wq_a_, &g_wq_a_, {cfg.q_lora_rank, H});
    held.add(&q_a_norm_w_, &g_q_a_norm_w_, {cfg.q_lora_rank});
    dense.add(&wq_b_, &g_wq_b_, {heads * qk, cfg.q_lora_rank});
  } else {
    dense.add(&wq_, &g_wq_, {heads * qk, H});
  }
  held.add(&wkv_a_, &g_wkv_a_, {r + rope, H});
  held.add(&kv_a_norm_w_, &g_kv_a_norm_w_, {r});
  dense.add(&wkv_b_, &g_wkv_b_, {heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), r});
  dense.add(&wo_, &g_wo_, {H, heads * cfg.v_head_dim});
  held.add(&ln2_w_, &g_ln2_w_, {H});
  if (moe_) held.add(&gate_w_, &g_gate_w_, {cfg.n_routed_experts, H});
  if (has_shared()) {  // on this rank's rows, whole (no exchange: data-parallel over the tp ranks)
    const int64_t Is = cfg.n_shared_experts * cfg.moe_intermediate_size;
    held.add(&ws_gate_, &g_ws_gate_, {1, Is, H});
    held.add(&ws_up_, &g_ws_up_, {1, Is, H});
    held.add(&ws_down_, &g_ws_down_, {1, H, Is});
  }
  BucketBuilder& mlp = moe_ ? experts : dense;
  mlp.add(&w_gate_, &g_w_gate_, {E, inter_, H});
  mlp.add(&w_up_, &g_w_up_, {E, inter_, H});
  mlp.add(&w_down_, &g_w_down_, {E, H, inter_});
  if (moe_) score_bias_ = Tensor::zeros({cfg.n_routed_experts}, DType::F32, device);
  buckets_.push_back(dense.build(dtype, device, placement.bucket_pad));
  if (!whole.empty()) buckets_.push_back(whole.build(dtype, device, placement.bucket_pad));
  if (moe_) buckets_.push_back(experts.build(dtype, device, placement.bucket_pad));

  // RoPE on the last qk_rope_head_dim dims of each query head, and on the shared k_pe.
  q_rope_.head_dim = rope;
  q_rope_.inv_freq = cfg.rope_inv_freq();
  q_rope_.scale = cfg.rope_attention_factor();
  q_rope_.interleaved = cfg.rope_interleave;
  k_rope_ = q_rope_;
  q_rope_.stride = qk;
}

void DeepseekV3DecoderLayer::collect_parameters(ParameterList& out) {
  const std::string p = fmt::format("model.layers.{}.", id_);
  const double std = cfg_.initializer_range;
  // split_dim: under tensor parallelism, the dimension this rank's piece cuts (-1: whole).
  auto add = [&](const std::string& name, const Tensor& w, const Tensor& g, bool is_norm, int split_dim = -1) {
    Parameter param{p + name, w, g, !is_norm, is_norm ? 0.0 : std};
    out.push_back(split_dim < 0 ? param : tp_piece(std::move(param), split_dim, tp_rank_, tp_));
  };
  add("input_layernorm.weight", ln1_w_, g_ln1_w_, true);
  if (cfg_.q_lora_rank > 0) {
    add("self_attn.q_a_proj.weight", wq_a_, g_wq_a_, false);
    add("self_attn.q_a_layernorm.weight", q_a_norm_w_, g_q_a_norm_w_, true);
    add("self_attn.q_b_proj.weight", wq_b_, g_wq_b_, false, 0);  // by heads
  } else {
    add("self_attn.q_proj.weight", wq_, g_wq_, false, 0);
  }
  add("self_attn.kv_a_proj_with_mqa.weight", wkv_a_, g_wkv_a_, false);
  add("self_attn.kv_a_layernorm.weight", kv_a_norm_w_, g_kv_a_norm_w_, true);
  add("self_attn.kv_b_proj.weight", wkv_b_, g_wkv_b_, false, 0);
  add("self_attn.o_proj.weight", wo_, g_wo_, false, 1);
  add("post_attention_layernorm.weight", ln2_w_, g_ln2_w_, true);
  if (moe_) {
    add("mlp.gate.weight", gate_w_, g_gate_w_, false);
    for (int64_t e = 0; e < w_gate_.size(0); ++e) {
      const std::string ep = fmt::format("mlp.experts.{}.", first_expert_ + e);
      add(ep + "gate_proj.weight", w_gate_.select(e), g_w_gate_.select(e), false);
      add(ep + "up_proj.weight", w_up_.select(e), g_w_up_.select(e), false);
      add(ep + "down_proj.weight", w_down_.select(e), g_w_down_.select(e), false);
    }
    if (has_shared()) {
      add("mlp.shared_experts.gate_proj.weight", ws_gate_.select(0), g_ws_gate_.select(0), false);
      add("mlp.shared_experts.up_proj.weight", ws_up_.select(0), g_ws_up_.select(0), false);
      add("mlp.shared_experts.down_proj.weight", ws_down_.select(0), g_ws_down_.select(0), false);
    }
  } else {
    add("mlp.gate_proj.weight", w_gate_.select(0), g_w_gate_.select(0), false, 0);
    add("mlp.up_proj.weight", w_up_.select(0), g_w_up_.select(0), false, 0);
    add("mlp.down_proj.weight", w_down_.select(0), g_w_down_.select(0), false, 1);
  }
}

ops::AttentionShape DeepseekV3DecoderLayer::attn_shape(const BatchShape& b) const {
  ops::AttentionShape a{b.batch, b.seq, heads_, heads_, cfg_.qk_head_dim(),
                        cfg_.softmax_scale()};
  a.v_head_dim = cfg_.v_head_dim;
  return a;
}

// Stage 1. Multi-head latent attention:
//   q   = rope(Wq_b · rms(Wq_a · n1))           (or rope(Wq · n1) without a query latent)
//   c   = rms(Wkv_a[:r] · n1),  k_pe = rope(Wkv_a[r:] · n1)
//   [k_nope | v] per head = Wkv_b · c;  k = [k_nope | k_pe] per head
//   h   = x + Wo · attention(q, k, v),  with n1 = rms(x)
// then the MLP input rms(h), the shared experts' output added to the residual h, and the
// route: sigmoid scores, group-limited top-k of the biased scores.
void DeepseekV3DecoderLayer::attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b,
                                          LayerState& state) const {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  const double eps = cfg_.rms_norm_eps;
  s.x = x;
  {
    StageScope t(Stage::kNorms);
    // Under tensor parallelism the rows are gathered first and quantized there.
    s.ln1 = b.tensor ? ops::rmsnorm_forward(x, ln1_w_, eps) : proj_->norm(x, ln1_w_, eps);
  }
  {
    StageScope t(Stage::kAttention);
    // The first projections of every row: the query latent (or the queries without one), the
    // key/value latent and k_pe. Under tensor parallelism each rank makes them for every row
    // (their weights held whole), a slice's GEMMs under the next slice's transfer.
    const bool q_latent = cfg_.q_lora_rank > 0;
    const Tensor& w_q_first = q_latent ? wq_a_ : wq_;
    Tensor q_first;
    if (b.tensor) {
      const int64_t T = b.tokens();
      q_first = Tensor::empty({T, w_q_first.size(0)}, x.dtype(), x.device());
      s.c_kv = Tensor::empty({T, cfg_.kv_lora_rank}, x.dtype(), x.device());
      s.k_pe = Tensor::empty({T, cfg_.qk_rope_head_dim}, x.dtype(), x.device());
      s.ln1_all = b.tensor->gather_rows(s.ln1.y, [&](int64_t r0, const Tensor& rows) {
        const Projections::Input in = proj_->rows(rows);
        const int64_t r1 = r0 + rows.size(0);
        q_first.slice(r0, r1).copy_from(proj_->forward(in, w_q_first));
        s.c_kv.slice(r0, r1).copy_from(proj_->forward(in, kv_a_latent(wkv_a_)));
        s.k_pe.slice(r0, r1).copy_from(proj_->forward(in, kv_a_rope(wkv_a_)));
      });
    } else {
      const Projections::Input in = proj_->rows(s.ln1);  // quantized once for the three (with the norm)
      q_first = proj_->forward(in, w_q_first);
      s.c_kv = proj_->forward(in, kv_a_latent(wkv_a_));
      s.k_pe = proj_->forward(in, kv_a_rope(wkv_a_));
    }
    Tensor q_raw = q_first;
    if (q_latent) {
      s.q_a = q_first;
      s.q_a_norm = proj_->norm(s.q_a, q_a_norm_w_, kLatentNormEps);
      q_raw = proj_->forward(proj_->rows(s.q_a_norm), wq_b_);  // this rank's heads
    }
    s.q = ops::rope_forward(q_raw, positions, q_rope_);
    s.kv_a_norm = proj_->norm(s.c_kv, kv_a_norm_w_, kLatentNormEps);
    Tensor kv = proj_->forward(proj_->rows(s.kv_a_norm), wkv_b_);
    s.kv = ops::mla_kv_forward(kv, ops::rope_forward(s.k_pe, positions, k_rope_), heads_, cfg_.qk_nope_head_dim,
                               cfg_.v_head_dim);
    s.attn = attend(s.q, s.kv.k, s.kv.v, b, attn_shape(b));
    s.h = attention_output(*proj_, s.attn.out, wo_, x, b);
  }
  {
    StageScope t(Stage::kNorms);
    // FP8 experts: the tokens quantized with the norm, for the dispatch and the shared experts.
    s.ln2 = proj_->norm(s.h, ln2_w_, eps, experts_read_fp8());
    s.mlp_in = s.ln2.y;
    s.mlp_in_q = std::exchange(s.ln2.y_q, {});
    s.residual = s.h;
  }
  if (has_shared()) {
    StageScope t(Stage::kExpertGemm);
    s.shared = proj_->experts_forward(s.ln2.y, shared_counts(b.rows()), ws_gate_, ws_up_, ws_down_, s.mlp_in_q);
    s.residual = s.shared.y.clone();
    ops::add_(s.residual, s.h);
  }
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    // In f32, as HF's DeepseekV3TopkRouter computes them: bf16 logits would break near-ties
    // among 256 experts otherwise than HF.
    s.router_logits = ops::linear_forward_f32_out(s.ln2.y, gate_w_);
    s.route = ops::router_sigmoid_forward(s.router_logits, score_bias_, cfg_.num_experts_per_tok, cfg_.n_group,
                                          cfg_.topk_group, cfg_.norm_topk_prob, cfg_.routed_scaling_factor);
  }
}

// Stage 3. Per expert e over its rows: W_down[e] (silu(W_gate[e] x) * W_up[e] x).
Tensor DeepseekV3DecoderLayer::mlp_forward(LayerState& state, const RowPart& part) const {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  return swiglu_mlp_forward(*proj_, s.expert_in, w_gate_, w_up_, w_down_, part, s.mlp);
}

Tensor DeepseekV3DecoderLayer::mlp_backward_input(const Tensor& d_rows_out, LayerState& state, const RowPart& part) const {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  s.d_mlp_out = d_rows_out;
  return swiglu_mlp_backward_input(*proj_, d_rows_out, std::exchange(s.dispatch.d_rows_q, {}), s.expert_in, s.mlp,
                                   w_gate_, w_up_, w_down_, part, s.d_mlp);
}

// Backward of stage 1, in reverse: router and shared experts -> ln2 (+ residual) -> o_proj
// -> attention -> keys/values and RoPE -> the MLA projections and norms -> ln1 (+ residual).
Tensor DeepseekV3DecoderLayer::attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in,
                                                   const Tensor& d_topk_weight, const Tensor& d_probs_extra,
                                                   const Tensor& d_logits_extra, const Tensor& positions,
                                                   const BatchShape& b, LayerState& state) const {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  s.d_ln2_out = std::move(d_mlp_in);
  if (moe_) {
    StageScope t(Stage::kRouterPermute);
    s.d_router_logits = ops::router_sigmoid_backward(d_topk_weight, d_probs_extra, s.route, cfg_.norm_topk_prob,
                                                     cfg_.routed_scaling_factor);
    if (d_logits_extra.defined()) ops::add_(s.d_router_logits, d_logits_extra);
    ops::linear_backward_input_add(s.d_router_logits, gate_w_, s.d_ln2_out);
  }
  if (has_shared()) {  // the shared experts' output is part of the residual: d shared.y = dy
    StageScope t(Stage::kExpertGemm);
    s.d_layer_out = dy_residual;
    s.d_shared = proj_->experts_backward_input(dy_residual, shared_counts(b.rows()), s.shared.gate, s.shared.up,
                                               ws_gate_, ws_up_, ws_down_);
    ops::add_(s.d_ln2_out, s.d_shared.dx);
  }
  {
    StageScope t(Stage::kNorms);
    s.d_h = ops::rmsnorm_backward_input(s.d_ln2_out, s.h, ln2_w_, s.ln2.rstd, dy_residual);
  }
  {
    StageScope t(Stage::kAttention);
    const Tensor d_attn = attention_output_backward(*proj_, s.d_h, wo_, b, &s.d_h_all);
    ops::AttentionGrads g = attend_backward(d_attn, s.q, s.kv.k, s.kv.v, b, s.attn.out, s.attn.lse, attn_shape(b));
    // The GPU's one-pass attention backward may leave dq in f32 (ops.h); RoPE takes q's dtype.
    if (g.dq.dtype() != s.q.dtype()) g.dq = g.dq.to(s.q.dtype());
    s.d_q_raw = ops::rope_backward(g.dq, positions, q_rope_);
    ops::MlaKvGrads dkv = ops::mla_kv_backward(g.dk, g.dv, heads_, cfg_.qk_nope_head_dim, cfg_.v_head_dim);
    s.d_kv = std::move(dkv.dkv);
    s.d_k_pe = ops::rope_backward(dkv.dk_rot, positions, k_rope_);
    s.d_kv_a_norm_out = proj_->backward_input(s.d_kv, wkv_b_);
    s.d_c_kv = ops::rmsnorm_backward_input(s.d_kv_a_norm_out, s.c_kv, kv_a_norm_w_, s.kv_a_norm.rstd);
    if (cfg_.q_lora_rank > 0) {
      s.d_q_a_norm_out = proj_->backward_input(s.d_q_raw, wq_b_);
      s.d_q_a = ops::rmsnorm_backward_input(s.d_q_a_norm_out, s.q_a, q_a_norm_w_, s.q_a_norm.rstd);
    }
    // d n1 of rows [r0, r0 + n) through the first projections: this rank's heads' part (summed
    // over the ranks under tensor parallelism).
    auto d_ln1 = [&](int64_t r0, int64_t n) {
      auto rows = [&](const Tensor& d) { return n == d.size(0) ? d : d.slice(r0, r0 + n); };
      Tensor d = cfg_.q_lora_rank > 0 ? proj_->backward_input(rows(s.d_q_a), wq_a_)
                                      : proj_->backward_input(rows(s.d_q_raw), wq_);
      proj_->backward_input_add(rows(s.d_c_kv), kv_a_latent(wkv_a_), d);
      proj_->backward_input_add(rows(s.d_k_pe), kv_a_rope(wkv_a_), d);
      return d;
    };
    s.d_ln1_out = b.tensor ? b.tensor->reduce_scatter_rows(b.tokens(), d_ln1) : d_ln1(0, s.d_c_kv.size(0));
  }
  StageScope t(Stage::kNorms);
  return ops::rmsnorm_backward_input(s.d_ln1_out, s.x, ln1_w_, s.ln1.rstd, s.d_h);
}

void DeepseekV3DecoderLayer::backward_weight(LayerState& state, bool accumulate, ops::SumSquaresInto squares,
                                             bool defer_experts) {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
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
    if (has_shared()) {
      swiglu_weight_grads({s.d_layer_out, s.ln2.y, shared_counts(s.ln2.y.size(0)), s.shared.gate, s.shared.up,
                           s.d_shared.dgate, s.d_shared.dup, s.shared.act},
                          g_ws_gate_, g_ws_up_, g_ws_down_, accumulate, {},
                          proj_->fp8_experts_wgrad(g_ws_gate_.size(2), g_ws_gate_.size(1)));
    }
  }
  {
    StageScope t(Stage::kAttention);
    proj_->backward_weight(s.d_h_all.defined() ? s.d_h_all : s.d_h, s.attn.out, g_wo_, accumulate);
    // quantized once for the three
    const Projections::Input in = proj_->tokens(s.ln1_all.defined() ? s.ln1_all : s.ln1.y);
    if (cfg_.q_lora_rank > 0) {
      proj_->backward_weight(s.d_q_raw, s.q_a_norm.y, g_wq_b_, accumulate);
      proj_->backward_weight(s.d_q_a, in, g_wq_a_, accumulate);
    } else {
      proj_->backward_weight(s.d_q_raw, in, g_wq_, accumulate);
    }
    proj_->backward_weight(s.d_kv, s.kv_a_norm.y, g_wkv_b_, accumulate);
    Tensor g_latent = kv_a_latent(g_wkv_a_), g_rope = kv_a_rope(g_wkv_a_);
    proj_->backward_weight(s.d_c_kv, in, g_latent, accumulate);
    proj_->backward_weight(s.d_k_pe, in, g_rope, accumulate);
  }
  StageScope t(Stage::kNorms);
  ops::rmsnorm_backward_weight(s.d_ln2_out, s.h, s.ln2.rstd, g_ln2_w_, accumulate);
  ops::rmsnorm_backward_weight(s.d_kv_a_norm_out, s.c_kv, s.kv_a_norm.rstd, g_kv_a_norm_w_, accumulate);
  if (cfg_.q_lora_rank > 0) {
    ops::rmsnorm_backward_weight(s.d_q_a_norm_out, s.q_a, s.q_a_norm.rstd, g_q_a_norm_w_, accumulate);
  }
  ops::rmsnorm_backward_weight(s.d_ln1_out, s.x, s.ln1.rstd, g_ln1_w_, accumulate);
}

// The plain path: stage 1, then each token's experts evaluated one by one.
// Selective recomputation: the four norms' outputs (ln1, the query and key/value latents',
// ln2), made again from x, q_a, c_kv and h (their rstd are the same bits again). The queries
// and keys stay: they come out of GEMMs.
void DeepseekV3DecoderLayer::drop_recomputable(LayerState& state) const {
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  s.ln1.y = s.q_a_norm.y = s.kv_a_norm.y = s.ln2.y = s.mlp_in = Tensor();
}

void DeepseekV3DecoderLayer::recompute_dropped(LayerState& state, const Tensor& positions) const {
  (void)positions;
  auto& s = static_cast<DeepseekV3LayerState&>(state);
  s.ln1 = ops::rmsnorm_forward(s.x, ln1_w_, cfg_.rms_norm_eps);
  if (cfg_.q_lora_rank > 0) s.q_a_norm = ops::rmsnorm_forward(s.q_a, q_a_norm_w_, kLatentNormEps);
  s.kv_a_norm = ops::rmsnorm_forward(s.c_kv, kv_a_norm_w_, kLatentNormEps);
  s.ln2 = ops::rmsnorm_forward(s.h, ln2_w_, cfg_.rms_norm_eps);
  s.mlp_in = s.ln2.y;
}

Tensor DeepseekV3DecoderLayer::reference_forward(const Tensor& x, const Tensor& positions,
                                                 const BatchShape& b) const {
  MT_CHECK(!moe_ || w_gate_.size(0) == cfg_.n_routed_experts,
           "reference_forward needs every expert of layer {} in this process (expert parallelism holds {} of {})",
           id_, w_gate_.size(0), cfg_.n_routed_experts);
  DeepseekV3LayerState s;
  attn_forward(x, positions, b, s);
  const int64_t T = b.tokens();
  Tensor y = s.residual.clone();
  auto expert = [&](const Tensor& row, int64_t e) {  // row [1, H] -> [1, H]
    return swiglu_expert_reference(row, w_gate_.select(e), w_up_.select(e), w_down_.select(e));
  };
  const int64_t K = cfg_.num_experts_per_tok;
  for (int64_t t = 0; t < T; ++t) {
    Tensor row = s.ln2.y.slice(t, t + 1);
    Tensor yt = y.slice(t, t + 1);
    if (!moe_) {
      ops::add_(yt, expert(row, 0));
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      const auto e = static_cast<int64_t>(s.route.topk_idx.item(t * K + k));
      Tensor out = expert(row, e);
      ops::scale_(out, s.route.topk_weight.item(t * K + k));
      ops::add_(yt, out);
    }
  }
  return y;
}

// ---- model -------------------------------------------------------------------------------

namespace {

DecoderSpec decoder_spec(const DeepseekV3Config& c) {
  DecoderSpec s;
  s.vocab_size = c.vocab_size;
  s.hidden_size = c.hidden_size;
  s.num_layers = c.num_hidden_layers;
  s.num_experts = c.n_routed_experts;
  s.experts_per_token = c.num_experts_per_tok;
  s.rms_norm_eps = c.rms_norm_eps;
  s.initializer_range = c.initializer_range;
  s.tie_word_embeddings = c.tie_word_embeddings;
  s.router_bias_update_speed = c.router_bias_update_speed;
  s.seq_aux_loss_coef = c.seq_aux_loss_coef;
  s.mtp_layers = c.num_nextn_predict_layers;
  s.mtp_loss_weight = c.mtp_loss_weight;
  return s;
}

}  // namespace

DeepseekV3Model::DeepseekV3Model(DeepseekV3Config cfg, DType dtype, Device device, ModelPlacement placement)
    : MoeDecoderModel(decoder_spec(cfg), dtype, device, std::move(placement)), cfg_(std::move(cfg)) {
  cfg_.validate("model");
  build([&](int64_t id) {
    return std::make_unique<DeepseekV3DecoderLayer>(cfg_, id, this->dtype(), this->device(), this->placement(),
                                                   &this->projections());
  });
}

int64_t DeepseekV3Model::active_matmul_params() const {
  const int64_t H = cfg_.hidden_size, heads = cfg_.num_attention_heads, qk = cfg_.qk_head_dim();
  const int64_t r = cfg_.kv_lora_rank, rope = cfg_.qk_rope_head_dim;
  int64_t attn = cfg_.q_lora_rank > 0 ? H * cfg_.q_lora_rank + cfg_.q_lora_rank * heads * qk : H * heads * qk;
  attn += H * (r + rope) + r * heads * (cfg_.qk_nope_head_dim + cfg_.v_head_dim) + heads * cfg_.v_head_dim * H;
  // lm_head (the embedding lookup is no matmul); each multi-token prediction module its
  // eh_proj and head besides its layer.
  const int64_t D = cfg_.num_nextn_predict_layers;
  int64_t n = cfg_.vocab_size * H + D * (2 * H * H + cfg_.vocab_size * H);
  for (int64_t i = 0; i < cfg_.num_hidden_layers + D; ++i) {
    n += attn;
    if (cfg_.is_moe_layer(i)) {
      n += H * cfg_.n_routed_experts +
           (cfg_.num_experts_per_tok + cfg_.n_shared_experts) * 3 * H * cfg_.moe_intermediate_size;
    } else {
      n += 3 * H * cfg_.intermediate_size;
    }
  }
  return n;
}

// The attention's score and value products: 2 * S * (qk + v) per head and token forward,
// three times that with the backward (no causal discount, as for Qwen3).
double DeepseekV3Model::flops_per_token(int64_t seq) const {
  return 6.0 * static_cast<double>(active_matmul_params()) +
         6.0 * static_cast<double>((cfg_.num_hidden_layers + cfg_.num_nextn_predict_layers) * cfg_.num_attention_heads *
                                   (cfg_.qk_head_dim() + cfg_.v_head_dim) * seq);
}

}  // namespace moetrain
