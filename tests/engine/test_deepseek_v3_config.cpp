// DeepseekV3Config (issue 29): a DeepSeek-V3 config.json read as transformers reads it, every
// value checked (none equal to moetrain's or transformers' default, so an unread key shows),
// the older spelling, the q_lora_rank = null form, written back and read again the same, and
// what it refuses, naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/checkpoint/safetensors.h"
#include "engine/models/deepseek_v3_config.h"
#include "scratch_dir.h"

namespace moetrain {
namespace {

using DeepseekV3ConfigTest = ScratchDirTest;
#define EXPECT_ERROR(f, part)                                  \
  do {                                                         \
    const std::string message = error_of(f);                   \
    EXPECT_NE(message.find(part), std::string::npos) << message; \
  } while (0)

// DeepSeek's config.json layout (its own keys: scoring_func, topk_method, moe_layer_freq,
// ep_size, aux_loss_alpha, seq_aux, num_nextn_predict_layers), the older rope_scaling spelling
// with YaRN, at a small shape.
const char* kDeepSeekJson = R"({
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
  "vocab_size": 1001, "hidden_size": 96, "intermediate_size": 200, "moe_intermediate_size": 24,
  "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 6, "n_shared_experts": 2,
  "n_routed_experts": 12, "routed_scaling_factor": 1.75, "kv_lora_rank": 40, "q_lora_rank": 56,
  "qk_rope_head_dim": 12, "v_head_dim": 20, "qk_nope_head_dim": 28, "n_group": 3, "topk_group": 2,
  "num_experts_per_tok": 3, "first_k_dense_replace": 2, "norm_topk_prob": false,
  "max_position_embeddings": 6000, "initializer_range": 0.011, "rms_norm_eps": 1e-05,
  "tie_word_embeddings": true, "rope_interleave": false, "rope_theta": 20000.0,
  "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 150,
                   "beta_fast": 24, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.7},
  "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
  "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": true, "hidden_act": "silu", "attention_bias": false,
  "attention_dropout": 0.0, "pretraining_tp": 1, "use_cache": true, "bos_token_id": 0, "eos_token_id": 1,
  "transformers_version": "4.46.3"
})";

TEST_F(DeepseekV3ConfigTest, ReadsDeepSeeksConfigJson) {
  DeepseekV3Config c;
  c.load_hf_json(file("config.json", kDeepSeekJson));
  EXPECT_EQ(c.vocab_size, 1001);
  EXPECT_EQ(c.hidden_size, 96);
  EXPECT_EQ(c.intermediate_size, 200);
  EXPECT_EQ(c.moe_intermediate_size, 24);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.num_key_value_heads, 6);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.n_routed_experts, 12);
  EXPECT_EQ(c.routed_scaling_factor, 1.75);
  EXPECT_EQ(c.kv_lora_rank, 40);
  EXPECT_EQ(c.q_lora_rank, 56);
  EXPECT_EQ(c.qk_rope_head_dim, 12);
  EXPECT_EQ(c.v_head_dim, 20);
  EXPECT_EQ(c.qk_nope_head_dim, 28);
  EXPECT_EQ(c.n_group, 3);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.first_k_dense_replace, 2);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.max_position_embeddings, 6000);
  EXPECT_EQ(c.initializer_range, 0.011);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.rope_interleave);
  EXPECT_EQ(c.rope_theta, 20000.0);
  EXPECT_EQ(c.rope_type, "yarn");
  EXPECT_EQ(c.rope_factor, 40.0);
  EXPECT_EQ(c.rope_original_max_position_embeddings, 150);
  EXPECT_EQ(c.rope_beta_fast, 24.0);
  EXPECT_EQ(c.rope_beta_slow, 2.0);
  EXPECT_EQ(c.rope_mscale, 0.8);
  EXPECT_EQ(c.rope_mscale_all_dim, 0.7);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  c.validate("config.json");
  EXPECT_FALSE(c.is_moe_layer(1));
  EXPECT_TRUE(c.is_moe_layer(2));
  EXPECT_EQ(c.qk_head_dim(), 40);
  // HF's DeepseekV3Attention: qk_head_dim^-0.5 * mscale^2, mscale = 0.1 * mscale_all_dim * ln(factor) + 1.
  const double m = 0.1 * 0.7 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), m * m / std::sqrt(40.0), 1e-15);
  EXPECT_EQ(c.shape().num_experts, 12);
  EXPECT_EQ(c.shape().experts_per_token, 3);
}

// num_nextn_predict_layers stands when the weights beside the config hold the module
// (DeepSeek's checkpoints) or when no weights are there; weights without it (transformers
// writes 1 and saves none) make a model without one.
TEST_F(DeepseekV3ConfigTest, MtpModulesFollowTheWeightsBesideTheConfig) {
  const float one = 1.0f;
  auto folder = [&](const std::string& name, bool with_module) {
    SafetensorsWriter w;
    w.add("model.embed_tokens.weight", DType::F32, {1}, &one);
    if (with_module) w.add("model.layers.5.eh_proj.weight", DType::F32, {1}, &one);
    const std::string config = file(name + "/config.json", kDeepSeekJson);  // 5 layers, num_nextn_predict_layers 1
    w.write(path(name + "/model.safetensors"));
    return config;
  };
  DeepseekV3Config with, without, alone;
  with.load_hf_json(folder("with", true));
  EXPECT_EQ(with.num_nextn_predict_layers, 1);
  EXPECT_EQ(with.shape().mtp_layers, 1);
  without.load_hf_json(folder("without", false));
  EXPECT_EQ(without.num_nextn_predict_layers, 0);
  alone.load_hf_json(file("alone/config.json", kDeepSeekJson));
  EXPECT_EQ(alone.num_nextn_predict_layers, 1);
  // A module needs a loss weight.
  with.mtp_loss_weight = 0;
  EXPECT_ERROR([&] { with.validate("run.toml"); }, "[model].mtp_loss_weight must be > 0");
}

// Written in transformers 5's spelling and read again: the same config; then the q_lora_rank
// = null form and omitted keys taking transformers' defaults.
TEST_F(DeepseekV3ConfigTest, RoundTripsAndTakesTransformersDefaults) {
  DeepseekV3Config a;
  a.load_hf_json(file("config.json", kDeepSeekJson));
  DeepseekV3Config b;
  b.load_hf_json(file("written.json", a.to_hf_json()));
  EXPECT_EQ(b.to_hf_json(), a.to_hf_json());
  EXPECT_EQ(b.rope_mscale_all_dim, 0.7);
  EXPECT_EQ(b.q_lora_rank, 56);

  DeepseekV3Config c;
  c.load_hf_json(file("small.json", R"({"model_type": "deepseek_v3", "q_lora_rank": null,
      "num_attention_heads": 16, "num_key_value_heads": null})"));
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.num_key_value_heads, 16) << "null: as many as the attention heads";
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.rope_type, "default");
  EXPECT_EQ(c.rope_original_max_position_embeddings, 4096);
  EXPECT_EQ(c.softmax_scale(), 1.0 / std::sqrt(192.0));
  DeepseekV3Config d;
  d.load_hf_json(file("null_q.json", c.to_hf_json()));
  EXPECT_EQ(d.q_lora_rank, 0);
}

// YaRN's frequencies at DeepSeek-V3's values (64 rotary dims, theta 1e4, factor 40, original
// context 4096, beta 32 and 1): the pair making 32 turns is 10.47 (floor 10), the one making
// 1 turn 22.51 (ceil 23), worked by hand from transformers' formula; pairs up to 10 keep
// their frequency, from 23 on it is divided by 40, linearly between.
TEST_F(DeepseekV3ConfigTest, YarnFrequenciesRampBetweenTheCorrectionPairs) {
  DeepseekV3Config c;
  c.qk_rope_head_dim = 64;
  c.rope_theta = 10000;
  c.rope_type = "yarn";
  c.rope_factor = 40;
  c.rope_original_max_position_embeddings = 4096;
  c.rope_beta_fast = 32;
  c.rope_beta_slow = 1;
  const std::vector<double> f = c.rope_inv_freq();
  ASSERT_EQ(f.size(), 32u);
  auto plain = [](int i) { return std::pow(10000.0, -2.0 * i / 64); };
  for (int i : {0, 5, 10}) EXPECT_DOUBLE_EQ(f[i], plain(i)) << "pair " << i;
  for (int i : {23, 30, 31}) EXPECT_DOUBLE_EQ(f[i], plain(i) / 40) << "pair " << i;
  const double ramp = 6.0 / 13.0;  // pair 16
  EXPECT_DOUBLE_EQ(f[16], plain(16) / 40 * ramp + plain(16) * (1 - ramp));
  // DeepSeek-V3's mscale = mscale_all_dim = 1: cos and sin unscaled; one of them absent: YaRN's own.
  c.rope_mscale = c.rope_mscale_all_dim = 1;
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 1.0);
  c.rope_mscale = 0;
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 0.1 * std::log(40.0) + 1);
  c.rope_type = "default";
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 1.0);
  EXPECT_DOUBLE_EQ(c.rope_inv_freq()[16], plain(16));
}

TEST_F(DeepseekV3ConfigTest, RefusesWhatItDoesNotImplementNamingTheKey) {
  auto load = [&](const std::string& json) {
    DeepseekV3Config c;
    c.load_hf_json(file("bad.json", json));
    c.validate("bad.json");
  };
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "scoring_func": "softmax"})"); },
                        "scoring_func");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "topk_method": "greedy"})"); }, "topk_method");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "longrope"}})"); },
               "RoPE type \"longrope\"");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "rope_parameters": {"attention_factor": 1}})"); },
               "\"attention_factor\" is not implemented");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "num_key_value_heads": 8})"); },
                        "num_key_value_heads (8) must equal [model].num_attention_heads (128)");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "n_group": 7})"); }, "n_group (7)");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "q_lora_rank": -3})"); }, "q_lora_rank");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "moe_gate_bias": true})"); }, "moe_gate_bias");
  // DeepSeek's FP8 quantization_config describes the stored weights (convert dequantizes
  // them); another quantization is named.
  load(R"({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "awq"}})"); },
               "\"quantization_config\" = {\"quant_method\":\"awq\"}");
  // The sizes transformers 5 derives and writes (head_dim = qk_rope_head_dim, qk_head_dim =
  // nope + rope) are read and must agree.
  load(R"({"model_type": "deepseek_v3", "qk_nope_head_dim": 10, "qk_rope_head_dim": 12, "head_dim": 12,
           "qk_head_dim": 22})");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "qk_rope_head_dim": 12, "head_dim": 16})"); },
               "head_dim");
  EXPECT_ERROR([&] { load(R"({"model_type": "deepseek_v3", "qk_nope_head_dim": 10, "qk_head_dim": 20})"); },
               "qk_head_dim");
  EXPECT_ERROR([&] { load(R"({"model_type": "qwen3_moe"})"); }, "deepseek_v3");
  DeepseekV3Config ok;
  ok.validate("moetrain defaults");
}

}  // namespace
}  // namespace moetrain
