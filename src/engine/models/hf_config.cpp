#include "engine/models/hf_config.h"

#include <fmt/format.h>

#include "core/error.h"
#include "engine/json_file.h"

namespace moetrain {

namespace {

const char* json_type_name(const nlohmann::json& j) {
  if (j.is_number_integer()) return "integer";
  if (j.is_number_float()) return "float";
  return j.type_name();
}

// Numbers compare by value (5e5 and 500000 are one theta); everything else by JSON equality.
bool same_value(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return a == b;
}

}  // namespace

HfConfigReader::HfConfigReader(std::string path) : path_(std::move(path)) {
  j_ = read_json_file(path_);
  MT_CHECK(j_.is_object(), "{}: expected a JSON object at the top, got {}", path_, j_.type_name());
}

void HfConfigReader::fail(std::string_view key, std::string_view what) const {
  MT_THROW("{}: key \"{}\" {}", path_, key, what);
}

const nlohmann::json* HfConfigReader::take(std::initializer_list<std::string_view> spellings) {
  const nlohmann::json* found = nullptr;
  std::string_view found_key;
  for (std::string_view key : spellings) {
    auto it = j_.find(std::string(key));
    if (it == j_.end()) continue;
    read_.emplace(key);
    if (found == nullptr) {
      found = &*it;
      found_key = key;
    } else if (!same_value(*found, *it)) {
      MT_THROW("{}: keys \"{}\" = {} and \"{}\" = {} are two spellings of one setting and disagree", path_,
               found_key, found->dump(), key, it->dump());
    }
  }
  return found;
}

namespace {

// One scalar key: absent or null leaves `out` (the HF default); a value of another JSON type
// is an error saying what was expected.
template <typename T, typename IsType>
bool read_scalar(HfConfigReader& r, std::initializer_list<std::string_view> spellings, T& out, IsType is_type,
                 const char* expected) {
  const nlohmann::json* v = r.take(spellings);
  if (v == nullptr || v->is_null()) return false;
  if (!is_type(*v)) r.fail(*spellings.begin(), fmt::format("expects {}, got {} {}", expected, json_type_name(*v), v->dump()));
  out = v->get<T>();
  return true;
}

}  // namespace

bool HfConfigReader::read(std::initializer_list<std::string_view> spellings, int64_t& out) {
  return read_scalar(*this, spellings, out, [](const nlohmann::json& v) { return v.is_number_integer(); },
                     "an integer");
}

bool HfConfigReader::read(std::initializer_list<std::string_view> spellings, double& out) {
  return read_scalar(*this, spellings, out, [](const nlohmann::json& v) { return v.is_number(); }, "a number");
}

bool HfConfigReader::read(std::initializer_list<std::string_view> spellings, bool& out) {
  return read_scalar(*this, spellings, out, [](const nlohmann::json& v) { return v.is_boolean(); }, "a boolean");
}

bool HfConfigReader::read(std::initializer_list<std::string_view> spellings, std::string& out) {
  return read_scalar(*this, spellings, out, [](const nlohmann::json& v) { return v.is_string(); }, "a string");
}

bool HfConfigReader::read(std::initializer_list<std::string_view> spellings, std::vector<int64_t>& out) {
  const nlohmann::json* v = take(spellings);
  if (v == nullptr || v->is_null()) return false;
  auto bad = [&] {
    fail(*spellings.begin(), fmt::format("expects a list of integers, got {} {}", json_type_name(*v), v->dump()));
  };
  if (!v->is_array()) bad();
  std::vector<int64_t> list;
  for (const auto& item : *v) {
    if (!item.is_number_integer()) bad();
    list.push_back(item.get<int64_t>());
  }
  out = std::move(list);
  return true;
}

void HfConfigReader::require(std::string_view key, const nlohmann::json& allowed, std::string_view why) {
  const nlohmann::json* v = take({key});
  if (v == nullptr || v->is_null() || same_value(*v, allowed)) return;
  MT_THROW("{}: unsupported architecture key \"{}\" = {} (moetrain needs {}): {}", path_, key, v->dump(),
           allowed.dump(), why);
}

void HfConfigReader::require_model_type(std::string_view family) {
  const nlohmann::json* v = take({"model_type"});
  MT_CHECK(v != nullptr, "{}: no \"model_type\" key; a Hugging Face config names its family there (\"{}\" here)",
           path_, family);
  MT_CHECK(v->is_string() && v->get<std::string>() == family,
           "{}: unsupported architecture key \"model_type\" = {}: this reader takes \"{}\" configs", path_, v->dump(),
           family);
}

void HfConfigReader::read_plain_rope(double& theta) {
  // transformers 5: rope_parameters {"rope_type": "default", "rope_theta": ...}; before it,
  // rope_theta at the top and rope_scaling for anything but plain RoPE.
  bool have_theta = false;
  double from_params = 0.0;
  if (const nlohmann::json* p = take({"rope_parameters"}); p != nullptr && !p->is_null()) {
    if (!p->is_object()) fail("rope_parameters", fmt::format("expects an object, got {}", p->dump()));
    for (auto it = p->begin(); it != p->end(); ++it) {
      const std::string& k = it.key();
      if (k == "rope_theta") {
        if (!it->is_number()) fail("rope_parameters", fmt::format("has rope_theta {}, expected a number", it->dump()));
        from_params = it->get<double>();
        have_theta = true;
      } else if (k == "rope_type" || k == "type") {
        if (*it != "default") {
          MT_THROW("{}: unsupported architecture key \"rope_parameters\" = {}: RoPE type {} is not implemented for "
                   "this family (only \"default\")",
                   path_, p->dump(), it->dump());
        }
      } else {
        MT_THROW("{}: unsupported architecture key \"rope_parameters\" = {}: its entry \"{}\" is not implemented for "
                 "this family (only rope_type \"default\" and rope_theta)",
                 path_, p->dump(), k);
      }
    }
  }
  if (const nlohmann::json* s = take({"rope_scaling"}); s != nullptr && !s->is_null()) {
    const bool plain = s->is_object() && s->size() == 1 &&
                       ((s->contains("rope_type") && (*s)["rope_type"] == "default") ||
                        (s->contains("type") && (*s)["type"] == "default"));
    if (!plain) {
      MT_THROW("{}: unsupported architecture key \"rope_scaling\" = {}: RoPE scaling (YaRN, linear, dynamic, ...) is "
               "not implemented for this family",
               path_, s->dump());
    }
  }
  double top = 0.0;
  if (read({"rope_theta"}, top)) {
    if (have_theta && top != from_params) {
      MT_THROW("{}: \"rope_theta\" = {} and \"rope_parameters\".rope_theta = {} disagree", path_, top, from_params);
    }
    from_params = top;
    have_theta = true;
  }
  if (have_theta) theta = from_params;
}

void HfConfigReader::pass_over(std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) {
    if (j_.contains(std::string(k))) read_.emplace(k);
  }
}

void HfConfigReader::pass_over_common() {
  // Bookkeeping, storage dtype and special-token ids: what a model computes does not depend on them.
  // The storage dtype (transformers 5 spells it dtype, older versions torch_dtype): one value if both.
  if (const nlohmann::json* d = take({"dtype", "torch_dtype"}); d != nullptr && !d->is_null() && !d->is_string()) {
    fail("dtype", fmt::format("expects a dtype name such as \"bfloat16\", got {}", d->dump()));
  }
  pass_over({"transformers_version", "_name_or_path", "architectures", "use_bfloat16",
             "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
             "tokenizer_class", "prefix", "use_cache", "output_hidden_states", "output_attentions", "return_dict",
             "torchscript", "tf_legacy_loss", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
             "finetuning_task", "task_specific_params", "is_decoder", "_attn_implementation_autoset",
             // transformers ignores it unless trust_remote_code is given; the family is model_type's
             "auto_map"});
  // Generation defaults that transformers 4 wrote into config.json.
  pass_over({"max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
             "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
             "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
             "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
             "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
             "begin_suppress_tokens"});
  // Present in every transformers config; moetrain's models are decoder-only without pruning.
  require("is_encoder_decoder", false, "moetrain trains decoder-only models");
  require("add_cross_attention", false, "moetrain trains decoder-only models");
  require("tie_encoder_decoder", false, "moetrain trains decoder-only models");
  require("cross_attention_hidden_size", nullptr, "moetrain trains decoder-only models");
  require("pruned_heads", nlohmann::json::object(), "pruned attention heads are not implemented");
}

void HfConfigReader::pass_over_fp8_quantization() {
  const nlohmann::json* q = take({"quantization_config"});
  if (q == nullptr || q->is_null()) return;
  if (q->is_object() && q->contains("quant_method") && (*q)["quant_method"] == "fp8") return;
  MT_THROW("{}: unsupported key \"quantization_config\" = {}: moetrain reads only FP8 weights with block scales "
           "(quant_method \"fp8\", which `moetrain convert` dequantizes)",
           path_, q->dump());
}

void HfConfigReader::finish() const {
  std::vector<std::string> left;
  for (auto it = j_.begin(); it != j_.end(); ++it) {
    if (!read_.contains(it.key())) left.push_back(fmt::format("\"{}\" = {}", it.key(), it.value().dump()));
  }
  if (left.empty()) return;
  std::string list;
  for (size_t i = 0; i < left.size(); ++i) list += (i ? ", " : "") + left[i];
  MT_THROW("{}: unknown key{} {}: moetrain does not know what {} to the model, so it stops rather than guess (a key "
           "that changes nothing can be added to the list of harmless keys in the family's load_hf_json)",
           path_, left.size() > 1 ? "s" : "", list, left.size() > 1 ? "they do" : "it does");
}

}  // namespace moetrain
