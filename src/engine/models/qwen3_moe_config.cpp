#include "engine/models/qwen3_moe_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain {

void Qwen3MoeConfig::describe(ConfigFields& f) {
  f.add("model_type", &model_type, "model family; only qwen3_moe", one_of(&model_type, {"qwen3_moe"}));
  f.add("vocab_size", &vocab_size, "rows of the embedding and the LM head", positive(&vocab_size));
  f.add("hidden_size", &hidden_size, "width of the residual stream", positive(&hidden_size));
  f.add("intermediate_size", &intermediate_size, "FFN width of the dense (non-MoE) MLP layers",
        positive(&intermediate_size));
  f.add("moe_intermediate_size", &moe_intermediate_size, "FFN width of each routed expert",
        positive(&moe_intermediate_size));
  f.add("num_hidden_layers", &num_hidden_layers, "decoder layers", positive(&num_hidden_layers));
  f.add("num_attention_heads", &num_attention_heads, "query heads", positive(&num_attention_heads));
  f.add("num_key_value_heads", &num_key_value_heads, "key/value heads (grouped-query attention)",
        positive(&num_key_value_heads));
  f.add("head_dim", &head_dim, "width of one attention head", positive(&head_dim));
  f.add("num_experts", &num_experts, "routed experts per MoE layer (0: every layer dense)", non_negative(&num_experts));
  f.add("num_experts_per_tok", &num_experts_per_tok, "experts each token is routed to (top-k)",
        positive(&num_experts_per_tok));
  f.add("norm_topk_prob", &norm_topk_prob, "renormalise the top-k router weights to sum to 1");
  f.add("decoder_sparse_step", &decoder_sparse_step, "every N-th layer is MoE (layer i when (i+1) % N == 0)",
        positive(&decoder_sparse_step));
  f.add("mlp_only_layers", &mlp_only_layers, "layer ids that use the dense MLP instead of experts");
  f.add("rope_theta", &rope_theta, "RoPE base frequency", positive(&rope_theta));
  f.add("rms_norm_eps", &rms_norm_eps, "epsilon of every RMSNorm", positive(&rms_norm_eps));
  f.add("tie_word_embeddings", &tie_word_embeddings, "LM head shares the embedding matrix");
  f.add("initializer_range", &initializer_range, "std of the normal weight initialisation",
        positive(&initializer_range));
  f.add("max_position_embeddings", &max_position_embeddings, "longest sequence the model supports",
        positive(&max_position_embeddings));
  f.add("router_aux_loss_coef", &router_aux_loss_coef, "weight of the load-balancing auxiliary loss",
        non_negative(&router_aux_loss_coef));
  f.add("router_z_loss_coef", &router_z_loss_coef, "weight of the router z-loss (moetrain extra; 0 = off)",
        non_negative(&router_z_loss_coef));
  f.add("config_json", &config_json,
        "HF config.json read before the other [model] keys (relative to the TOML file's folder)");
}

void Qwen3MoeConfig::validate(const std::string& origin) const {
  Qwen3MoeConfig copy = *this;  // describe() needs mutable targets; the checks only read
  ConfigFields f("model");
  copy.describe(f);
  f.validate(origin);

  MT_CHECK(num_attention_heads % num_key_value_heads == 0,
           "{}: [model].num_attention_heads ({}) must be a multiple of [model].num_key_value_heads ({})", origin,
           num_attention_heads, num_key_value_heads);
  MT_CHECK(head_dim % 2 == 0, "{}: [model].head_dim must be even (RoPE rotates pairs), got {}", origin, head_dim);
  if (num_experts > 0) {
    MT_CHECK(num_experts_per_tok <= num_experts,
             "{}: [model].num_experts_per_tok ({}) must be <= [model].num_experts ({})", origin, num_experts_per_tok,
             num_experts);
  }
  for (int64_t id : mlp_only_layers) {
    MT_CHECK(id >= 0 && id < num_hidden_layers,
             "{}: [model].mlp_only_layers holds layer {}, outside [0, {}) (num_hidden_layers = {})", origin, id,
             num_hidden_layers, num_hidden_layers);
  }
}

namespace {

const char* json_type_name(const nlohmann::json& j) {
  if (j.is_number_integer()) return "integer";
  if (j.is_number_float()) return "float";
  return j.type_name();
}

}  // namespace

std::string Qwen3MoeConfig::to_hf_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["norm_topk_prob"] = norm_topk_prob;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["max_position_embeddings"] = max_position_embeddings;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["output_router_logits"] = false;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["use_cache"] = true;
  j["torch_dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

void Qwen3MoeConfig::load_hf_json(const std::string& path) {
  std::ifstream in(path);
  MT_CHECK(in.good(), "HF config '{}' cannot be opened (does it exist?)", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    MT_THROW("{}: invalid JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "{}: expected a JSON object at the top, got {}", path, j.type_name());

  // Keys that would change the architecture in ways moetrain does not implement.
  auto unsupported = [&](const std::string& key, const std::string& why) {
    MT_THROW("{}: unsupported architecture key \"{}\" = {}: {}", path, key, j.at(key).dump(), why);
  };
  if (j.contains("model_type") && j["model_type"] != "qwen3_moe") {
    unsupported("model_type", "moetrain reads qwen3_moe configs here");
  }
  if (j.contains("attention_bias") && !(j["attention_bias"].is_boolean() && !j["attention_bias"].get<bool>())) {
    unsupported("attention_bias", "Qwen3-MoE attention has no biases in moetrain");
  }
  if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
    unsupported("hidden_act", "only silu (SwiGLU) is implemented");
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    unsupported("rope_scaling", "RoPE scaling (YaRN, linear, dynamic) is not implemented");
  }
  if (j.contains("use_sliding_window") && !(j["use_sliding_window"].is_boolean() && !j["use_sliding_window"].get<bool>())) {
    unsupported("use_sliding_window", "sliding-window attention is not implemented");
  }
  if (j.contains("qkv_bias") && !(j["qkv_bias"].is_boolean() && !j["qkv_bias"].get<bool>())) {
    unsupported("qkv_bias", "Qwen3-MoE attention has no biases in moetrain");
  }

  ConfigFields fields("model");
  describe(fields);
  bool has_head_dim = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "config_json") continue;
    const ConfigFields::Field* f = fields.find(key);
    if (f == nullptr) continue;  // other HF keys (architectures, torch_dtype, ...) do not concern us
    if (key == "head_dim") has_head_dim = true;
    auto fail = [&](const char* expected) {
      MT_THROW("{}: key \"{}\" expects {}, got {} {}", path, key, expected, json_type_name(v), v.dump());
    };
    if (auto p = std::get_if<int64_t*>(&f->target)) {
      if (!v.is_number_integer()) fail("an integer");
      **p = v.get<int64_t>();
    } else if (auto p = std::get_if<double*>(&f->target)) {
      if (!v.is_number()) fail("a number");
      **p = v.get<double>();
    } else if (auto p = std::get_if<bool*>(&f->target)) {
      if (!v.is_boolean()) fail("a boolean");
      **p = v.get<bool>();
    } else if (auto p = std::get_if<std::string*>(&f->target)) {
      if (!v.is_string()) fail("a string");
      **p = v.get<std::string>();
    } else if (auto p = std::get_if<std::vector<int64_t>*>(&f->target)) {
      if (v.is_null()) {
        (*p)->clear();
        continue;
      }
      if (!v.is_array()) fail("a list of integers");
      std::vector<int64_t> out;
      for (const auto& item : v) {
        if (!item.is_number_integer()) fail("a list of integers");
        out.push_back(item.get<int64_t>());
      }
      **p = std::move(out);
    } else if (auto p = std::get_if<std::vector<std::string>*>(&f->target)) {
      if (!v.is_array()) fail("a list of strings");
      std::vector<std::string> out;
      for (const auto& item : v) {
        if (!item.is_string()) fail("a list of strings");
        out.push_back(item.get<std::string>());
      }
      **p = std::move(out);
    }
  }
  // HF: head_dim defaults to hidden_size / num_attention_heads.
  if (!has_head_dim && num_attention_heads > 0) head_dim = hidden_size / num_attention_heads;
}

bool Qwen3MoeConfig::is_moe_layer(int64_t i) const {
  const bool dense = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end();
  return !dense && num_experts > 0 && decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0;
}

}  // namespace moetrain
