// What the model tests share: a tiny Qwen3-MoE config and next-token batches of random ids.
#pragma once

#include <vector>

#include "engine/data/loader.h"
#include "engine/models/deepseek_v3_config.h"
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

// A Qwen3-MoE the GPU kernels take (hidden 128, heads of 64 or 128, widths the GEMMs and
// attention tile): 3 layers, layer 0 dense, `experts` routed experts top-`top_k` of FFN 64,
// both router losses on.
inline Qwen3MoeConfig cuda_moe_config(int64_t experts, int64_t top_k, int64_t head_dim = 64) {
  Qwen3MoeConfig c;
  c.vocab_size = 300;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.moe_intermediate_size = 64;
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {0};
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = head_dim;
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.router_aux_loss_coef = 0.01;
  c.router_z_loss_coef = 0.001;
  return c;
}

// DeepSeek-V3 of every feature at its smallest: hidden 8; MLA with a query latent of 5, a
// key/value latent of 6, 2 heads of 4 + 2 (rope) query/key dims and 3 value dims; YaRN and
// interleaved rotary pairs; layer 0 dense (FFN 12), the others 8 routed experts in 4 groups
// (top-2 from the best 2 groups, FFN 6) plus one shared expert; large initial weights.
inline DeepseekV3Config tiny_dsv3_config(int64_t vocab, int64_t layers = 3) {
  DeepseekV3Config c;
  c.vocab_size = vocab;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.moe_intermediate_size = 6;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.q_lora_rank = 5;
  c.kv_lora_rank = 6;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 2;
  c.v_head_dim = 3;
  c.n_routed_experts = 8;
  c.n_group = 4;
  c.topk_group = 2;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 1;
  c.first_k_dense_replace = 1;
  c.rope_factor = 4;
  c.rope_original_max_position_embeddings = 16;
  c.initializer_range = 0.5;
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
