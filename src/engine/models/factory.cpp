// The one place that maps a model_type to its family's config and model: adding a family
// adds a line to each function here (docs/howto/add-a-model.md).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/models/hf_config.h"
#include "engine/models/model.h"
#include "engine/models/deepseek_v3.h"
#include "engine/models/deepseek_v3_config.h"
#include "engine/models/model_config.h"
#include "engine/models/qwen3_moe.h"
#include "engine/models/qwen3_moe_config.h"

namespace moetrain {

const std::vector<std::string>& model_families() {
  static const std::vector<std::string> families{"qwen3_moe", "deepseek_v3"};
  return families;
}

const std::string& default_model_family() { return model_families().front(); }

std::unique_ptr<ModelConfig> make_model_config(const std::string& model_type, const std::string& origin) {
  if (model_type == "qwen3_moe") return std::make_unique<Qwen3MoeConfig>();
  if (model_type == "deepseek_v3") return std::make_unique<DeepseekV3Config>();
  MT_THROW("{}: [model].model_type \"{}\" is not a family moetrain builds (it builds {})", origin, model_type,
           fmt::join(model_families(), ", "));
}

std::string hf_model_type(const std::string& path) {
  const HfConfigReader r(path);  // opens and parses, errors naming the file
  const nlohmann::json& j = r.json();
  MT_CHECK(j.contains("model_type") && j["model_type"].is_string(),
           "{}: no \"model_type\" string; a Hugging Face config names its family there (one of {})", path,
           fmt::join(model_families(), ", "));
  return j["model_type"].get<std::string>();
}

std::unique_ptr<Model> build_model(const ModelConfig& cfg, DType dtype, Device device, ModelPlacement placement) {
  if (const auto* q = dynamic_cast<const Qwen3MoeConfig*>(&cfg)) {
    return std::make_unique<Qwen3MoeModel>(*q, dtype, device, std::move(placement));
  }
  if (const auto* d = dynamic_cast<const DeepseekV3Config*>(&cfg)) {
    return std::make_unique<DeepseekV3Model>(*d, dtype, device, std::move(placement));
  }
  MT_THROW("no model family builds model_type \"{}\"", cfg.model_type);
}

void ModelConfig::validate_tensor_parallel(int64_t tp, const std::string& origin) const {
  MT_THROW("{}: the {} family has no tensor-parallel layers yet (qwen3_moe has); use [parallel].tp = 1", origin,
           model_type);
}

ModelSection::ModelSection() : c_(make_model_config(default_model_family(), "the default [model]")) {}

void ModelSection::wrong_family() const {
  MT_THROW("[model] is a {} config, not the family this code asked for", c_->model_type);
}

}  // namespace moetrain
