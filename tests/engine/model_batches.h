// What the model tests share: a tiny Qwen3-MoE config and next-token batches of random ids.
#pragma once

#include <vector>

#include "engine/data/loader.h"
#include "engine/models/qwen3_moe.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain::testing {

// Hidden 8, 4 query heads (2 kv) of dim 4, 4 experts top-2 with expert FFN 6 (dense FFN
// 12), large initial weights (routing and attention far from uniform), both MoE losses on.
inline Qwen3MoeConfig tiny_moe_config(int64_t vocab, int64_t layers = 2) {
  Qwen3MoeConfig c;
  c.vocab_size = vocab;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.moe_intermediate_size = 6;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.initializer_range = 0.5;
  c.router_aux_loss_coef = 0.1;
  c.router_z_loss_coef = 0.01;
  return c;
}

// `rows` x `seq` random ids in [0, vocab) with random targets (streams `seed` and `seed` + 1),
// positions restarting at 0 in every row; target `ignored` (when >= 0) is -100.
inline Batch random_batch(int64_t rows, int64_t seq, int32_t vocab, uint64_t seed, int64_t ignored = -1) {
  Batch b;
  b.batch = rows;
  b.seq = seq;
  b.inputs = random_ints({rows * seq}, 0, vocab, seed);
  b.targets = random_ints({rows * seq}, 0, vocab, seed + 1);
  if (ignored >= 0) b.targets.data<int32_t>()[ignored] = ops::kIgnoreIndex;
  std::vector<int32_t> pos(static_cast<size_t>(rows * seq));
  for (int64_t i = 0; i < rows * seq; ++i) pos[i] = static_cast<int32_t>(i % seq);
  b.positions = Tensor::from_vector(pos, {rows * seq});
  b.count_targets();
  return b;
}

}  // namespace moetrain::testing
