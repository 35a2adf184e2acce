#include <gtest/gtest.h>

#include <cmath>

#include "engine/optim/adamw.h"
#include "engine/optim/lr_schedule.h"

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

}  // namespace
}  // namespace moetrain
