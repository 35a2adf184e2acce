// Scoring a token sequence with a saved model: the logits of every position and the mean
// next-token cross-entropy, as `XxxForCausalLM(input_ids, labels=input_ids)` reports
// it. Used by `moetrain score` to check moetrain's forward against transformers' on the
// same weights (tools/check_hf_logits.py).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

struct ScoreResult {
  Tensor logits;     // f32 [S, V] on the host
  double loss = 0;   // mean over the S - 1 next-token targets
  int64_t targets = 0;
};

// Builds the model from model_dir/config.json, loads its weights (HF folder or moetrain
// checkpoint), and runs one sequence in f32 (CPU) or bf16 (CUDA).
ScoreResult score_tokens(const std::string& model_dir, const std::vector<int32_t>& ids, const std::string& device);

}  // namespace moetrain
