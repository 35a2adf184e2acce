#include "engine/eval/score.h"

#include <cmath>
#include <filesystem>

#include "core/cuda_runtime.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/checkpoint/hf_convert.h"
#include "engine/models/model.h"

namespace moetrain {

ScoreResult score_tokens(const std::string& model_dir_in, const std::vector<int32_t>& ids, const std::string& device) {
  const std::string model_dir = is_hf_model_dir(model_dir_in) ? model_dir_in : resolve_step_dir(model_dir_in);
  const auto config = std::filesystem::path(model_dir) / "config.json";
  std::unique_ptr<ModelConfig> cfg = make_model_config(hf_model_type(config.string()), config.string());
  cfg->load_hf_json(config.string());
  cfg->validate(config.string());
  const int64_t vocab = cfg->shape().vocab_size;
  const int64_t S = static_cast<int64_t>(ids.size());
  MT_CHECK(S >= 2, "score: need at least 2 tokens, got {}", S);
  for (int32_t id : ids) {
    MT_CHECK(id >= 0 && id < vocab, "score: token id {} is outside the vocabulary [0, {})", id, vocab);
  }
  const bool gpu = device == "cuda";
  MT_CHECK(gpu || device == "cpu", "score: device must be cpu or cuda, got '{}'", device);
  MT_CHECK(!gpu || cuda::available(), "score: no GPU: {}", cuda::unavailable_reason());
  const Device dev = gpu ? Device::cuda(0) : Device::cpu();
  std::unique_ptr<Model> built = build_model(*cfg, gpu ? DType::BF16 : DType::F32, dev, {});
  Model& model = *built;
  CheckpointReader reader(model_dir);
  load_model_weights(reader, model.parameters());
  load_model_buffers(reader, model.buffers());  // DeepSeek-V3's routing biases steer the choice

  std::vector<int32_t> pos(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) pos[i] = static_cast<int32_t>(i);
  LocalDispatcher d;
  ScoreResult r;
  r.logits = model.forward_logits(Tensor::from_vector(ids, {S}).to(dev), Tensor::from_vector(pos, {S}).to(dev), {1, S}, d)
                 .to(Device::cpu())
                 .to(DType::F32);
  const float* l = r.logits.data<float>();
  const int64_t V = vocab;
  double sum = 0;
  for (int64_t t = 0; t + 1 < S; ++t) {
    const float* row = l + t * V;
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(row[v] - mx);
    sum += std::log(z) + mx - row[ids[t + 1]];
  }
  r.targets = S - 1;
  r.loss = sum / static_cast<double>(r.targets);
  return r;
}

}  // namespace moetrain
