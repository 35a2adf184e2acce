// Qwen3MoeConfig: the model's shape, with Hugging Face config.json key names so that an
// HF config can be read as it is (`config_json = "path/config.json"` in [model]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/models/model_config.h"

namespace moetrain {

struct Qwen3MoeConfig : ModelConfig {
  Qwen3MoeConfig() : ModelConfig("qwen3_moe") {}
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Qwen3MoeConfig>(*this); }

  int64_t vocab_size = 257;  // the byte tokenizer: 256 bytes + end-of-text
  int64_t hidden_size = 128;
  int64_t intermediate_size = 256;      // dense MLP layers (mlp_only_layers, sparse step)
  int64_t moe_intermediate_size = 128;  // each expert's FFN width
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
  int64_t head_dim = 32;
  int64_t num_experts = 8;
  int64_t num_experts_per_tok = 2;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t max_position_embeddings = 4096;
  double router_aux_loss_coef = 0.001;
  double router_z_loss_coef = 0.0;  // moetrain extra: ST-MoE z-loss, off by default
  // moetrain extra: DeepSeek-V3's aux-loss-free balancing for Qwen3-MoE's softmax router (a
  // selection bias per expert, moved after each step; 0 = off). Hugging Face's
  // Qwen3MoeForCausalLM has no such bias: an exported model routes without it.
  double router_bias_update_speed = 0.0;

  void describe(ConfigFields& f) override;
  // Cross-field checks (heads divide, experts_per_tok <= experts, ...). Throws naming the key.
  void validate(const std::string& origin) const override;
  // Heads, the vocabulary and every MLP width divide by tp; the key/value heads divide by tp
  // or divide tp (then tp / kv heads ranks share each key/value head).
  void validate_tensor_parallel(int64_t tp, const std::string& origin) const override;
  // Reads an HF config.json as transformers does: each key Qwen3MoeForCausalLM reads, in
  // either spelling (num_experts / num_local_experts, rope_theta / rope_parameters,
  // torch_dtype / dtype); a key the file omits takes transformers' default, not moetrain's.
  // A key that changes the architecture in a way moetrain does not implement, or any key
  // not on the lists of read and harmless keys, is an error naming it and its value.
  void load_hf_json(const std::string& path) override;
  // The HF config.json text of this shape in transformers 5's spelling (Qwen3MoeForCausalLM,
  // every key above but config_json and moetrain's router_z_loss_coef and router_bias_update_speed, plus the fixed ones
  // transformers needs: hidden_act silu, no attention bias, no sliding window).
  std::string to_hf_json() const override;
  ModelShape shape() const override;
  LayerFootprint layer_footprint(int64_t id, int act) const override;
  int64_t outer_params() const override;

  // Whether layer `i` has a routed MoE MLP (HF: not in mlp_only_layers, num_experts > 0,
  // and (i + 1) % decoder_sparse_step == 0).
  bool is_moe_layer(int64_t i) const;
};

}  // namespace moetrain
