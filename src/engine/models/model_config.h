// ModelConfig: the [model] section of a run, one family's declarative config behind one
// interface. The family is chosen by `model_type` (the Hugging Face key); each family's
// *Config derives from ModelConfig and keeps its HF key names as members
// (models/<family>_config.h). ModelSection is the value RunConfig holds: it owns one family's
// config and copies it deeply.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"

namespace moetrain {

// What the engine reads of any family's shape (the rest is the family's business).
struct ModelShape {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_experts = 0;        // routed experts per MoE layer (0: no MoE layer)
  int64_t experts_per_token = 0;
  int64_t max_positions = 0;
  int64_t mtp_layers = 0;         // multi-token prediction modules after the last layer (with the head)
};

// What the memory planner (engine/plan/memory_plan.h) needs of one decoder layer: its
// parameters and the bytes a training pass keeps for its backward, per token and per expert
// row (a token's copy at one routed expert). `act` is the activations' element size (2: bf16
// on the GPU, 4: f32 on the CPU); index and statistics tensors keep their own sizes.
struct LayerFootprint {
  int64_t params = 0;         // every parameter but the routed experts'
  int64_t expert_params = 0;  // one routed expert's (0: no routed experts)
  int64_t experts = 0;        // routed experts (0: a dense layer)
  int64_t top_k = 0;          // rows per token sent to the routed experts
  // From the end of its forward to its backward.
  double kept_per_token = 0, kept_per_row = 0;
  // On top of that while its backward runs: the input gradients its weight gradients read and
  // the largest temporaries alive at once.
  double backward_per_token = 0, backward_per_row = 0;
  // What a micro-batch whose expert weight gradients are deferred keeps until they are made
  // ([training].expert_wgrad_group), per row.
  double deferred_per_row = 0;
  // What selective recomputation drops per token (DecoderLayer::drop_recomputable; the expert
  // input rows, `act` x hidden bytes a row, besides when the experts are all local).
  double selective_per_token = 0;
  // One token's keys and values as the attention reads them (context parallelism's ring
  // carries blocks of them, and their gradients).
  double kv_per_token = 0;
  // One token's queries, keys, values and attention output together (the planner takes a
  // query's size from it for the ring's query-sized sums).
  double attention_per_token = 0;
};

class ModelConfig {
 public:
  virtual ~ModelConfig() = default;
  virtual std::unique_ptr<ModelConfig> clone() const = 0;

  // The [model] keys of the family, every one with its help line (declarative: config.h).
  virtual void describe(ConfigFields& f) = 0;
  // Cross-field checks (heads divide, experts_per_tok <= experts, ...); errors name the key.
  virtual void validate(const std::string& origin) const = 0;
  // [parallel].tp = tp > 1: an Error starting with `origin` when the shape does not split
  // over tp ranks (heads, key/value heads, vocabulary, MLP widths) or the family has no
  // tensor-parallel layers (the default).
  virtual void validate_tensor_parallel(int64_t tp, const std::string& origin) const;
  // Reads an HF config.json as transformers does (hf_config.h); errors name the file and key.
  virtual void load_hf_json(const std::string& path) = 0;
  // The HF config.json text of this shape, in the spelling transformers 5 writes.
  virtual std::string to_hf_json() const = 0;
  virtual ModelShape shape() const = 0;
  // Decoder layer `id` (ids num_layers .. + mtp_layers - 1: a multi-token prediction module's
  // layer, its module's own parameters counted with it) for the memory planner.
  virtual LayerFootprint layer_footprint(int64_t id, int act) const = 0;
  // The embedding, the final norm and the head (one matrix when tied).
  virtual int64_t outer_params() const = 0;

  std::string model_type;   // the family, as HF names it ("qwen3_moe")
  std::string config_json;  // optional HF config.json whose keys are read first

 protected:
  explicit ModelConfig(std::string type) : model_type(std::move(type)) {}
  ModelConfig(const ModelConfig&) = default;
  ModelConfig& operator=(const ModelConfig&) = default;
};

// The families moetrain builds, by model_type (models/factory.cpp), and the one a [model]
// section without model_type (and without an HF config naming one) gets.
const std::vector<std::string>& model_families();
const std::string& default_model_family();
// A config of `model_type`'s family with moetrain's defaults; an Error listing the families
// for an unknown one (`origin` names where the name came from).
std::unique_ptr<ModelConfig> make_model_config(const std::string& model_type, const std::string& origin);
// The model_type of an HF config.json (errors name the file when it has none).
std::string hf_model_type(const std::string& config_json_path);

// The [model] section as RunConfig holds it: one family's config, copied deeply.
class ModelSection {
 public:
  ModelSection();  // default_model_family() with moetrain's defaults
  explicit ModelSection(std::unique_ptr<ModelConfig> c) : c_(std::move(c)) {}
  ModelSection(const ModelSection& o) : c_(o.c_->clone()) {}
  ModelSection& operator=(const ModelSection& o) {
    if (this != &o) c_ = o.c_->clone();
    return *this;
  }
  ModelSection(ModelSection&&) = default;
  ModelSection& operator=(ModelSection&&) = default;

  ModelConfig& operator*() { return *c_; }
  const ModelConfig& operator*() const { return *c_; }
  ModelConfig* operator->() { return c_.get(); }
  const ModelConfig* operator->() const { return c_.get(); }
  // The family's own config (tests, the family's code); an Error when it is another family.
  template <typename T>
  T& as() {
    auto* p = dynamic_cast<T*>(c_.get());
    if (p == nullptr) wrong_family();
    return *p;
  }
  template <typename T>
  const T& as() const {
    auto* p = dynamic_cast<const T*>(c_.get());
    if (p == nullptr) wrong_family();
    return *p;
  }

 private:
  [[noreturn]] void wrong_family() const;
  std::unique_ptr<ModelConfig> c_;
};

}  // namespace moetrain
