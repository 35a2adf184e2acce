// Qwen3-MoE: the decoder-only MoE model of Hugging Face's Qwen3MoeForCausalLM, with its
// forward and backward written out by hand.
//
// Per layer: x -> RMSNorm -> attention (q/k per-head RMSNorm, RoPE, causal GQA) -> + x
//   -> RMSNorm -> router (softmax, top-k) -> experts (SwiGLU) -> weighted sum -> + residual.
// A layer is cut into the five stages of DESIGN.md §3; this file implements stages 1
// (attn), 3 (mlp) and 5 (aggregate); an ExpertDispatcher supplies 2 and 4. Backward
// mirrors them, split into backward_input (dgrad, needed at once by the layer below) and
// backward_weight (wgrad, deferrable). What every family shares (the chunk passes, the
// embedding and head, the router totals) is MoeDecoderModel's (decoder_model.h).
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/models/decoder_model.h"
#include "engine/models/projections.h"
#include "engine/models/model.h"
#include "engine/models/qwen3_moe_config.h"
#include "ops/ops.h"

namespace moetrain {

// What one decoder layer saves in forward and, during backward_input, the output
// gradients its deferred weight-gradient step needs (besides LayerState's exchange fields;
// mlp_in is ln2.y).
struct Qwen3MoeLayerState : LayerState {
  // forward, stage 1
  Tensor x;                        // layer input [T, H] (under tensor parallelism this rank's rows)
  ops::RmsNormOut ln1;             // input_layernorm
  Tensor ln1_all;                  // tensor parallelism: every row of ln1.y (the projections' input)
  Tensor q_raw, k_raw, v;          // projections, [T, heads * hd]
  ops::RmsNormOut q_norm, k_norm;  // per-head norms: their rstd (y, with RoPE, is moved into q, k)
  Tensor q, k;                     // after RoPE
  ops::AttentionOut attn;
  Tensor h;                        // x + o_proj(attention): the residual stream after attention
  ops::RmsNormOut ln2;             // post_attention_layernorm: the MLP input
  // stage 3
  ops::SwigluOut mlp;
  // backward_input results kept for backward_weight
  Tensor d_mlp_out;                // d mlp.y
  ops::SwigluInputGrads d_mlp;
  Tensor d_router_logits, d_ln2_out, d_h, d_q_raw, d_k_raw, d_v, d_ln1_out;
  Tensor d_h_all;                  // tensor parallelism: every row of d_h (o_proj's output gradient)
  Tensor dw_q_norm, dw_k_norm;     // the q/k norm weights' gradients of this micro-batch
};

class Qwen3MoeDecoderLayer : public DecoderLayer {
 public:
  Qwen3MoeDecoderLayer(const Qwen3MoeConfig& cfg, int64_t layer_id, DType dtype, Device device,
                       const ModelPlacement& placement = {}, const Projections* projections = nullptr);

  int64_t layer_id() const override { return id_; }
  bool is_moe() const override { return moe_; }
  std::unique_ptr<LayerState> new_state() const override { return std::make_unique<Qwen3MoeLayerState>(); }
  // Global id of this rank's first expert, and how many it holds (1 for a dense MLP).
  int64_t first_expert() const { return first_expert_; }
  int64_t local_experts() const { return w_gate_.size(0); }
  // The layer's flat weight buffers (attention + router (+ dense MLP), and the experts),
  // until the model takes them over.
  std::vector<ParamBucket>& buckets() override { return buckets_; }
  void collect_parameters(ParameterList& out) override;

  // Stage 1: fills s.h (= s.residual, the residual stream) and s.ln2.y (= s.mlp_in, the MLP
  // input) and, for an MoE layer, s.route (top-k experts and weights).
  void attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b, LayerState& s) const override;
  // Stage 3: SwiGLU over s.expert_in (grouped by expert), into s.mlp; returns s.mlp.y.
  Tensor mlp_forward(LayerState& s, const RowPart& part = {}) const override;
  bool experts_read_fp8() const override { return moe_ && proj_->fp8_experts(w_gate_.size(2), w_gate_.size(1)); }
  // Backward of stage 3: d rows -> d expert_in rows.
  Tensor mlp_backward_input(const Tensor& d_rows_out, LayerState& s, const RowPart& part = {}) const override;
  // Backward of stage 1: given d h (residual + aggregate), d mlp_in (from dispatch backward;
  // taken over: the router's input gradient is added into it in place), d topk_weight and
  // the router's extra d probs (aux losses, may be undefined), returns d x.
  Tensor attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in, const Tensor& d_topk_weight,
                             const Tensor& d_probs_extra, const Tensor& d_logits_extra, const Tensor& positions,
                             const BatchShape& b, LayerState& s) const override;
  // Every weight gradient of the layer, from what backward_input saved; added into the
  // gradients, or written over them when !accumulate.
  // squares: passed to the expert weight-gradient op (see WeightHooks::expert_grad_squares).
  // defer_experts (MoE layers): keep the experts' weight-gradient inputs instead, and make
  // them in one pass with those of the next micro-batches, up to the first call that does not
  // defer (ops::grouped_swiglu_backward_weight_group, written or added per the first kept
  // micro-batch's `accumulate`); a call with accumulate false drops any kept from an earlier
  // step.
  void backward_weight(LayerState& s, bool accumulate = true, ops::SumSquaresInto squares = {},
                       bool defer_experts = false) override;
  void drop_deferred_expert_weights() override { expert_grads_.drop(); }
  bool writes_expert_grads(bool accumulate, bool defer_experts) const override {
    return expert_grads_.writes(moe_, accumulate, defer_experts);
  }

  // The plain path used to validate every layout: no dispatcher, each token's experts
  // evaluated directly. Returns the layer output.
  Tensor reference_forward(const Tensor& x, const Tensor& positions, const BatchShape& b) const override;
  void drop_recomputable(LayerState& s) const override;
  void recompute_dropped(LayerState& s, const Tensor& positions) const override;
  // Defined when the config balances without an auxiliary loss (router_bias_update_speed).
  Tensor* routing_bias() override { return score_bias_.defined() ? &score_bias_ : nullptr; }

 private:
  Qwen3MoeConfig cfg_;
  int64_t id_;
  bool moe_;
  int64_t inter_;  // FFN width of this layer's MLP (a dense one's: this tp rank's columns)
  int64_t first_expert_ = 0;
  int64_t tp_ = 1, tp_rank_ = 0;  // tensor-parallel ranks (the heads split over them) and this one
  // Fewer key/value heads than tp ranks: k_proj and v_proj are held whole on every tp rank
  // (with the norms), and this rank reads the rows of its query heads' one key/value head,
  // [kv_row_, kv_row_ + head_dim). 0 ranks per head: split by heads as q is.
  int64_t kv_ranks_per_head_ = 0, kv_row_ = 0;
  Tensor kv_rows(const Tensor& w) const;  // w itself, or the rows this rank's head reads
  std::vector<ParamBucket> buckets_;
  const Projections* proj_;  // the model's (BF16 when built alone)
  ops::AttentionShape attn_shape(const BatchShape& b) const;
  // weights (HF names in collect_parameters) and their gradients
  Tensor ln1_w_, ln2_w_, wq_, wk_, wv_, wo_, q_norm_w_, k_norm_w_, gate_w_;
  Tensor w_gate_, w_up_, w_down_;  // [E, I, H], [E, I, H], [E, H, I]; E = 1 for dense
  Tensor score_bias_;              // f32 [num_experts]: the router's selection bias, or undefined
  Tensor g_ln1_w_, g_ln2_w_, g_wq_, g_wk_, g_wv_, g_wo_, g_q_norm_w_, g_k_norm_w_, g_gate_w_;
  Tensor g_w_gate_, g_w_up_, g_w_down_;
  ExpertWeightGrads expert_grads_;  // the experts' weight gradients, made or deferred
};

// Qwen3MoeForCausalLM: the shared decoder skeleton over Qwen3-MoE layers, with HF's
// load-balancing loss over all MoE layers (and moetrain's optional z-loss).
class Qwen3MoeModel : public MoeDecoderModel {
 public:
  Qwen3MoeModel(Qwen3MoeConfig cfg, DType dtype, Device device = Device::cpu(), ModelPlacement placement = {});

  const Qwen3MoeConfig& config() const { return cfg_; }
  const ModelConfig& model_config() const override { return cfg_; }
  // Training FLOPs per token: 6 * active matmul parameters + 12 * layers * heads * head_dim * seq
  // (of the whole model, whatever part this rank holds).
  double flops_per_token(int64_t seq) const override;
  int64_t active_matmul_params() const override;

 private:
  Qwen3MoeConfig cfg_;
};

}  // namespace moetrain
