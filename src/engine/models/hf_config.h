// HfConfigReader: reads a Hugging Face config.json the way an importer must, key by key.
//
// A model family's load_hf_json takes each key its architecture reads (under every
// spelling transformers has used for it), names the keys it knows change nothing it
// computes, and calls finish(): any key left over is an error naming it and its value.
// So a key that transformers renames, or a feature moetrain does not implement, stops
// the import instead of leaving moetrain's default in place: a silently different model
// is the worst failure an importer can have.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

class HfConfigReader {
 public:
  // Parses `path` (an object at the top expected); errors name the file.
  explicit HfConfigReader(std::string path);

  const std::string& path() const { return path_; }
  const nlohmann::json& json() const { return j_; }

  // The value under the first of `spellings` present, marked as read; null when none is.
  // Two spellings present with different values are an error naming both.
  const nlohmann::json* take(std::initializer_list<std::string_view> spellings);

  // Typed reads: leave `out` as it is (the family's Hugging Face default) when no
  // spelling is present or the value is null (optional keys); a wrong type is an error.
  bool read(std::initializer_list<std::string_view> spellings, int64_t& out);
  bool read(std::initializer_list<std::string_view> spellings, double& out);
  bool read(std::initializer_list<std::string_view> spellings, bool& out);
  bool read(std::initializer_list<std::string_view> spellings, std::string& out);
  bool read(std::initializer_list<std::string_view> spellings, std::vector<int64_t>& out);

  // The key must be absent, null or equal to `allowed`; else an error that it changes the
  // architecture in a way moetrain does not implement (`why`).
  void require(std::string_view key, const nlohmann::json& allowed, std::string_view why);

  // `model_type` must be present and equal `family` (no Hugging Face default exists).
  void require_model_type(std::string_view family);

  // RoPE base frequency from `rope_parameters` (transformers 5) or `rope_theta` (older),
  // with `rope_scaling` null or plain: any other RoPE type or parameter is an error.
  void read_plain_rope(double& theta);

  // Keys known not to change what moetrain computes (token ids, dtype, generation
  // defaults, transformers bookkeeping): marked as read.
  void pass_over(std::initializer_list<std::string_view> keys);
  // The keys every transformers config may carry that change nothing moetrain computes.
  void pass_over_common();
  // quantization_config when it is DeepSeek's fine-grained FP8 (quant_method "fp8": F8_E4M3
  // weights with block scales, as DeepSeek-V3's and Qwen3's FP8 releases): it tells how the
  // weights are stored, not the architecture (`moetrain convert` dequantizes them; reading
  // them as they are is refused). Any other quantization is an error naming it.
  void pass_over_fp8_quantization();

  // Throws naming every key that was neither read nor passed over, with its value.
  void finish() const;

  [[noreturn]] void fail(std::string_view key, std::string_view what) const;

 private:
  std::string path_;
  nlohmann::json j_;
  std::set<std::string, std::less<>> read_;
};

}  // namespace moetrain
