#include <gtest/gtest.h>

#include <cmath>

#include "engine/optim/adamw.h"
#include "engine/optim/layerwise.h"
#include "engine/optim/lr_schedule.h"
#include "engine/trainer.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

TEST(LrSchedule, WarmupThenCosine) {
  LrSchedule s{"cosine", 1.0, 0.1, 10, 110, 0.2};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(10 + 99 / 2.0), 0.55, 0.01);
  EXPECT_DOUBLE_EQ(s.at(109), 0.1);
  for (int64_t i = 10; i < 109; ++i) EXPECT_GE(s.at(i), s.at(i + 1));
}

TEST(LrSchedule, WarmupStableDecay) {
  LrSchedule s{"wsd", 2.0, 0.0, 5, 100, 0.2};
  EXPECT_DOUBLE_EQ(s.at(4), 2.0);
  EXPECT_DOUBLE_EQ(s.at(50), 2.0);
  EXPECT_DOUBLE_EQ(s.at(79), 2.0);
  EXPECT_LT(s.at(90), 2.0);
  EXPECT_DOUBLE_EQ(s.at(99), 0.0);
  LrSchedule c{"constant", 3.0, 0.0, 0, 10, 0.2};
  EXPECT_DOUBLE_EQ(c.at(7), 3.0);
}

ParameterList one_param(std::vector<double> value, std::vector<double> grad, bool decay) {
  Parameter p{"w", Tensor::from_vector(value, {static_cast<int64_t>(value.size())}),
              Tensor::from_vector(grad, {static_cast<int64_t>(grad.size())}), decay, 0.0};
  return {p};
}

TEST(AdamW, MatchesHandComputationAndDecaysOnlyMatrices) {
  ParameterList ps = one_param({1.0, -2.0}, {0.5, 0.0}, true);
  AdamW opt(ps, {0.9, 0.99, 1e-8, 0.1});
  opt.step(ps, 0.01);
  // step 1: m = 0.05, v = 0.0025 -> mhat = 0.5, vhat = 0.25 -> update 1 (per unit lr)
  EXPECT_NEAR(ps[0].value.item(0), 1.0 - 0.01 * (1.0 + 0.1 * 1.0), 1e-9);  // eps shifts the ratio by 2e-8
  EXPECT_NEAR(ps[0].value.item(1), -2.0 - 0.01 * (0.0 + 0.1 * -2.0), 1e-12);
  ParameterList gains = one_param({1.0}, {0.0}, false);
  AdamW opt2(gains, {0.9, 0.99, 1e-8, 0.1});
  opt2.step(gains, 0.01);
  EXPECT_EQ(gains[0].value.item(0), 1.0);
}

TEST(GlobalGradNorm, ReportsTheNormAndTheClipFactorWithoutTouchingGradients) {
  ParameterList ps = one_param({0, 0}, {3.0, 4.0}, true);
  ParameterList more = one_param({0}, {12.0}, true);
  ps.push_back(more[0]);
  const GradNorm g = global_grad_norm(ps, 1.0);
  EXPECT_DOUBLE_EQ(g.norm, 13.0);
  EXPECT_DOUBLE_EQ(g.clip_scale, 1.0 / (13.0 + 1e-6));
  EXPECT_EQ(ps[0].grad.item(0), 3.0);  // clipping is applied by the optimizer, not here
  ParameterList small = one_param({0}, {0.5}, true);
  EXPECT_EQ(global_grad_norm(small, 1.0).clip_scale, 1.0);
  EXPECT_EQ(global_grad_norm(ps, 0.0).clip_scale, 1.0);  // max_norm 0: no clipping
  ParameterList bad = one_param({0, 0}, {1.0, NAN}, true);
  bad[0].name = "model.layers.3.mlp.gate.weight";
  try {
    global_grad_norm(bad, 1.0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.3.mlp.gate.weight"), std::string::npos);
  }
}

TEST(AdamW, ClipScaleEqualsScalingTheGradient) {
  // Folding the clip factor into the update must equal updating with scaled gradients.
  ParameterList a = one_param({1.0, -2.0, 0.5}, {0.3, -0.7, 0.2}, true);
  ParameterList b = one_param({1.0, -2.0, 0.5}, {0.3 * 0.25, -0.7 * 0.25, 0.2 * 0.25}, true);
  AdamW oa(a, {0.9, 0.99, 1e-8, 0.1}), ob(b, {0.9, 0.99, 1e-8, 0.1});
  for (int s = 0; s < 3; ++s) {
    oa.step(a, 0.01, 0.25);
    ob.step(b, 0.01);
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(a[0].value.item(i), b[0].value.item(i), 1e-12);
}


// Parameters of random values and gradients, f32, as views of flat buffers like a model's.
ParameterList flat_params(const std::vector<int64_t>& sizes, uint64_t seed) {
  ParameterList ps;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ps.push_back(Parameter{"p" + std::to_string(i), testing::random_tensor({sizes[i]}, DType::F32, seed + 2 * i),
                           testing::random_tensor({sizes[i]}, DType::F32, seed + 2 * i + 1), i % 2 == 0, 0.0});
  }
  return ps;
}

// AdamW cut into per-group updates (LayerwiseOptimizer) equals the whole-list step bit for
// bit, bf16 moments included: their stochastic rounding keys on each element's place in
// the moment buffer, not on its index inside whatever tensors one call was given.
TEST(AdamW, UpdateInPartsEqualsTheWholeStepBf16MomentsIncluded) {
  for (bool bf16 : {false, true}) {
    ParameterList whole = flat_params({37, 300, 5, 128}, 11), parts = flat_params({37, 300, 5, 128}, 11);
    AdamWConfig cfg{0.9, 0.95, 1e-8, 0.1, bf16};
    AdamW a(whole, cfg), b(parts, cfg);
    for (int step = 0; step < 3; ++step) {
      a.step(whole, 1e-2, 0.7);
      b.advance();
      b.update(parts, {3, 1}, 1e-2, 0.7);
      b.update(parts, {0, 2}, 1e-2, 0.7);
    }
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_TRUE(testing::bytes_equal(whole[i].value, parts[i].value)) << "param " << i << " bf16 " << bf16;
      EXPECT_TRUE(testing::bytes_equal(a.exp_avg()[i], b.exp_avg()[i])) << "m " << i << " bf16 " << bf16;
      EXPECT_TRUE(testing::bytes_equal(a.exp_avg_sq()[i], b.exp_avg_sq()[i])) << "v " << i << " bf16 " << bf16;
    }
  }
}

// A training step through LayerwiseOptimizer (the norm summed bucket by bucket, AdamW
// group by group) against the plain global norm and whole-list AdamW, in float64. Steps
// of one micro-batch take the experts' share of the norm from the weight-gradient op
// (WeightHooks::expert_grad_squares); so do steps of two, whose experts' weight gradients
// are made in one pass by the second (the model's expert_wgrad_group of 2); steps of three
// sum it afterwards (a group of two, then the third adding).
class LayerwiseSteps : public ::testing::TestWithParam<int> {};

TEST_P(LayerwiseSteps, StepEqualsGlobalNormThenAdamW) {
  const size_t micro_batches = static_cast<size_t>(GetParam());
  const Qwen3MoeConfig c = testing::tiny_moe_config(50, 3);
  Qwen3MoeModel layered(c, DType::F64), plain(c, DType::F64);
  layered.init_weights(3);
  plain.init_weights(3);
  AdamW opt_l(layered.parameters(), {}), opt_p(plain.parameters(), {});
  layered.set_expert_wgrad_group(2);
  LayerwiseOptimizer lw(layered, opt_l, LayerwiseConfig{});
  LocalDispatcher d;
  for (int step = 0; step < 3; ++step) {
    std::vector<Batch> bs;
    for (size_t i = 0; i < micro_batches; ++i) bs.push_back(testing::random_batch(2, 6, 50, 100 + 10 * step + 5 * i));
    const StepResult r = train_step(layered, d, lw, bs, 1e-2, 0.5);
    // the plain step: micro-batches accumulated, one global norm, AdamW over the list
    int64_t targets = 0;
    for (const Batch& b : bs) targets += b.num_targets;
    for (size_t i = 0; i < bs.size(); ++i) {
      plain.forward_backward(bs[i], d, 1.0 / static_cast<double>(targets), 1.0 / static_cast<double>(bs.size()),
                             i > 0);
    }
    const GradNorm g = global_grad_norm(plain.parameters(), 0.5);
    opt_p.step(plain.parameters(), 1e-2, g.clip_scale);
    EXPECT_NEAR(r.grad_norm, g.norm, 1e-12 * g.norm) << "step " << step;
    EXPECT_LT(g.clip_scale, 1.0);  // the clip is exercised
  }
  EXPECT_EQ(opt_l.steps_taken(), 3);
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    EXPECT_LT(testing::rel_error(layered.parameters()[i].value, plain.parameters()[i].value), 1e-12)
        << plain.parameters()[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(MicroBatches, LayerwiseSteps, ::testing::Values(1, 2, 3));

}  // namespace
}  // namespace moetrain
