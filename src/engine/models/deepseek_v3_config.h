// DeepseekV3Config: the DeepSeek-V3 family's shape (DeepSeek-V3/R1, Kimi K2, Moonlight), with
// Hugging Face config.json key names (transformers 5's DeepseekV3Config) so that an HF config
// reads as it is. Issue 29 builds the family on it; until its model exists the family is not
// registered (models/factory.cpp), so a run cannot name it yet.
//
// RoPE's parameters (HF: the rope_parameters object, or the older rope_scaling) are flat
// keys here: rope_theta, rope_type ("default" or "yarn") and, for YaRN, rope_factor,
// rope_original_max_position_embeddings, rope_beta_fast, rope_beta_slow, rope_mscale and
// rope_mscale_all_dim.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/models/model_config.h"

namespace moetrain {

struct DeepseekV3Config : ModelConfig {
  DeepseekV3Config() : ModelConfig("deepseek_v3") {}
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<DeepseekV3Config>(*this); }

  // moetrain's defaults: a tiny model of the family's every feature (q_lora, yarn, groups,
  // a shared expert, a dense first layer) for the CPU.
  int64_t vocab_size = 257;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 128;      // the first_k_dense_replace dense layers' MLP
  int64_t moe_intermediate_size = 32;   // each routed and shared expert's FFN width
  int64_t num_hidden_layers = 3;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;      // MLA: every head has its own key and value
  int64_t n_shared_experts = 1;
  int64_t n_routed_experts = 8;
  double routed_scaling_factor = 2.5;
  int64_t kv_lora_rank = 32;
  int64_t q_lora_rank = 48;             // 0: no query down-projection (HF's null)
  int64_t qk_rope_head_dim = 8;
  int64_t v_head_dim = 16;
  int64_t qk_nope_head_dim = 16;
  int64_t n_group = 4;
  int64_t topk_group = 2;
  int64_t num_experts_per_tok = 2;
  int64_t first_k_dense_replace = 1;
  bool norm_topk_prob = true;
  int64_t max_position_embeddings = 4096;
  double initializer_range = 0.02;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool rope_interleave = true;  // the rotary dims paired as (0,1), (2,3), ... (HF's default)
  double rope_theta = 10000.0;
  std::string rope_type = "yarn";
  double rope_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 1024;
  double rope_beta_fast = 32.0;
  double rope_beta_slow = 1.0;
  double rope_mscale = 1.0;
  double rope_mscale_all_dim = 1.0;
  // Multi-token prediction modules after the last layer (DeepSeek's config.json key; HF's
  // model ignores them); moetrain's weight of their loss.
  int64_t num_nextn_predict_layers = 0;
  double mtp_loss_weight = 0.3;
  // moetrain's keys for DeepSeek-V3's balancing: the routing bias's step after each optimizer
  // step (aux-loss-free; 0 = off) and the weight of the sequence-wise auxiliary loss (0 = off).
  double router_bias_update_speed = 0.001;
  double seq_aux_loss_coef = 0.0;

  void describe(ConfigFields& f) override;
  // Cross-field checks (heads, groups, ranks, the RoPE parameters); errors name the key.
  void validate(const std::string& origin) const override;
  // Heads, the vocabulary and the dense MLP width divide by tp; the sequence-wise balance loss
  // and the multi-token prediction modules are not built under tensor parallelism yet.
  void validate_tensor_parallel(int64_t tp, const std::string& origin) const override;
  // Reads an HF config.json as transformers does: every key DeepseekV3ForCausalLM reads, in
  // transformers 5's spelling and the older ones (rope_scaling, rope_theta at the top,
  // num_local_experts), and DeepSeek's own config.json keys (scoring_func "sigmoid",
  // topk_method "noaux_tc", moe_layer_freq 1, num_nextn_predict_layers); a key the file omits
  // takes transformers' default; any other key is an error naming it.
  void load_hf_json(const std::string& path) override;
  // The HF config.json text of this shape (DeepseekV3ForCausalLM, transformers 5's spelling).
  std::string to_hf_json() const override;
  ModelShape shape() const override;
  LayerFootprint layer_footprint(int64_t id, int act) const override;
  int64_t outer_params() const override;

  // Layer i has routed experts (HF: i >= first_k_dense_replace).
  bool is_moe_layer(int64_t i) const { return i >= first_k_dense_replace; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // The attention's softmax scale: qk_head_dim^-0.5, times mscale^2 under YaRN where
  // mscale = 0.1 * rope_mscale_all_dim * ln(rope_factor) + 1 (HF's DeepseekV3Attention).
  double softmax_scale() const;
  // RoPE's inverse frequencies for the qk_rope_head_dim rotary dims (one per pair): theta^(-2i/d),
  // or under YaRN a blend per pair of that (extrapolation: pairs of many rotations in the
  // original context) and it divided by rope_factor (interpolation: pairs of few), ramped
  // linearly between the pairs that make rope_beta_fast and rope_beta_slow rotations
  // (transformers' YaRN, its correction range truncated to whole pairs).
  std::vector<double> rope_inv_freq() const;
  // What YaRN multiplies cos and sin by: mscale(factor, rope_mscale) / mscale(factor,
  // rope_mscale_all_dim) when both are set, else mscale(factor, 1); 1 without YaRN.
  double rope_attention_factor() const;
};

}  // namespace moetrain
