#include "engine/models/qwen3_moe_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/models/hf_config.h"

namespace moetrain {

void Qwen3MoeConfig::describe(ConfigFields& f) {
  f.add("model_type", &model_type, fmt::format("model family ({})", fmt::join(model_families(), ", ")),
        one_of(&model_type, {"qwen3_moe"}));
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
  f.add("router_bias_update_speed", &router_bias_update_speed,
        "aux-loss-free balancing: each step a router's selection bias moves this far against its expert's load "
        "error (DeepSeek-V3; moetrain extra for Qwen3-MoE; 0 = off)",
        non_negative(&router_bias_update_speed));
  f.add("config_json", &config_json,
        "HF config.json read before the other [model] keys (relative to the TOML file's folder)");
}

void Qwen3MoeConfig::validate_tensor_parallel(int64_t tp, const std::string& origin) const {
  for (auto [key, v] : {std::pair{"num_attention_heads", num_attention_heads}, {"vocab_size", vocab_size},
                        {"intermediate_size", intermediate_size}}) {
    MT_CHECK(v % tp == 0,
             "{}: [model].{} = {} must be a multiple of tp: tensor parallelism gives each tp rank an equal share "
             "(whole heads, vocabulary rows, MLP columns)",
             origin, key, v);
  }
  MT_CHECK(num_key_value_heads % tp == 0 || tp % num_key_value_heads == 0,
           "{}: [model].num_key_value_heads = {} must be a multiple of tp = {} (each tp rank its share of the "
           "key/value heads) or divide it (tp / num_key_value_heads ranks share each key/value head)",
           origin, num_key_value_heads, tp);
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

// transformers' Qwen3MoeConfig defaults (5.x, the same values as 4.51+): what a config.json
// that omits a key means. They differ from moetrain's own defaults (a tiny model), so a
// config.json is read on top of these, never on top of moetrain's.
Qwen3MoeConfig hf_defaults() {
  Qwen3MoeConfig c;
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 0;  // absent: hidden_size / num_attention_heads, after the other keys
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = false;
  c.decoder_sparse_step = 1;
  c.mlp_only_layers = {};
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.initializer_range = 0.02;
  c.max_position_embeddings = 32768;
  c.router_aux_loss_coef = 0.001;
  return c;
}

}  // namespace

std::string Qwen3MoeConfig::to_hf_json() const {
  // The spelling transformers 5 writes (num_local_experts, rope_parameters, dtype); it also
  // reads the older one (num_experts, rope_theta, torch_dtype), and so does load_hf_json.
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
  j["num_local_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["norm_topk_prob"] = norm_topk_prob;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
  j["rope_parameters"] = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
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
  j["dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

void Qwen3MoeConfig::load_hf_json(const std::string& path) {
  HfConfigReader r(path);
  r.require_model_type("qwen3_moe");

  // Every key below is one that Qwen3MoeForCausalLM reads; what a file omits takes
  // transformers' default. moetrain's own keys (config_json, router_z_loss_coef,
  // router_bias_update_speed) stay.
  Qwen3MoeConfig c = hf_defaults();
  c.config_json = config_json;
  c.router_z_loss_coef = router_z_loss_coef;
  c.router_bias_update_speed = router_bias_update_speed;
  r.read({"vocab_size"}, c.vocab_size);
  r.read({"hidden_size"}, c.hidden_size);
  r.read({"intermediate_size"}, c.intermediate_size);
  r.read({"moe_intermediate_size"}, c.moe_intermediate_size);
  r.read({"num_hidden_layers"}, c.num_hidden_layers);
  r.read({"num_attention_heads"}, c.num_attention_heads);
  r.read({"num_key_value_heads"}, c.num_key_value_heads);
  const bool has_head_dim = r.read({"head_dim"}, c.head_dim);
  r.read({"num_experts", "num_local_experts"}, c.num_experts);
  r.read({"num_experts_per_tok"}, c.num_experts_per_tok);
  r.read({"norm_topk_prob"}, c.norm_topk_prob);
  r.read({"decoder_sparse_step"}, c.decoder_sparse_step);
  r.read({"mlp_only_layers"}, c.mlp_only_layers);
  r.read_plain_rope(c.rope_theta);
  r.read({"rms_norm_eps"}, c.rms_norm_eps);
  r.read({"tie_word_embeddings"}, c.tie_word_embeddings);
  r.read({"initializer_range"}, c.initializer_range);
  r.read({"max_position_embeddings"}, c.max_position_embeddings);
  r.read({"router_aux_loss_coef"}, c.router_aux_loss_coef);
  // HF: head_dim absent or null means hidden_size / num_attention_heads.
  if (!has_head_dim) c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;

  // Keys that would change the architecture in ways moetrain does not implement.
  r.require("hidden_act", "silu", "only silu (SwiGLU) is implemented");
  r.require("attention_bias", false, "Qwen3-MoE attention has no biases in moetrain");
  r.require("qkv_bias", false, "Qwen3-MoE attention has no biases in moetrain");
  r.require("use_sliding_window", false, "sliding-window attention is not implemented");
  r.require("attention_dropout", 0.0, "moetrain has no attention dropout");
  r.require("pretraining_tp", 1, "moetrain computes the plain (non-sliced) projections");
  if (const nlohmann::json* types = r.take({"layer_types"}); types != nullptr && !types->is_null()) {
    const bool all_full = types->is_array() && std::all_of(types->begin(), types->end(), [](const nlohmann::json& t) {
                            return t == "full_attention";
                          });
    if (!all_full) {
      MT_THROW("{}: unsupported architecture key \"layer_types\" = {}: every layer must be \"full_attention\" "
               "(sliding-window attention is not implemented)",
               path, types->dump());
    }
  }
  // sliding_window and max_window_layers only matter when use_sliding_window is true (refused
  // above); output_router_logits only says whether transformers' forward adds the aux loss.
  r.pass_over({"sliding_window", "max_window_layers", "output_router_logits"});
  r.pass_over_fp8_quantization();  // Qwen3's FP8 releases (and `moetrain convert --fp8`'s folders)
  r.pass_over_common();
  r.finish();
  *this = std::move(c);
}

ModelShape Qwen3MoeConfig::shape() const {
  return {vocab_size, hidden_size, num_hidden_layers, num_experts, num_experts_per_tok, max_position_embeddings};
}

// What Qwen3MoeLayerState (qwen3_moe.h) and the skeleton's LayerState hold; `a` bytes an
// activation element, f32 statistics, i32 indices.
LayerFootprint Qwen3MoeConfig::layer_footprint(int64_t id, int act) const {
  const double a = act, H = static_cast<double>(hidden_size), E = static_cast<double>(num_experts),
               K = static_cast<double>(num_experts_per_tok);
  const double qd = static_cast<double>(num_attention_heads * head_dim),
               kvd = static_cast<double>(num_key_value_heads * head_dim), nh = static_cast<double>(num_attention_heads),
               nkv = static_cast<double>(num_key_value_heads);
  LayerFootprint f;
  const bool moe = is_moe_layer(id);
  const int64_t I = moe ? moe_intermediate_size : intermediate_size;
  f.params = 2 * num_attention_heads * head_dim * hidden_size + 2 * num_key_value_heads * head_dim * hidden_size +
             2 * head_dim + 2 * hidden_size + (moe ? num_experts * hidden_size : 3 * hidden_size * I);
  // x, ln1.y, h, ln2.y; q_raw, q, the attention output; k_raw, k, v; the norms' rstd (ln1,
  // ln2, q and k per head) and the attention's log-sum-exp per head, f32.
  f.kept_per_token = a * (4 * H + 3 * qd + 3 * kvd) + 4.0 * (2 + 2 * nh + nkv);
  // Backward: d ln2, d h, d ln1; d q_raw, d k_raw, d v; d attention, dq, dk, dv; delta (f32).
  f.backward_per_token = a * (3 * H + 2 * qd + 2 * kvd) + a * (2 * qd + 2 * kvd) + 8 * nh;
  f.selective_per_token = a * (2 * H + qd + kvd);  // ln1.y, ln2.y, q, k
  f.kv_per_token = a * 2 * kvd;
  f.attention_per_token = a * (2 * qd + 2 * kvd);
  if (moe) {
    f.expert_params = 3 * hidden_size * I;
    f.experts = num_experts;
    f.top_k = num_experts_per_tok;
    // The router's logits (a) and probabilities (f32), top-k ids and weights, the dispatch's
    // two i32 permutations; z-loss's log-sum-exp.
    f.kept_per_token += a * E + 4 * E + 8 * K + 8 * K + (router_z_loss_coef > 0 ? 4 : 0);
    f.kept_per_row = a * (2 * H + 3 * static_cast<double>(I));  // rows in, rows out; gate, up, act
    f.backward_per_token += a * E;                               // d router logits
    f.backward_per_row = a * (2 * H + 2 * static_cast<double>(I));  // d rows out, d rows in; d gate, d up
    f.deferred_per_row = a * (2 * H + 3 * static_cast<double>(I));  // dy, x; d gate, d up, act
  } else {
    f.kept_per_token += a * (H + 3 * static_cast<double>(I));  // the MLP's output; gate, up, act
    f.backward_per_token += a * (H + 2 * static_cast<double>(I));
  }
  return f;
}

int64_t Qwen3MoeConfig::outer_params() const {
  return (tie_word_embeddings ? 1 : 2) * vocab_size * hidden_size + hidden_size;
}

bool Qwen3MoeConfig::is_moe_layer(int64_t i) const {
  const bool dense = std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) != mlp_only_layers.end();
  return !dense && num_experts > 0 && decoder_sparse_step > 0 && (i + 1) % decoder_sparse_step == 0;
}

}  // namespace moetrain
