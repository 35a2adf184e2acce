#include "engine/models/deepseek_v3_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/models/hf_config.h"

namespace moetrain {

void DeepseekV3Config::describe(ConfigFields& f) {
  f.add("model_type", &model_type, "model family", one_of(&model_type, {"deepseek_v3"}));
  f.add("vocab_size", &vocab_size, "rows of the embedding and the LM head", positive(&vocab_size));
  f.add("hidden_size", &hidden_size, "width of the residual stream", positive(&hidden_size));
  f.add("intermediate_size", &intermediate_size, "FFN width of the dense first layers", positive(&intermediate_size));
  f.add("moe_intermediate_size", &moe_intermediate_size, "FFN width of each routed and shared expert",
        positive(&moe_intermediate_size));
  f.add("num_hidden_layers", &num_hidden_layers, "decoder layers", positive(&num_hidden_layers));
  f.add("num_attention_heads", &num_attention_heads, "attention heads", positive(&num_attention_heads));
  f.add("num_key_value_heads", &num_key_value_heads, "key/value heads (MLA: equal to the attention heads)",
        positive(&num_key_value_heads));
  f.add("n_shared_experts", &n_shared_experts, "shared experts every token takes (one SwiGLU of n times the width)",
        non_negative(&n_shared_experts));
  f.add("n_routed_experts", &n_routed_experts, "routed experts per MoE layer", positive(&n_routed_experts));
  f.add("routed_scaling_factor", &routed_scaling_factor, "scale of the routed experts' weights",
        positive(&routed_scaling_factor));
  f.add("kv_lora_rank", &kv_lora_rank, "width of the compressed key/value latent", positive(&kv_lora_rank));
  f.add("q_lora_rank", &q_lora_rank, "width of the compressed query latent (0: none, queries projected directly)",
        non_negative(&q_lora_rank));
  f.add("qk_rope_head_dim", &qk_rope_head_dim, "rotary part of a query/key head (the shared k_pe)",
        positive(&qk_rope_head_dim));
  f.add("v_head_dim", &v_head_dim, "width of a value head", positive(&v_head_dim));
  f.add("qk_nope_head_dim", &qk_nope_head_dim, "non-rotary part of a query/key head", positive(&qk_nope_head_dim));
  f.add("n_group", &n_group, "expert groups of the group-limited routing", positive(&n_group));
  f.add("topk_group", &topk_group, "groups a token's experts come from", positive(&topk_group));
  f.add("num_experts_per_tok", &num_experts_per_tok, "routed experts per token (top-k)",
        positive(&num_experts_per_tok));
  f.add("first_k_dense_replace", &first_k_dense_replace, "the first k layers have a dense MLP instead of experts",
        non_negative(&first_k_dense_replace));
  f.add("norm_topk_prob", &norm_topk_prob, "renormalise the top-k weights to sum to 1 (before the scaling)");
  f.add("max_position_embeddings", &max_position_embeddings, "longest sequence the model supports",
        positive(&max_position_embeddings));
  f.add("initializer_range", &initializer_range, "std of the normal weight initialisation",
        positive(&initializer_range));
  f.add("rms_norm_eps", &rms_norm_eps, "epsilon of every RMSNorm", positive(&rms_norm_eps));
  f.add("tie_word_embeddings", &tie_word_embeddings, "LM head shares the embedding matrix");
  f.add("rope_interleave", &rope_interleave, "rotary dims paired (0,1), (2,3), ... as DeepSeek's checkpoints");
  f.add("rope_theta", &rope_theta, "RoPE base frequency", positive(&rope_theta));
  f.add("rope_type", &rope_type, "RoPE scaling: default or yarn", one_of(&rope_type, {"default", "yarn"}));
  f.add("rope_factor", &rope_factor, "YaRN: context extension factor", positive(&rope_factor));
  f.add("rope_original_max_position_embeddings", &rope_original_max_position_embeddings,
        "YaRN: the pretraining context length", positive(&rope_original_max_position_embeddings));
  f.add("rope_beta_fast", &rope_beta_fast, "YaRN: rotations where interpolation starts", positive(&rope_beta_fast));
  f.add("rope_beta_slow", &rope_beta_slow, "YaRN: rotations where it is complete", positive(&rope_beta_slow));
  f.add("rope_mscale", &rope_mscale, "YaRN: attention temperature coefficient (0: absent)",
        non_negative(&rope_mscale));
  f.add("rope_mscale_all_dim", &rope_mscale_all_dim,
        "YaRN: the coefficient of the softmax scale's mscale^2 (0: unscaled)", non_negative(&rope_mscale_all_dim));
  f.add("num_nextn_predict_layers", &num_nextn_predict_layers, "multi-token prediction modules (0: none)",
        non_negative(&num_nextn_predict_layers));
  f.add("mtp_loss_weight", &mtp_loss_weight, "weight of the multi-token prediction loss",
        non_negative(&mtp_loss_weight));
  f.add("router_bias_update_speed", &router_bias_update_speed,
        "aux-loss-free balancing: each step a routing bias moves this far against its expert's load error (0 = off)",
        non_negative(&router_bias_update_speed));
  f.add("seq_aux_loss_coef", &seq_aux_loss_coef, "weight of the sequence-wise auxiliary loss (0 = off)",
        non_negative(&seq_aux_loss_coef));
  f.add("config_json", &config_json,
        "HF config.json read before the other [model] keys (relative to the TOML file's folder)");
}

void DeepseekV3Config::validate_tensor_parallel(int64_t tp, const std::string& origin) const {
  for (auto [key, v] : {std::pair{"num_attention_heads", num_attention_heads}, {"vocab_size", vocab_size},
                        {"intermediate_size", intermediate_size}}) {
    MT_CHECK(v % tp == 0,
             "{}: [model].{} = {} must be a multiple of tp: tensor parallelism gives each tp rank an equal share "
             "(whole heads, vocabulary rows, MLP columns)",
             origin, key, v);
  }
  MT_CHECK(seq_aux_loss_coef == 0,
           "{}: [model].seq_aux_loss_coef = {} under tensor parallelism is not built yet (a rank's token slice cuts "
           "sequences); set it to 0 or use tp = 1",
           origin, seq_aux_loss_coef);
  MT_CHECK(num_nextn_predict_layers == 0,
           "{}: [model].num_nextn_predict_layers = {} under tensor parallelism is not built yet; set it to 0 or use "
           "tp = 1",
           origin, num_nextn_predict_layers);
}

void DeepseekV3Config::validate(const std::string& origin) const {
  DeepseekV3Config copy = *this;  // describe() needs mutable targets; the checks only read
  ConfigFields f("model");
  copy.describe(f);
  f.validate(origin);
  MT_CHECK(num_key_value_heads == num_attention_heads,
           "{}: [model].num_key_value_heads ({}) must equal [model].num_attention_heads ({}): multi-head latent "
           "attention gives every head its own key and value",
           origin, num_key_value_heads, num_attention_heads);
  MT_CHECK(n_routed_experts % n_group == 0 && (n_group == 1 || n_routed_experts / n_group >= 2),
           "{}: [model].n_group ({}) must divide [model].n_routed_experts ({}) into groups of 2 or more", origin,
           n_group, n_routed_experts);
  MT_CHECK(topk_group <= n_group, "{}: [model].topk_group ({}) must be <= [model].n_group ({})", origin, topk_group,
           n_group);
  MT_CHECK(num_experts_per_tok <= topk_group * (n_routed_experts / n_group),
           "{}: [model].num_experts_per_tok ({}) must be <= the experts of topk_group ({}) groups ({})", origin,
           num_experts_per_tok, topk_group, topk_group * (n_routed_experts / n_group));
  MT_CHECK(qk_rope_head_dim % 2 == 0, "{}: [model].qk_rope_head_dim must be even (RoPE rotates pairs), got {}",
           origin, qk_rope_head_dim);
  MT_CHECK(first_k_dense_replace <= num_hidden_layers,
           "{}: [model].first_k_dense_replace ({}) must be <= [model].num_hidden_layers ({})", origin,
           first_k_dense_replace, num_hidden_layers);
  MT_CHECK(num_nextn_predict_layers == 0 || mtp_loss_weight > 0,
           "{}: [model].mtp_loss_weight must be > 0 with num_nextn_predict_layers = {} (set num_nextn_predict_layers "
           "= 0 to train without multi-token prediction)",
           origin, num_nextn_predict_layers);
  if (rope_type == "yarn") {
    MT_CHECK(rope_factor >= 1, "{}: [model].rope_factor must be >= 1 under YaRN, got {}", origin, rope_factor);
    MT_CHECK(rope_beta_fast > rope_beta_slow, "{}: [model].rope_beta_fast ({}) must exceed [model].rope_beta_slow ({})",
             origin, rope_beta_fast, rope_beta_slow);
  }
}

namespace {
// YaRN's temperature: 0.1 * m * ln(factor) + 1 for factor > 1.
double yarn_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }
}  // namespace

double DeepseekV3Config::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (rope_type == "yarn" && rope_mscale_all_dim > 0) {
    const double mscale = yarn_mscale(rope_factor, rope_mscale_all_dim);
    scale *= mscale * mscale;
  }
  return scale;
}

std::vector<double> DeepseekV3Config::rope_inv_freq() const {
  const int64_t d = qk_rope_head_dim, pairs = d / 2;
  std::vector<double> out(static_cast<size_t>(pairs));
  for (int64_t i = 0; i < pairs; ++i) out[i] = std::pow(rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  if (rope_type != "yarn") return out;
  // The pair (fractional) that makes `rotations` turns over the original context.
  const double kPi = 3.14159265358979323846;
  auto pair_of = [&](double rotations) {
    return static_cast<double>(d) *
           std::log(static_cast<double>(rope_original_max_position_embeddings) / (rotations * 2 * kPi)) /
           (2 * std::log(rope_theta));
  };
  const double low = std::max(0.0, std::floor(pair_of(rope_beta_fast)));
  double high = std::min(static_cast<double>(d - 1), std::ceil(pair_of(rope_beta_slow)));
  if (high == low) high += 0.001;  // no zero-width ramp
  for (int64_t i = 0; i < pairs; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolate = 1.0 - ramp;  // 1: the pair keeps its frequency
    out[i] = out[i] / rope_factor * (1.0 - extrapolate) + out[i] * extrapolate;
  }
  return out;
}

double DeepseekV3Config::rope_attention_factor() const {
  if (rope_type != "yarn") return 1.0;
  if (rope_mscale > 0 && rope_mscale_all_dim > 0) {
    return yarn_mscale(rope_factor, rope_mscale) / yarn_mscale(rope_factor, rope_mscale_all_dim);
  }
  return yarn_mscale(rope_factor, 1.0);
}

// What DeepseekV3LayerState (deepseek_v3.h), the skeleton's LayerState and a multi-token
// prediction module's MtpState hold; `a` bytes an activation element, f32 statistics and
// router scores, i32 indices.
LayerFootprint DeepseekV3Config::layer_footprint(int64_t id, int act) const {
  const double a = act, H = static_cast<double>(hidden_size), E = static_cast<double>(n_routed_experts),
               K = static_cast<double>(num_experts_per_tok), nh = static_cast<double>(num_attention_heads);
  const double qk = static_cast<double>(qk_head_dim()), dv = static_cast<double>(v_head_dim),
               nope = static_cast<double>(qk_nope_head_dim), r = static_cast<double>(kv_lora_rank),
               rope = static_cast<double>(qk_rope_head_dim), qr = static_cast<double>(q_lora_rank);
  LayerFootprint f;
  const bool moe = is_moe_layer(id);
  const int64_t h = hidden_size, heads = num_attention_heads;
  f.params = (q_lora_rank > 0 ? q_lora_rank * h + q_lora_rank + heads * qk_head_dim() * q_lora_rank
                              : heads * qk_head_dim() * h) +
             (kv_lora_rank + qk_rope_head_dim) * h + kv_lora_rank + heads * (qk_nope_head_dim + v_head_dim) * kv_lora_rank +
             h * heads * v_head_dim + 2 * h;
  // x, ln1.y, h, ln2.y; q, k, v and the attention output; the key/value latent, its norm's
  // output and the rotary key; the query latent and its norm's output; rstd of the 3-4 norms
  // and the attention's log-sum-exp per head, f32.
  f.kept_per_token = a * (4 * H + 2 * nh * qk + 2 * nh * dv + 2 * r + rope + 2 * qr) +
                     4.0 * (3 + (q_lora_rank > 0 ? 1 : 0) + nh);
  // Backward: d ln2, d h, d ln1; d q, d kv, the latents' and the rotary key's gradients; d
  // attention, dq, dk, dv; delta (f32).
  f.backward_per_token = a * (3 * H + nh * qk + nh * (nope + dv) + r + rope + qr) + a * (2 * nh * dv + 2 * nh * qk) +
                         8 * nh;
  f.selective_per_token = a * (2 * H + qr + r);  // ln1.y, ln2.y, the two latents' norm outputs
  f.kv_per_token = a * nh * (qk + dv);            // every head's key and value (MLA expands them)
  f.attention_per_token = a * nh * (2 * qk + 2 * dv);
  if (moe) {
    const double I = static_cast<double>(moe_intermediate_size), shared = static_cast<double>(n_shared_experts) * I;
    f.params += n_routed_experts * h + 3 * h * n_shared_experts * moe_intermediate_size;
    f.expert_params = 3 * h * moe_intermediate_size;
    f.experts = n_routed_experts;
    f.top_k = num_experts_per_tok;
    // Shared experts: output, gate, up, act, the residual with it; the router's logits and
    // scores (f32), top-k ids and weights, the dispatch's two i32 permutations.
    f.kept_per_token += (n_shared_experts > 0 ? a * (2 * H + 3 * shared) : 0) + 8 * E + 16 * K;
    f.kept_per_row = a * (2 * H + 3 * I);
    f.backward_per_token += 4 * E + (n_shared_experts > 0 ? a * (H + 2 * shared) : 0);
    f.backward_per_row = a * (2 * H + 2 * I);
    f.deferred_per_row = a * (2 * H + 3 * I);
  } else {
    const double I = static_cast<double>(intermediate_size);
    f.params += 3 * h * intermediate_size;
    f.kept_per_token += a * (H + 3 * I);
    f.backward_per_token += a * (H + 2 * I);
  }
  if (id >= num_hidden_layers) {  // a module's own: embedding, head, two norms, eh_proj, the head's norm
    f.params += 2 * vocab_size * h + 3 * h + 2 * h * h;
    f.kept_per_token += a * 6 * H + 8;  // e, the two norms' outputs, [e; h], d out; rstd
  }
  return f;
}

int64_t DeepseekV3Config::outer_params() const {
  return (tie_word_embeddings ? 1 : 2) * vocab_size * hidden_size + hidden_size;
}

ModelShape DeepseekV3Config::shape() const {
  return {vocab_size,          hidden_size,          num_hidden_layers,       n_routed_experts,
          num_experts_per_tok, max_position_embeddings, num_nextn_predict_layers};
}

namespace {

// transformers' DeepseekV3Config defaults (5.x): what a config.json that omits a key means.
DeepseekV3Config hf_defaults() {
  DeepseekV3Config c;
  c.vocab_size = 129280;
  c.hidden_size = 7168;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.num_hidden_layers = 61;
  c.num_attention_heads = 128;
  c.num_key_value_heads = 128;
  c.n_shared_experts = 1;
  c.n_routed_experts = 256;
  c.routed_scaling_factor = 2.5;
  c.kv_lora_rank = 512;
  c.q_lora_rank = 1536;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.qk_nope_head_dim = 128;
  c.n_group = 8;
  c.topk_group = 4;
  c.num_experts_per_tok = 8;
  c.first_k_dense_replace = 3;
  c.norm_topk_prob = true;
  c.max_position_embeddings = 4096;
  c.initializer_range = 0.02;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = false;
  c.rope_interleave = true;
  c.rope_theta = 10000.0;
  c.rope_type = "default";
  // YaRN's entries when rope_parameters leaves them out: transformers' defaults, mscale and
  // mscale_all_dim 0 for absent (HF tests them for truth, so 0 and absent agree).
  c.rope_factor = 1.0;
  c.rope_beta_fast = 32.0;
  c.rope_beta_slow = 1.0;
  c.rope_mscale = 0.0;
  c.rope_mscale_all_dim = 0.0;
  c.num_nextn_predict_layers = 0;
  return c;
}

// The RoPE entries of rope_parameters (or rope_scaling) into c; `key` names the object.
void read_rope_object(const HfConfigReader& r, const nlohmann::json& p, const char* key, DeepseekV3Config& c) {
  if (!p.is_object()) r.fail(key, fmt::format("expects an object, got {}", p.dump()));
  auto number = [&](const std::string& k) {
    if (!p[k].is_number()) r.fail(key, fmt::format("has {} = {}, expected a number", k, p[k].dump()));
    return p[k].get<double>();
  };
  for (auto it = p.begin(); it != p.end(); ++it) {
    const std::string& k = it.key();
    if (k == "rope_type" || k == "type") {
      if (*it != "default" && *it != "yarn") {
        MT_THROW("{}: unsupported architecture key \"{}\" = {}: RoPE type {} is not implemented (\"default\" or "
                 "\"yarn\")",
                 r.path(), key, p.dump(), it->dump());
      }
      c.rope_type = it->get<std::string>();
    } else if (k == "rope_theta") {
      c.rope_theta = number(k);
    } else if (k == "factor") {
      c.rope_factor = number(k);
    } else if (k == "original_max_position_embeddings") {
      c.rope_original_max_position_embeddings = static_cast<int64_t>(number(k));
    } else if (k == "beta_fast") {
      c.rope_beta_fast = number(k);
    } else if (k == "beta_slow") {
      c.rope_beta_slow = number(k);
    } else if (k == "mscale") {
      c.rope_mscale = number(k);
    } else if (k == "mscale_all_dim") {
      c.rope_mscale_all_dim = number(k);
    } else {
      MT_THROW("{}: unsupported architecture key \"{}\" = {}: its entry \"{}\" is not implemented", r.path(), key,
               p.dump(), k);
    }
  }
}

}  // namespace

void DeepseekV3Config::load_hf_json(const std::string& path) {
  HfConfigReader r(path);
  r.require_model_type("deepseek_v3");
  DeepseekV3Config c = hf_defaults();
  // moetrain's own keys stay.
  c.config_json = config_json;
  c.mtp_loss_weight = mtp_loss_weight;
  c.router_bias_update_speed = router_bias_update_speed;
  c.seq_aux_loss_coef = seq_aux_loss_coef;
  r.read({"vocab_size"}, c.vocab_size);
  r.read({"hidden_size"}, c.hidden_size);
  r.read({"intermediate_size"}, c.intermediate_size);
  r.read({"moe_intermediate_size"}, c.moe_intermediate_size);
  r.read({"num_hidden_layers"}, c.num_hidden_layers);
  r.read({"num_attention_heads"}, c.num_attention_heads);
  // HF: num_key_value_heads absent or null means num_attention_heads.
  if (!r.read({"num_key_value_heads"}, c.num_key_value_heads)) c.num_key_value_heads = c.num_attention_heads;
  r.read({"n_shared_experts"}, c.n_shared_experts);
  r.read({"n_routed_experts", "num_local_experts"}, c.n_routed_experts);
  r.read({"routed_scaling_factor"}, c.routed_scaling_factor);
  r.read({"kv_lora_rank"}, c.kv_lora_rank);
  // q_lora_rank: null is the form without a query down-projection (DeepSeek-V2-Lite, Moonlight).
  if (const nlohmann::json* q = r.take({"q_lora_rank"}); q != nullptr) {
    if (q->is_null()) c.q_lora_rank = 0;
    else if (q->is_number_integer() && q->get<int64_t>() > 0) c.q_lora_rank = q->get<int64_t>();
    else r.fail("q_lora_rank", fmt::format("expects a positive integer or null, got {}", q->dump()));
  }
  r.read({"qk_rope_head_dim"}, c.qk_rope_head_dim);
  r.read({"v_head_dim"}, c.v_head_dim);
  r.read({"qk_nope_head_dim"}, c.qk_nope_head_dim);
  // transformers 5 also writes two sizes it derives: head_dim (= qk_rope_head_dim, what its
  // rotary embedding turns) and qk_head_dim (= nope + rope). Read to check they agree.
  int64_t derived = 0;
  if (r.read({"head_dim"}, derived) && derived != c.qk_rope_head_dim) {
    r.fail("head_dim", fmt::format("= {} must equal qk_rope_head_dim ({}), as transformers derives it", derived,
                                   c.qk_rope_head_dim));
  }
  if (r.read({"qk_head_dim"}, derived) && derived != c.qk_head_dim()) {
    r.fail("qk_head_dim", fmt::format("= {} must equal qk_nope_head_dim + qk_rope_head_dim ({})", derived,
                                      c.qk_head_dim()));
  }
  r.read({"n_group"}, c.n_group);
  r.read({"topk_group"}, c.topk_group);
  r.read({"num_experts_per_tok"}, c.num_experts_per_tok);
  r.read({"first_k_dense_replace"}, c.first_k_dense_replace);
  r.read({"norm_topk_prob"}, c.norm_topk_prob);
  r.read({"max_position_embeddings"}, c.max_position_embeddings);
  r.read({"initializer_range"}, c.initializer_range);
  r.read({"rms_norm_eps"}, c.rms_norm_eps);
  r.read({"tie_word_embeddings"}, c.tie_word_embeddings);
  r.read({"rope_interleave"}, c.rope_interleave);
  r.read({"num_nextn_predict_layers"}, c.num_nextn_predict_layers);
  // transformers writes num_nextn_predict_layers = 1 and saves no module: weights beside the
  // config without the first module's are a model without multi-token prediction. (Looked up
  // by name: an FP8 folder's weights are not readable as they are.)
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (c.num_nextn_predict_layers > 0 && is_hf_model_dir(dir) &&
      !hf_folder_has_tensor(dir, fmt::format("model.layers.{}.eh_proj.weight", c.num_hidden_layers))) {
    spdlog::warn("{}: num_nextn_predict_layers = {}, but the folder's weights have no multi-token prediction module "
                 "(model.layers.{}.*; transformers saves none): the model is built without one",
                 path, c.num_nextn_predict_layers, c.num_hidden_layers);
    c.num_nextn_predict_layers = 0;
  }
  // RoPE: transformers 5's rope_parameters, or the older rope_scaling with rope_theta at the
  // top level; YaRN's original length defaults to max_position_embeddings (transformers).
  c.rope_original_max_position_embeddings = 0;
  double top_theta = 0.0;
  const bool has_top_theta = r.read({"rope_theta"}, top_theta);
  if (has_top_theta) c.rope_theta = top_theta;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (const nlohmann::json* p = r.take({key}); p != nullptr && !p->is_null()) read_rope_object(r, *p, key, c);
  }
  if (has_top_theta && c.rope_theta != top_theta) {
    MT_THROW("{}: \"rope_theta\" = {} and the RoPE parameters' rope_theta = {} disagree", path, top_theta, c.rope_theta);
  }
  if (c.rope_original_max_position_embeddings == 0) c.rope_original_max_position_embeddings = c.max_position_embeddings;

  // What would change the architecture in ways the family does not implement.
  r.require("hidden_act", "silu", "only silu (SwiGLU) is implemented");
  r.require("attention_bias", false, "DeepSeek-V3 attention has no biases in moetrain");
  r.require("attention_dropout", 0.0, "moetrain has no attention dropout");
  r.require("pretraining_tp", 1, "moetrain computes the plain (non-sliced) projections");
  r.require("scoring_func", "sigmoid", "DeepSeek-V3 routes by sigmoid scores");
  r.require("topk_method", "noaux_tc", "DeepSeek-V3 routes by group-limited top-k with the correction bias");
  r.require("moe_layer_freq", 1, "every layer past first_k_dense_replace has experts");
  // DeepSeek's config.json: ep_size is its inference layout; aux_loss_alpha and seq_aux are its
  // training recipe, which HF's model does not compute (moetrain's seq_aux_loss_coef sets it).
  r.pass_over({"ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits"});
  r.pass_over_fp8_quantization();
  r.pass_over_common();
  r.finish();
  *this = std::move(c);
}

std::string DeepseekV3Config::to_hf_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["n_shared_experts"] = n_shared_experts;
  j["n_routed_experts"] = n_routed_experts;
  j["routed_scaling_factor"] = routed_scaling_factor;
  j["kv_lora_rank"] = kv_lora_rank;
  if (q_lora_rank > 0) j["q_lora_rank"] = q_lora_rank;
  else j["q_lora_rank"] = nullptr;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["v_head_dim"] = v_head_dim;
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["n_group"] = n_group;
  j["topk_group"] = topk_group;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["first_k_dense_replace"] = first_k_dense_replace;
  j["norm_topk_prob"] = norm_topk_prob;
  j["max_position_embeddings"] = max_position_embeddings;
  j["initializer_range"] = initializer_range;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["rope_interleave"] = rope_interleave;
  nlohmann::ordered_json rope;
  rope["rope_type"] = rope_type;
  rope["rope_theta"] = rope_theta;
  if (rope_type == "yarn") {
    rope["factor"] = rope_factor;
    rope["original_max_position_embeddings"] = rope_original_max_position_embeddings;
    rope["beta_fast"] = rope_beta_fast;
    rope["beta_slow"] = rope_beta_slow;
    rope["mscale"] = rope_mscale;
    rope["mscale_all_dim"] = rope_mscale_all_dim;
  }
  j["rope_parameters"] = rope;
  if (num_nextn_predict_layers > 0) j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_cache"] = true;
  j["dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

}  // namespace moetrain
