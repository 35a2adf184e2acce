// Whole-model checks of Qwen3-MoE: float64 gradients against finite differences, the
// staged (dispatch/combine) forward against reference_forward, layout-independent
// initialisation, and gradient accumulation over micro-batches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>

#include "engine/models/qwen3_moe.h"
#include "model_batches.h"
#include "model_gradcheck.h"
#include "test_util.h"

namespace moetrain {
namespace {

Qwen3MoeConfig tiny_config() { return testing::tiny_moe_config(19); }

using testing::random_batch;

double total_loss(Qwen3MoeModel& m, const Batch& b, ExpertDispatcher& d) {
  MicroBatchLoss l = m.forward_loss(b, d);
  return l.ce_sum / static_cast<double>(l.targets) + l.term("aux_loss") + l.term("z_loss");
}

// The shared finite-difference check (model_gradcheck.h).
void check_model_gradients(const Qwen3MoeConfig& cfg, const char* label,
                           const std::function<void(Qwen3MoeModel&)>& prepare = {}) {
  Qwen3MoeModel model(cfg, DType::F64);
  model.init_weights(7);
  if (prepare) prepare(model);
  LocalDispatcher d;
  Batch b = random_batch(2, 5, static_cast<int32_t>(cfg.vocab_size), 11, /*ignored=*/1);
  testing::check_model_gradients(model, b, d, [&] { return total_loss(model, b, d); }, label);
}

TEST(Qwen3Moe, WholeModelGradientMatchesFiniteDifferences) { check_model_gradients(tiny_config(), "moe"); }

TEST(Qwen3Moe, GradientsWithDenseLayerAndTiedEmbeddings) {
  Qwen3MoeConfig c = tiny_config();
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {1};
  c.tie_word_embeddings = true;
  c.norm_topk_prob = false;
  check_model_gradients(c, "dense+tied");
}

TEST(Qwen3Moe, StagedForwardEqualsReferenceForward) {
  Qwen3MoeConfig c = tiny_config();
  c.decoder_sparse_step = 2;  // layer 0 dense, layer 1 MoE
  Qwen3MoeModel model(c, DType::F64);
  model.init_weights(3);
  LocalDispatcher d;
  Batch b = random_batch(2, 6, static_cast<int32_t>(c.vocab_size), 5);
  BatchShape s{b.batch, b.seq};
  Tensor staged = model.forward_logits(b.inputs, b.positions, s, d);
  Tensor ref = model.reference_forward(b.inputs, b.positions, s);
  EXPECT_LT(testing::rel_error(staged, ref), 1e-12);
}

TEST(Qwen3Moe, CanonicalNamesAndLayoutIndependentInit) {
  Qwen3MoeConfig c = tiny_config();
  Qwen3MoeModel a(c, DType::F32), b(c, DType::F32);
  a.init_weights(42);
  b.init_weights(42);
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  bool saw_expert = false;
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    const Parameter& p = a.parameters()[i];
    EXPECT_EQ(testing::rel_error(p.value, b.parameters()[i].value), 0.0) << p.name;
    if (p.name == "model.layers.1.mlp.experts.3.down_proj.weight") {
      saw_expert = true;
      EXPECT_EQ(p.value.shape(), (Shape{c.hidden_size, c.moe_intermediate_size}));
    }
  }
  EXPECT_TRUE(saw_expert);
  EXPECT_EQ(a.parameters().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(a.parameters().back().name, "lm_head.weight");
  // An expert's values depend on its name only: a model with more layers draws the same
  // numbers for the layers both have.
  Qwen3MoeConfig deeper = c;
  deeper.num_hidden_layers = 3;
  Qwen3MoeModel big(deeper, DType::F32);
  big.init_weights(42);
  for (const Parameter& p : a.parameters()) {
    for (const Parameter& q : big.parameters()) {
      if (q.name == p.name) {
        EXPECT_EQ(testing::rel_error(p.value, q.value), 0.0) << p.name;
      }
    }
  }
  // Norm gains start at one; different seeds give different matrices.
  Qwen3MoeModel other(c, DType::F32);
  other.init_weights(43);
  EXPECT_GT(testing::rel_error(other.parameters()[0].value, a.parameters()[0].value), 0.1);
}

TEST(Qwen3Moe, GradientAccumulationEqualsOneLargeBatch) {
  Qwen3MoeConfig c = tiny_config();
  c.router_aux_loss_coef = 0;  // a per-micro-batch statistic: not additive
  c.router_z_loss_coef = 0;
  Qwen3MoeModel model(c, DType::F64);
  model.init_weights(9);
  LocalDispatcher d;
  Batch whole = random_batch(4, 5, static_cast<int32_t>(c.vocab_size), 21);
  zero_grads(model.parameters());
  model.forward_backward(whole, d, 1.0 / 20.0, 1.0);
  std::vector<Tensor> expected;
  for (auto& p : model.parameters()) expected.push_back(p.grad.clone());

  zero_grads(model.parameters());
  for (int half = 0; half < 2; ++half) {
    Batch b;
    b.batch = 2;
    b.seq = 5;
    b.inputs = whole.inputs.slice(half * 10, half * 10 + 10).clone();
    b.targets = whole.targets.slice(half * 10, half * 10 + 10).clone();
    b.positions = whole.positions.slice(half * 10, half * 10 + 10).clone();
    b.num_targets = 10;
    model.forward_backward(b, d, 1.0 / 20.0, 0.5);
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_LT(testing::rel_error(model.parameters()[i].grad, expected[i]), 1e-12) << model.parameters()[i].name;
  }
}

// Micro-batches in groups (the trainer's [training].expert_wgrad_group): the MoE layers keep
// the experts' weight-gradient inputs of a group's micro-batches and its last one makes them
// all. On the CPU that is the calls in turn, so every gradient must equal, bit for bit, the
// micro-batches run one by one; from NaN gradients, so the first pass must write, not add.
// A step's first micro-batch drops what a broken step kept.
TEST(Qwen3Moe, GroupedExpertWeightGradientsEqualMicroBatchesInTurn) {
  Qwen3MoeConfig c = tiny_config();
  c.decoder_sparse_step = 2;  // layer 0 dense (never deferred), layer 1 MoE
  auto run = [&](int n, int group) {
    Qwen3MoeModel model(c, DType::F64);
    model.init_weights(12);
    LocalDispatcher d;
    for (auto& p : model.parameters()) p.grad.fill_(NAN);
    for (int i = 0; i < n; ++i) {
      Batch b = random_batch(2, 5, static_cast<int32_t>(c.vocab_size), 40 + i);
      const bool defer = (i + 1) % group != 0 && i + 1 < n;  // as the trainer decides
      model.forward_backward(b, d, 1.0 / 10.0, 1.0 / n, /*accumulate_grads=*/i > 0, defer);
    }
    std::vector<Tensor> g;
    for (auto& p : model.parameters()) g.push_back(p.grad.clone());
    return g;
  };
  for (int n : {2, 3, 5}) {
    const std::vector<Tensor> in_turn = run(n, 1);
    for (int group : {2, 3, 4}) {
      const std::vector<Tensor> grouped = run(n, group);
      for (size_t i = 0; i < in_turn.size(); ++i) {
        EXPECT_TRUE(ops::all_finite(grouped[i])) << n << " micro-batches, groups of " << group << ": " << i;
        EXPECT_EQ(testing::rel_error(grouped[i], in_turn[i]), 0.0)
            << n << " micro-batches, groups of " << group << ", parameter " << i;
      }
    }
  }
  // A step that deferred and ended there; the next step (accumulate false) must give the
  // gradients of a model that never deferred.
  Qwen3MoeModel model(c, DType::F64), fresh(c, DType::F64);
  model.init_weights(12);
  fresh.init_weights(12);
  LocalDispatcher d;
  Batch b = random_batch(2, 5, static_cast<int32_t>(c.vocab_size), 50);
  model.forward_backward(b, d, 0.1, 1.0, false, /*defer_expert_weights=*/true);
  model.forward_backward(b, d, 0.1, 1.0, false);
  fresh.forward_backward(b, d, 0.1, 1.0, false);
  for (size_t i = 0; i < fresh.parameters().size(); ++i) {
    EXPECT_EQ(testing::rel_error(model.parameters()[i].grad, fresh.parameters()[i].grad), 0.0) << i;
  }
}

// A step's first micro-batch overwrites the gradients instead of adding to zeroed ones:
// from gradients full of NaN, every one must come out as zero + accumulate gives it
// (tied and untied heads; the tiny config leaves some experts without tokens).
TEST(Qwen3Moe, FirstMicroBatchOverwritesGradients) {
  for (bool tied : {false, true}) {
    Qwen3MoeConfig c = tiny_config();
    c.tie_word_embeddings = tied;
    c.num_experts = 8;  // 20 tokens x top-2 over 8 experts: some expert is likely idle
    Qwen3MoeModel model(c, DType::F64);
    model.init_weights(4);
    LocalDispatcher d;
    Batch b = random_batch(2, 10, static_cast<int32_t>(c.vocab_size), 31);
    zero_grads(model.parameters());
    MicroBatchLoss l = model.forward_backward(b, d, 1.0 / 20.0, 1.0);
    std::vector<Tensor> expected;
    for (auto& p : model.parameters()) {
      expected.push_back(p.grad.clone());
      p.grad.fill_(NAN);
    }
    model.forward_backward(b, d, 1.0 / 20.0, 1.0, /*accumulate_grads=*/false);
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_LT(testing::rel_error(model.parameters()[i].grad, expected[i]), 1e-15)
          << (tied ? "tied: " : "untied: ") << model.parameters()[i].name;
    }
    int idle = 0;
    for (const auto& layer : l.expert_counts)
      for (int64_t n : layer) idle += n == 0;
    if (!tied) std::printf("experts without tokens in the overwrite test: %d\n", idle);
  }
}

// Aux-loss-free balancing: each MoE layer holds a routing bias (a named buffer), which
// balance_experts moves against the load error, and the router picks by it: a bias that
// has been pushed up far enough puts its expert in every token's top-k; the gradients
// still match finite differences with a bias in place.
TEST(Qwen3Moe, RoutingBiasMovesAgainstTheLoadAndSteersTheChoice) {
  Qwen3MoeConfig c = tiny_config();
  EXPECT_TRUE(Qwen3MoeModel(c, DType::F64).buffers().empty());  // off by default: no buffer
  c.router_bias_update_speed = 0.25;
  Qwen3MoeModel model(c, DType::F64);
  model.init_weights(5);
  const std::vector<NamedBuffer> buffers = model.buffers();
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_EQ(buffers[0].name, "model.layers.0.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(buffers[1].name, "model.layers.1.mlp.gate.e_score_correction_bias");
  // Layer 0: expert 0 over the mean (10), experts 1 and 2 under, expert 3 at it.
  model.balance_experts({{19, 5, 6, 10}, {10, 10, 10, 10}});
  EXPECT_EQ(buffers[0].value.to_double_vector(), (std::vector<double>{-0.25, 0.25, 0.25, 0}));
  EXPECT_EQ(buffers[1].value.to_double_vector(), (std::vector<double>{0, 0, 0, 0}));
  try {
    model.balance_experts({{1, 2, 3, 4}});
    ADD_FAILURE() << "loads for one of two MoE layers were taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MoE layers"), std::string::npos) << e.what();
  }

  // Expert 3 of layer 1 loaded least, four steps running: its bias reaches +1 (> any prob gap).
  for (int i = 0; i < 4; ++i) model.balance_experts({{10, 10, 10, 10}, {12, 12, 12, 4}});
  EXPECT_EQ(buffers[1].value.to_double_vector(), (std::vector<double>{-1, -1, -1, 1}));
  LocalDispatcher d;
  Batch b = random_batch(2, 7, static_cast<int32_t>(c.vocab_size), 13);
  MicroBatchLoss l = model.forward_loss(b, d);
  ASSERT_EQ(l.expert_counts.size(), 2u);
  EXPECT_EQ(l.expert_counts[1][3], 14) << "every token takes the expert whose bias was raised";
  // The staged path and the reference path route alike with the bias.
  BatchShape s{b.batch, b.seq};
  EXPECT_LT(testing::rel_error(model.forward_logits(b.inputs, b.positions, s, d),
                               model.reference_forward(b.inputs, b.positions, s)), 1e-12);
}

TEST(Qwen3Moe, GradientsWithRoutingBias) {
  Qwen3MoeConfig c = tiny_config();
  c.router_bias_update_speed = 0.3;
  check_model_gradients(c, "routing bias", [](Qwen3MoeModel& m) {  // expert 2 favoured in both layers
    m.balance_experts({{5, 5, 1, 5}, {5, 5, 1, 5}});
  });
}

TEST(Qwen3Moe, FlopsPerTokenCountsActiveParameters) {
  Qwen3MoeConfig c = tiny_config();
  Qwen3MoeModel m(c, DType::F32);
  const int64_t attn = 8 * 4 * (2 * 4 + 2 * 2);
  const int64_t moe = 8 * 4 + 2 * 3 * 8 * 6;
  EXPECT_EQ(m.active_matmul_params(), 19 * 8 + 2 * (attn + moe));
  EXPECT_DOUBLE_EQ(m.flops_per_token(10), 6.0 * m.active_matmul_params() + 12.0 * 2 * 4 * 4 * 10);
}

}  // namespace
}  // namespace moetrain
