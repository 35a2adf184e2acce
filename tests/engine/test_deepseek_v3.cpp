// Whole-model checks of DeepSeek-V3: float64 gradients against finite differences (with and
// without the query latent, shared experts, YaRN, a routing bias), the staged forward
// against reference_forward, Hugging Face's names, gradient accumulation, the routing bias.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "engine/checkpoint/safetensors.h"
#include "engine/eval/score.h"
#include "engine/models/deepseek_v3.h"
#include "test_files.h"
#include "model_batches.h"
#include "model_gradcheck.h"
#include "test_util.h"

namespace moetrain {
namespace {

DeepseekV3Config tiny_config() { return testing::tiny_dsv3_config(19); }

using testing::random_batch;

double total_loss(DeepseekV3Model& m, const Batch& b, ExpertDispatcher& d) {
  MicroBatchLoss l = m.forward_loss(b, d);
  return l.ce_sum / static_cast<double>(l.targets) + l.term("seq_aux_loss");
}

// Gives every routing bias distinct values of the scores' size, so that the groups and the
// top-k the bias steers differ from those of the scores alone.
void spread_biases(DeepseekV3Model& m, uint64_t seed) {
  for (NamedBuffer& b : m.buffers()) {
    b.value.copy_from(testing::random_tensor(b.value.shape(), DType::F32, seed++, 0.3));
  }
}

// The shared finite-difference check (model_gradcheck.h); every non-routed parameter must get
// a gradient.
void check_model_gradients(const DeepseekV3Config& cfg, const char* label,
                           const std::function<void(DeepseekV3Model&)>& prepare = {}) {
  DeepseekV3Model model(cfg, DType::F64);
  model.init_weights(7);
  if (prepare) prepare(model);
  LocalDispatcher d;
  Batch b = random_batch(2, 5, static_cast<int32_t>(cfg.vocab_size), 11, /*ignored=*/1);
  testing::check_model_gradients(model, b, d, [&] { return total_loss(model, b, d); }, label,
                                 [](const std::string& name) { return name.find(".mlp.experts.") != std::string::npos; });
}

TEST(DeepseekV3, WholeModelGradientMatchesFiniteDifferences) {
  check_model_gradients(tiny_config(), "dsv3", [](DeepseekV3Model& m) { spread_biases(m, 3); });
}

// The other form of every feature: queries projected directly, no shared expert, plain RoPE
// of rotate-half pairs, plain top-k (one group), unnormalised weights, tied embeddings.
TEST(DeepseekV3, GradientsOfTheOtherForms) {
  DeepseekV3Config c = tiny_config();
  c.q_lora_rank = 0;
  c.n_shared_experts = 0;
  c.rope_type = "default";
  c.rope_interleave = false;
  c.n_group = 1;
  c.topk_group = 1;
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.7;
  c.tie_word_embeddings = true;
  c.first_k_dense_replace = 0;
  c.num_hidden_layers = 2;
  check_model_gradients(c, "dsv3 other forms");
}

// DeepSeek's sequence-wise balance loss, on top of everything else: its gradient reaches the
// router through the scores; its value is a mean over the MoE layers and sequences.
TEST(DeepseekV3, GradientsWithTheSequenceWiseBalanceLoss) {
  DeepseekV3Config c = tiny_config();
  c.seq_aux_loss_coef = 0.3;
  check_model_gradients(c, "dsv3 seq aux", [](DeepseekV3Model& m) { spread_biases(m, 4); });
  DeepseekV3Model m(c, DType::F64);
  m.init_weights(2);
  LocalDispatcher d;
  const MicroBatchLoss l = m.forward_loss(random_batch(2, 5, 19, 3), d);
  const double v = l.term("seq_aux_loss");
  // sum_i f_i P_i is 1 when the load follows the scores evenly, and lies in (0, E / K]; the
  // term is 0.3 times its sum over the 2 MoE layers of its mean over the 2 sequences.
  EXPECT_GT(v, 0.0);
  EXPECT_LT(v, 0.3 * 2 * 8 / 2);
}

TEST(DeepseekV3, StagedForwardEqualsReferenceForward) {
  DeepseekV3Model model(tiny_config(), DType::F64);
  model.init_weights(3);
  spread_biases(model, 5);
  LocalDispatcher d;
  Batch b = random_batch(2, 6, 19, 5);
  BatchShape s{b.batch, b.seq};
  Tensor staged = model.forward_logits(b.inputs, b.positions, s, d);
  Tensor ref = model.reference_forward(b.inputs, b.positions, s);
  EXPECT_LT(testing::rel_error(staged, ref), 1e-12);
}

TEST(DeepseekV3, HuggingFaceNamesAndShapes) {
  DeepseekV3Config c = tiny_config();
  DeepseekV3Model m(c, DType::F32);
  m.init_weights(1);
  std::map<std::string, Shape> shapes;
  for (const Parameter& p : m.parameters()) shapes[p.name] = p.value.shape();
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::map<std::string, Shape> want{
      {"model.embed_tokens.weight", {19, 8}},
      {"model.layers.0.self_attn.q_a_proj.weight", {5, 8}},
      {"model.layers.0.self_attn.q_a_layernorm.weight", {5}},
      {"model.layers.0.self_attn.q_b_proj.weight", {2 * qk, 5}},
      {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {6 + 2, 8}},
      {"model.layers.0.self_attn.kv_a_layernorm.weight", {6}},
      {"model.layers.0.self_attn.kv_b_proj.weight", {2 * (4 + 3), 6}},
      {"model.layers.0.self_attn.o_proj.weight", {8, 2 * 3}},
      {"model.layers.0.mlp.gate_proj.weight", {12, 8}},
      {"model.layers.0.mlp.down_proj.weight", {8, 12}},
      {"model.layers.1.mlp.gate.weight", {8, 8}},
      {"model.layers.1.mlp.experts.7.up_proj.weight", {6, 8}},
      {"model.layers.2.mlp.shared_experts.gate_proj.weight", {6, 8}},
      {"model.layers.2.mlp.shared_experts.down_proj.weight", {8, 6}},
      {"model.norm.weight", {8}},
      {"lm_head.weight", {19, 8}},
  };
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(shapes.count(name)) << name;
    EXPECT_EQ(shapes[name], shape) << name;
  }
  EXPECT_FALSE(shapes.count("model.layers.0.mlp.gate.weight")) << "layer 0 is dense";
  EXPECT_FALSE(shapes.count("model.layers.0.self_attn.q_proj.weight")) << "q_lora_rank > 0";
  // The routing bias: a buffer of every MoE layer, even with the balancing off.
  c.router_bias_update_speed = 0;
  std::vector<NamedBuffer> buffers = DeepseekV3Model(c, DType::F32).buffers();
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_EQ(buffers[0].name, "model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ(buffers[1].value.shape(), (Shape{8}));
  // A multi-token prediction module: layer 3 (an MoE layer, with its routing bias) and the
  // module's own weights under DeepSeek's checkpoint names.
  c.num_nextn_predict_layers = 1;
  DeepseekV3Model with_mtp(c, DType::F32);
  std::map<std::string, Shape> mtp_shapes;
  for (const Parameter& p : with_mtp.parameters()) mtp_shapes[p.name] = p.value.shape();
  const std::map<std::string, Shape> mtp_want{
      {"model.layers.3.embed_tokens.weight", {19, 8}},  {"model.layers.3.enorm.weight", {8}},
      {"model.layers.3.hnorm.weight", {8}},              {"model.layers.3.eh_proj.weight", {8, 16}},
      {"model.layers.3.shared_head.norm.weight", {8}},   {"model.layers.3.shared_head.head.weight", {19, 8}},
      {"model.layers.3.self_attn.kv_b_proj.weight", {2 * (4 + 3), 6}}, {"model.layers.3.mlp.gate.weight", {8, 8}},
      {"model.layers.3.mlp.shared_experts.up_proj.weight", {6, 8}},
  };
  for (const auto& [name, shape] : mtp_want) {
    ASSERT_TRUE(mtp_shapes.count(name)) << name;
    EXPECT_EQ(mtp_shapes[name], shape) << name;
  }
  size_t layer2 = 0, layer3 = 0;
  for (const auto& [name, shape] : mtp_shapes) {
    layer2 += name.rfind("model.layers.2.", 0) == 0;
    layer3 += name.rfind("model.layers.3.", 0) == 0;
  }
  EXPECT_EQ(layer3, layer2 + 6) << "the module: an MoE layer like layer 2, and its six own weights";
  EXPECT_EQ(mtp_shapes.size(), shapes.size() + layer3);
  ASSERT_EQ(with_mtp.buffers().size(), 3u);
  EXPECT_EQ(with_mtp.buffers()[2].name, "model.layers.3.mlp.gate.e_score_correction_bias");
  c.num_nextn_predict_layers = 0;
}

// With and without a multi-token prediction module (its weights written by the first
// micro-batch too: every gradient starts as NaN).
TEST(DeepseekV3, GradientAccumulationEqualsOneLargeBatch) {
  for (int64_t mtp : {0, 1}) {
  SCOPED_TRACE("num_nextn_predict_layers = " + std::to_string(mtp));
  DeepseekV3Config c = tiny_config();
  c.num_nextn_predict_layers = mtp;
  DeepseekV3Model model(c, DType::F64);
  model.init_weights(9);
  LocalDispatcher d;
  Batch whole = random_batch(4, 5, 19, 21);
  zero_grads(model.parameters());
  model.forward_backward(whole, d, 1.0 / 20.0, 1.0);
  std::vector<Tensor> expected;
  for (auto& p : model.parameters()) expected.push_back(p.grad.clone());
  for (auto& p : model.parameters()) p.grad.fill_(NAN);  // the first micro-batch must write
  for (int half = 0; half < 2; ++half) {
    Batch b;
    b.batch = 2;
    b.seq = 5;
    b.inputs = whole.inputs.slice(half * 10, half * 10 + 10).clone();
    b.targets = whole.targets.slice(half * 10, half * 10 + 10).clone();
    b.positions = whole.positions.slice(half * 10, half * 10 + 10).clone();
    b.num_targets = 10;
    model.forward_backward(b, d, 1.0 / 20.0, 0.5, /*accumulate_grads=*/half > 0, /*defer=*/half == 0);
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_LT(testing::rel_error(model.parameters()[i].grad, expected[i]), 1e-12) << model.parameters()[i].name;
  }
  }
}

// ---- multi-token prediction ----------------------------------------------------------

// Two rows of 7 tokens, the first packing documents of 4 and 3 tokens (segment ids, positions
// restarting), one target ignored.
Batch packed_batch(uint64_t seed) {
  Batch b = random_batch(2, 7, 19, seed, /*ignored=*/9);
  b.segment_ids = Tensor::from_vector(std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}, {14});
  b.positions = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6}, {14});
  return b;
}

// The loss a training pass reports (the modules run only when training), on a twin of `m`
// given m's weights and biases, so that m's gradients stay as they are.
double training_loss(DeepseekV3Model& m, DeepseekV3Model& twin, const Batch& b, ExpertDispatcher& d) {
  for (size_t i = 0; i < m.parameters().size(); ++i) twin.parameters()[i].value.copy_from(m.parameters()[i].value);
  for (size_t i = 0; i < m.buffers().size(); ++i) twin.buffers()[i].value.copy_from(m.buffers()[i].value);
  const MicroBatchLoss l = twin.forward_backward(b, d, 1.0 / static_cast<double>(b.num_targets), 1.0);
  return l.ce_sum / static_cast<double>(l.targets) + l.term("mtp_loss") + l.term("seq_aux_loss");
}

// Two chained modules (the second reads the first's output), over packed documents: every
// weight's gradient, the main model's too, against finite differences of the whole loss.
TEST(DeepseekV3, GradientsWithMultiTokenPrediction) {
  DeepseekV3Config c = tiny_config();
  c.num_nextn_predict_layers = 2;
  c.mtp_loss_weight = 0.7;
  c.seq_aux_loss_coef = 0.2;
  DeepseekV3Model model(c, DType::F64), twin(c, DType::F64);
  model.init_weights(7);
  spread_biases(model, 6);
  LocalDispatcher d;
  const Batch b = packed_batch(31);
  testing::check_model_gradients(model, b, d, [&] { return training_loss(model, twin, b, d); }, "dsv3 mtp",
                                 [](const std::string& name) { return name.find(".mlp.experts.") != std::string::npos; });
}

// The modules' loss against a plain computation from the parts: standalone copies of every
// layer (reference_forward), the shifts written out here, the concatenation by hand.
TEST(DeepseekV3, MultiTokenPredictionLossMatchesAPlainComputation) {
  DeepseekV3Config c = tiny_config();
  const int64_t L = c.num_hidden_layers, D = 2, H = c.hidden_size, V = c.vocab_size;
  c.num_nextn_predict_layers = D;
  c.mtp_loss_weight = 0.45;
  DeepseekV3Model model(c, DType::F64);
  model.init_weights(12);
  spread_biases(model, 8);
  std::map<std::string, Tensor> w;
  for (const Parameter& p : model.parameters()) w[p.name] = p.value;
  std::vector<std::unique_ptr<DeepseekV3DecoderLayer>> layers;
  for (int64_t id = 0; id < L + D; ++id) {
    layers.push_back(std::make_unique<DeepseekV3DecoderLayer>(c, id, DType::F64, Device::cpu()));
    ParameterList mine;
    layers.back()->collect_parameters(mine);
    for (Parameter& p : mine) p.value.copy_from(w.at(p.name));
    if (Tensor* bias = layers.back()->routing_bias()) {
      for (NamedBuffer& nb : model.buffers()) {
        if (nb.name == fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", id)) bias->copy_from(nb.value);
      }
    }
  }
  const Batch b = packed_batch(41);
  const BatchShape shape{b.batch, b.seq, b.segment_ids};
  Tensor h = ops::embedding_forward(b.inputs, w.at("model.embed_tokens.weight"));
  for (int64_t id = 0; id < L; ++id) h = layers[id]->reference_forward(h, b.positions, shape);
  const std::vector<int32_t> in = b.inputs.to_vector<int32_t>(), tg = b.targets.to_vector<int32_t>();
  const std::vector<int32_t> seg = b.segment_ids.to_vector<int32_t>();
  const int64_t T = b.batch * b.seq;
  double ce = 0;
  for (int64_t k = 1; k <= D; ++k) {
    const std::string p = fmt::format("model.layers.{}.", L + k - 1);
    std::vector<int32_t> ids(T), targets(T);
    for (int64_t t = 0; t < T; ++t) {  // token t + k of the same row and document, if any
      const bool inside = t % b.seq + k < b.seq && seg[t + k] == seg[t];
      ids[t] = inside ? in[t + k] : 0;
      targets[t] = inside ? tg[t + k] : ops::kIgnoreIndex;
    }
    const Tensor e = ops::embedding_forward(Tensor::from_vector(ids, {T}), w.at(p + "embed_tokens.weight"));
    const std::vector<double> en = ops::rmsnorm_forward(e, w.at(p + "enorm.weight"), c.rms_norm_eps).y.to_double_vector();
    const std::vector<double> hn = ops::rmsnorm_forward(h, w.at(p + "hnorm.weight"), c.rms_norm_eps).y.to_double_vector();
    std::vector<double> joined;
    for (int64_t t = 0; t < T; ++t) {
      joined.insert(joined.end(), en.begin() + t * H, en.begin() + (t + 1) * H);
      joined.insert(joined.end(), hn.begin() + t * H, hn.begin() + (t + 1) * H);
    }
    const Tensor u = ops::linear_forward(Tensor::from_vector(joined, {T, 2 * H}), w.at(p + "eh_proj.weight"));
    h = layers[L + k - 1]->reference_forward(u, b.positions, shape);
    const Tensor n = ops::rmsnorm_forward(h, w.at(p + "shared_head.norm.weight"), c.rms_norm_eps).y;
    const std::vector<double> logits = ops::linear_forward(n, w.at(p + "shared_head.head.weight")).to_double_vector();
    for (int64_t t = 0; t < T; ++t) {
      if (targets[t] == ops::kIgnoreIndex) continue;
      double m = -INFINITY, z = 0;
      for (int64_t v = 0; v < V; ++v) m = std::max(m, logits[t * V + v]);
      for (int64_t v = 0; v < V; ++v) z += std::exp(logits[t * V + v] - m);
      ce += m + std::log(z) - logits[t * V + targets[t]];
    }
  }
  LocalDispatcher d;
  const MicroBatchLoss got = model.forward_backward(b, d, 1.0 / static_cast<double>(b.num_targets), 1.0);
  const double want = 0.45 / D * ce / static_cast<double>(b.num_targets);
  EXPECT_NEAR(got.term("mtp_loss"), want, 1e-12 * want);
  // The main loss is the main model's, as without the modules (and as scoring sees it).
  const MicroBatchLoss scored = model.forward_loss(b, d);
  EXPECT_NEAR(got.ce_sum, scored.ce_sum, 1e-12 * scored.ce_sum);
  EXPECT_EQ(scored.term("mtp_loss"), 0.0) << "forward_loss (scoring, validation) runs no module";
}

// Aux-loss-free balancing moves the bias against the load; a raised bias puts its expert
// (and so its group) in every token's choice, while the weights stay the unbiased scores.
TEST(DeepseekV3, RoutingBiasSteersTheChoice) {
  DeepseekV3Config c = tiny_config();
  c.router_bias_update_speed = 0.5;
  DeepseekV3Model model(c, DType::F64);
  model.init_weights(5);
  std::vector<NamedBuffer> buffers = model.buffers();
  const std::vector<int64_t> even(8, 10);
  std::vector<int64_t> low6 = even;
  low6[6] = 3;
  low6[0] = 17;
  for (int i = 0; i < 4; ++i) model.balance_experts({even, low6});
  const std::vector<double> b2 = buffers[1].value.to_double_vector();
  EXPECT_EQ(b2[6], 2.0);
  EXPECT_EQ(b2[0], -2.0);
  EXPECT_EQ(b2[3], 0.0);
  EXPECT_EQ(buffers[0].value.to_double_vector(), std::vector<double>(8, 0.0));
  LocalDispatcher d;
  Batch b = random_batch(2, 7, 19, 13);
  MicroBatchLoss l = model.forward_loss(b, d);
  ASSERT_EQ(l.expert_counts.size(), 2u);
  EXPECT_EQ(l.expert_counts[1][6], 14) << "every token takes the expert whose bias was raised";
  EXPECT_EQ(l.expert_counts[1][0], 0) << "and none the one pushed down";
  BatchShape s{b.batch, b.seq};
  EXPECT_LT(testing::rel_error(model.forward_logits(b.inputs, b.positions, s, d),
                               model.reference_forward(b.inputs, b.positions, s)), 1e-12);
}

TEST(DeepseekV3, FlopsPerTokenCountsActiveParameters) {
  DeepseekV3Config c = tiny_config();
  DeepseekV3Model m(c, DType::F32);
  const int64_t attn = 8 * 5 + 5 * 2 * 6 + 8 * 8 + 6 * 2 * 7 + 2 * 3 * 8;
  const int64_t dense = 3 * 8 * 12, moe = 8 * 8 + (2 + 1) * 3 * 8 * 6;
  EXPECT_EQ(m.active_matmul_params(), 19 * 8 + 3 * attn + dense + 2 * moe);
  EXPECT_DOUBLE_EQ(m.flops_per_token(10), 6.0 * m.active_matmul_params() + 6.0 * 3 * 2 * (6 + 3) * 10);
}

// A Hugging Face folder of a model whose routing biases steer the choice: score (the path
// of tools/check_hf_logits.py) reads the biases with the weights and gives the model's logits.
TEST(DeepseekV3, ScoreReadsTheRoutingBiasesOfAFolder) {
  testing::ScratchDir dir;
  std::filesystem::create_directories(dir.path() / "hf");
  DeepseekV3Config c = tiny_config();
  DeepseekV3Model model(c, DType::F32);
  model.init_weights(8);
  for (NamedBuffer& b : model.buffers()) {  // strong enough to move every token's choice
    b.value.copy_from(testing::random_tensor(b.value.shape(), DType::F32, 9, 3.0));
  }
  SafetensorsWriter w;
  for (const Parameter& p : model.parameters()) w.add(p.name, p.value);
  for (const NamedBuffer& b : model.buffers()) w.add(b.name, b.value);
  w.write((dir.path() / "hf" / "model.safetensors").string());
  std::ofstream(dir.path() / "hf" / "config.json") << c.to_hf_json();
  std::vector<int32_t> ids{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8};
  const ScoreResult r = score_tokens(dir / "hf", ids, "cpu");
  std::vector<int32_t> pos(ids.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  LocalDispatcher d;
  const auto S = static_cast<int64_t>(ids.size());
  Tensor want = model.forward_logits(Tensor::from_vector(ids, {S}), Tensor::from_vector(pos, {S}), {1, S}, d);
  EXPECT_LT(testing::rel_error(r.logits, want), 1e-6);
}

}  // namespace
}  // namespace moetrain
