// DeepSeek-V3: the decoder-only MoE model of Hugging Face's DeepseekV3ForCausalLM
// (DeepSeek-V3/R1, Kimi K2, Moonlight), with its forward and backward written out by hand.
//
// Per layer: x -> RMSNorm -> multi-head latent attention -> + x -> RMSNorm -> MLP -> + h.
//   MLA: queries from a low-rank latent (q_a_proj, its RMSNorm, q_b_proj) or directly
//   (q_proj when q_lora_rank is 0); keys and values from one compressed latent (the first
//   kv_lora_rank columns of kv_a_proj_with_mqa, its RMSNorm, kv_b_proj) plus a rotary key
//   k_pe every head shares (the last qk_rope_head_dim columns); RoPE (YaRN) on the last
//   qk_rope_head_dim dims of each query head and on k_pe; causal attention with query/key
//   heads of nope + rope dims and value heads of v_head_dim.
//   MLP: the first first_k_dense_replace layers a dense SwiGLU; the others a sigmoid router
//   with group-limited top-k (ops::router_sigmoid_forward) over the routed experts, plus
//   n_shared_experts shared experts every token takes (one SwiGLU n times as wide).
// The shared experts are computed in stage 1 and added to the residual stream that the
// routed experts' combine (stage 5) adds into: h + shared(rms(h)) + sum_k w_k expert_k(rms(h)).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "engine/models/decoder_model.h"
#include "engine/models/projections.h"
#include "engine/models/deepseek_v3_config.h"
#include "engine/models/model.h"
#include "ops/ops.h"

namespace moetrain {

// What one decoder layer saves in forward and, during backward_input, what its deferred
// weight-gradient step needs (mlp_in is ln2.y).
struct DeepseekV3LayerState : LayerState {
  // forward, stage 1
  Tensor x;                    // layer input [T, H] (under tensor parallelism this rank's rows)
  ops::RmsNormOut ln1;         // input_layernorm
  Tensor ln1_all;              // tensor parallelism: every row of ln1.y (the latents' input)
  Tensor q_a;                  // q_a_proj(ln1) [T, q_lora_rank] (q_lora_rank > 0)
  ops::RmsNormOut q_a_norm;    // q_a_layernorm
  Tensor q;                    // the queries after RoPE [T, heads * (nope + rope)]
  Tensor c_kv;                 // the key/value latent [T, kv_lora_rank]
  ops::RmsNormOut kv_a_norm;   // kv_a_layernorm
  Tensor k_pe;                 // the shared rotary key before RoPE [T, rope]
  ops::MlaKv kv;               // keys (with the rotated k_pe) and values of every head
  ops::AttentionOut attn;      // [T, heads * v_head_dim]
  Tensor h;                    // x + o_proj(attention)
  ops::RmsNormOut ln2;         // post_attention_layernorm: the MLP input
  ops::SwigluOut shared;       // the shared experts over every row (MoE layers with some)
  // stage 3
  ops::SwigluOut mlp;
  // backward_input results kept for backward_weight
  Tensor d_mlp_out, d_layer_out;  // d mlp.y; the layer output's gradient (d shared.y)
  ops::SwigluInputGrads d_mlp, d_shared;
  Tensor d_router_logits, d_ln2_out, d_h, d_q_raw, d_q_a_norm_out, d_q_a, d_kv, d_kv_a_norm_out, d_c_kv, d_k_pe,
      d_ln1_out;
  Tensor d_h_all;              // tensor parallelism: every row of d_h (o_proj's output gradient)
};

class DeepseekV3DecoderLayer : public DecoderLayer {
 public:
  DeepseekV3DecoderLayer(const DeepseekV3Config& cfg, int64_t layer_id, DType dtype, Device device,
                         const ModelPlacement& placement = {}, const Projections* projections = nullptr);

  int64_t layer_id() const override { return id_; }
  bool is_moe() const override { return moe_; }
  std::unique_ptr<LayerState> new_state() const override { return std::make_unique<DeepseekV3LayerState>(); }
  std::vector<ParamBucket>& buckets() override { return buckets_; }
  void collect_parameters(ParameterList& out) override;

  // Stage 1: MLA, the residual, the MLP input, the shared experts into the residual, and for
  // an MoE layer the route.
  void attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b, LayerState& s) const override;
  // Stage 3: the routed experts (or the dense MLP) over s.expert_in.
  Tensor mlp_forward(LayerState& s, const RowPart& part = {}) const override;
  bool experts_read_fp8() const override { return moe_ && proj_->fp8_experts(w_gate_.size(2), w_gate_.size(1)); }
  Tensor mlp_backward_input(const Tensor& d_rows_out, LayerState& s, const RowPart& part = {}) const override;
  // Backward of stage 1 (router, shared experts, ln2, o_proj, attention, RoPE, the MLA
  // projections and norms, ln1); returns d x.
  Tensor attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in, const Tensor& d_topk_weight,
                             const Tensor& d_probs_extra, const Tensor& d_logits_extra, const Tensor& positions,
                             const BatchShape& b, LayerState& s) const override;
  void backward_weight(LayerState& s, bool accumulate = true, ops::SumSquaresInto squares = {},
                       bool defer_experts = false) override;
  void drop_deferred_expert_weights() override { expert_grads_.drop(); }
  bool writes_expert_grads(bool accumulate, bool defer_experts) const override {
    return expert_grads_.writes(moe_, accumulate, defer_experts);
  }
  Tensor reference_forward(const Tensor& x, const Tensor& positions, const BatchShape& b) const override;
  void drop_recomputable(LayerState& s) const override;
  void recompute_dropped(LayerState& s, const Tensor& positions) const override;
  // e_score_correction_bias: every MoE layer has one (HF's checkpoints carry it), moved
  // after each step when router_bias_update_speed > 0.
  Tensor* routing_bias() override { return score_bias_.defined() ? &score_bias_ : nullptr; }

 private:
  DeepseekV3Config cfg_;
  int64_t id_;
  bool moe_;
  int64_t inter_;  // FFN width of this layer's MLP (one routed expert's, or the dense MLP's tp columns)
  int64_t first_expert_ = 0;
  // Tensor parallelism: the heads (q_b / q, kv_b, o_proj) and a dense MLP's columns split over
  // tp ranks; the latents' projections and norms, the router and the shared experts held whole.
  int64_t tp_ = 1, tp_rank_ = 0;
  int64_t heads_ = 0;  // this rank's attention heads
  std::vector<ParamBucket> buckets_;
  const Projections* proj_;  // the model's (BF16 when built alone)
  ops::RopeSpec q_rope_, k_rope_;
  RowCounts shared_counts_;  // [1] = T: the shared experts' one group
  ops::AttentionShape attn_shape(const BatchShape& b) const;
  const Tensor& shared_counts(int64_t tokens) const { return shared_counts_.of(tokens, ln1_w_.device()); }
  bool has_shared() const { return moe_ && cfg_.n_shared_experts > 0; }
  // kv_a_proj_with_mqa's two parts: the latent's rows and k_pe's rows (views).
  Tensor kv_a_latent(const Tensor& w) const { return w.slice(0, cfg_.kv_lora_rank); }
  Tensor kv_a_rope(const Tensor& w) const {
    return w.slice(cfg_.kv_lora_rank, cfg_.kv_lora_rank + cfg_.qk_rope_head_dim);
  }
  // weights (HF names in collect_parameters) and their gradients
  Tensor ln1_w_, ln2_w_, wq_a_, q_a_norm_w_, wq_b_, wq_, wkv_a_, kv_a_norm_w_, wkv_b_, wo_, gate_w_;
  Tensor w_gate_, w_up_, w_down_;         // routed experts [E, I, H], [E, I, H], [E, H, I]; E = 1 dense
  Tensor ws_gate_, ws_up_, ws_down_;      // shared experts [1, n*I, H], [1, n*I, H], [1, H, n*I]
  Tensor score_bias_;                     // f32 [n_routed_experts] (MoE layers)
  Tensor g_ln1_w_, g_ln2_w_, g_wq_a_, g_q_a_norm_w_, g_wq_b_, g_wq_, g_wkv_a_, g_kv_a_norm_w_, g_wkv_b_, g_wo_,
      g_gate_w_;
  Tensor g_w_gate_, g_w_up_, g_w_down_, g_ws_gate_, g_ws_up_, g_ws_down_;
  ExpertWeightGrads expert_grads_;  // the experts' weight gradients, made or deferred
};

// DeepseekV3ForCausalLM: the shared decoder skeleton over DeepSeek-V3 layers. Its balancing
// is aux-loss-free (the routing bias, router_bias_update_speed), with DeepSeek's optional
// sequence-wise balance loss (seq_aux_loss_coef); HF's model computes neither (the
// "aux_loss" metric is the skeleton's load statistic, not trained).
class DeepseekV3Model : public MoeDecoderModel {
 public:
  DeepseekV3Model(DeepseekV3Config cfg, DType dtype, Device device = Device::cpu(), ModelPlacement placement = {});

  const DeepseekV3Config& config() const { return cfg_; }
  const ModelConfig& model_config() const override { return cfg_; }
  // 6 * active matmul parameters + 6 * layers * heads * (qk_head_dim + v_head_dim) * seq.
  double flops_per_token(int64_t seq) const override;
  int64_t active_matmul_params() const override;

 private:
  DeepseekV3Config cfg_;
};

}  // namespace moetrain
