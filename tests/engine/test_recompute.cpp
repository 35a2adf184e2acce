// Activation recomputation ([training].recompute, docs/memory.md): a layer that keeps only its
// input through the forward and redoes its forward just before its backward ("full"), or that
// drops its norm and rotary outputs and its local expert input rows and makes them again then
// ("selective"), gives the same loss and the same gradient bits as one that keeps everything
// (same kernels, same order), for both families: DeepSeek-V3 with its dense first layer, shared expert,
// sequence-wise balance loss, routing bias and a multi-token prediction module (whose layer
// is never recomputed); Qwen3-MoE with the load-balancing and z losses. Over micro-batches that
// accumulate and defer the experts' weight gradients, over packed documents, every layer or
// some. And what a recomputed layer keeps between its passes is what the mode says.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "engine/models/deepseek_v3.h"
#include "engine/models/qwen3_moe.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

// Two rows of 9 tokens, the first packing documents of 5 and 4 tokens.
Batch packed_batch(int32_t vocab, uint64_t seed) {
  Batch b = testing::random_batch(2, 9, vocab, seed);
  b.segment_ids = Tensor::from_vector(std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0}, {18});
  b.positions = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8}, {18});
  b.count_targets();
  return b;
}

template <typename M, typename C>
void expect_same_bits(const C& c, const std::vector<int64_t>& recomputed, RecomputeMode mode, const char* label,
                      bool fp8 = false) {
  SCOPED_TRACE(label);
  const bool full = mode == RecomputeMode::kFull;
  const auto vocab = static_cast<int32_t>(c.vocab_size);
  M plain(c, DType::F32), re(c, DType::F32);
  plain.init_weights(7);
  re.init_weights(7);
  plain.set_fp8(fp8);
  re.set_fp8(fp8);
  re.set_recompute(recomputed, mode);
  for (M* m : {&plain, &re}) m->set_expert_wgrad_group(2);
  LocalDispatcher d;
  // What a training forward keeps: a fully recomputed layer's input and nothing else; a
  // selectively recomputed one all but its norm outputs (mlp_in) and its expert input rows.
  {
    const Batch b = packed_batch(vocab, 3);
    ChunkActivations a;
    RouterTotals totals = re.new_totals();
    MicroBatchLoss loss;
    re.forward_chunk(re.whole(), b, Tensor(), d, a, totals, ChunkPass{true, 1.0, 1.0, false}, &loss);
    ASSERT_GE(a.layers.size(), static_cast<size_t>(c.num_hidden_layers));
    for (size_t j = 0; j < a.layers.size(); ++j) {
      const bool dropped = std::find(recomputed.begin(), recomputed.end(), static_cast<int64_t>(j)) != recomputed.end();
      const LayerState& s = *a.layers[j];
      EXPECT_EQ(s.recompute_input.defined(), dropped && full) << "layer " << j;
      EXPECT_EQ(s.mlp_in.defined(), !dropped) << "layer " << j;
      EXPECT_EQ(s.expert_in.rows.defined(), !dropped) << "layer " << j;
      EXPECT_EQ(s.residual.defined(), !(dropped && full)) << "layer " << j;
    }
    re.backward_chunk(re.whole(), b, Tensor(), d, a, 1.0, /*weights_now=*/true, /*accumulate=*/false);
  }
  // Three micro-batches: the first's expert weight gradients deferred to the second's pass,
  // the third's made alone; packed documents in the second.
  std::vector<Batch> bs{testing::random_batch(2, 9, vocab, 11), packed_batch(vocab, 12),
                        testing::random_batch(2, 9, vocab, 13)};
  int64_t targets = 0;
  for (const Batch& b : bs) targets += b.num_targets;
  for (size_t i = 0; i < bs.size(); ++i) {
    const bool defer = i == 0;
    const MicroBatchLoss lp = plain.forward_backward(bs[i], d, 1.0 / static_cast<double>(targets), 1.0 / 3, i > 0,
                                                     defer);
    const MicroBatchLoss lr = re.forward_backward(bs[i], d, 1.0 / static_cast<double>(targets), 1.0 / 3, i > 0,
                                                  defer);
    EXPECT_EQ(lr.ce_sum, lp.ce_sum) << "micro-batch " << i;
    ASSERT_EQ(lr.terms.size(), lp.terms.size());
    for (size_t t = 0; t < lp.terms.size(); ++t) EXPECT_EQ(lr.terms[t].value, lp.terms[t].value) << lp.terms[t].name;
  }
  size_t nonzero = 0;
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    const Tensor& gp = plain.parameters()[i].grad;
    const Tensor& gr = re.parameters()[i].grad;
    EXPECT_TRUE(testing::bytes_equal(gr, gp)) << plain.parameters()[i].name;
    nonzero += testing::dot(gp, gp) > 0;
  }
  EXPECT_GT(nonzero, plain.parameters().size() / 2);  // the comparison is of real gradients
}

TEST(Recompute, FullAndSelectiveRecomputationGiveTheSameBitsQwen3) {
  const Qwen3MoeConfig c = testing::tiny_moe_config(50, 3);
  for (RecomputeMode mode : {RecomputeMode::kFull, RecomputeMode::kSelective}) {
    expect_same_bits<Qwen3MoeModel>(c, {0, 1, 2}, mode, "every layer");
    expect_same_bits<Qwen3MoeModel>(c, {1}, mode, "the middle layer");
  }
}

// FP8 ([training].fp8) with experts of whole 128 x 128 blocks: their rows are the values of
// the tokens' codes (the norm's fused quantization in the forward), and a recomputed layer
// makes the same rows again (selective: the dispatch made again in FP8, else the experts'
// weight gradients would read x itself).
TEST(Recompute, FullAndSelectiveRecomputationGiveTheSameBitsUnderFp8) {
  Qwen3MoeConfig c = testing::tiny_moe_config(50, 2);
  c.hidden_size = 128;
  c.moe_intermediate_size = 128;
  c.intermediate_size = 128;
  c.head_dim = 32;
  for (RecomputeMode mode : {RecomputeMode::kFull, RecomputeMode::kSelective}) {
    expect_same_bits<Qwen3MoeModel>(c, {0, 1}, mode, "every layer", /*fp8=*/true);
  }
}

TEST(Recompute, FullAndSelectiveRecomputationGiveTheSameBitsDeepseekV3) {
  DeepseekV3Config c = testing::tiny_dsv3_config(50, 3);
  c.seq_aux_loss_coef = 0.2;
  c.router_bias_update_speed = 0.01;
  c.num_nextn_predict_layers = 1;
  c.mtp_loss_weight = 0.3;
  for (RecomputeMode mode : {RecomputeMode::kFull, RecomputeMode::kSelective}) {
    expect_same_bits<DeepseekV3Model>(c, {0, 1, 2}, mode, "every layer (the module's never)");
    expect_same_bits<DeepseekV3Model>(c, {0, 2}, mode, "the dense layer and the last");
  }
}

}  // namespace
}  // namespace moetrain
