// Projections in FP8 ([training].fp8, docs/fp8.md): each product against its BF16 (here f32)
// version, within e4m3's error and not equal to it (the FP8 path ran); and a whole training
// micro-batch of both families with their projections in FP8 against the same without:
// the loss within 1%, every gradient within 30% relative and half of them within 15% (e4m3
// has 3 mantissa bits, and every FP8 input gradient adds its error to what flows below it:
// measured, Qwen3's tiny model median 11.6%, DeepSeek-V3's 1.3%; a transposed or misplaced
// operand errs by 100% and more). Every
// token takes every expert (top-k = E), as in the GPU-against-CPU checks: a top-k choice
// that flips moves its experts' gradients by far more than the arithmetic does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "engine/models/deepseek_v3.h"
#include "engine/optim/adamw.h"
#include "engine/optim/layerwise.h"
#include "engine/models/projections.h"
#include "engine/models/qwen3_moe.h"
#include "engine/trainer.h"
#include "model_batches.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

TEST(Projections, Fp8ProductsMatchTheHighPrecisionOnesWithinE4m3Error) {
  Projections fp8;
  fp8.set_fp8(true);
  const Projections& plain = bf16_projections();
  const Tensor x = testing::random_tensor({40, 200}, DType::F32, 1);
  const Tensor w = testing::random_tensor({136, 200}, DType::F32, 2, 0.1);
  const Tensor dy = testing::random_tensor({40, 136}, DType::F32, 3);
  const Tensor res = testing::random_tensor({40, 136}, DType::F32, 4);
  auto close = [](const Tensor& got, const Tensor& want, const char* what) {
    const double e = testing::rel_error(got, want);
    EXPECT_LT(e, 0.05) << what;
    EXPECT_GT(e, 1e-4) << what << ": the FP8 path did not run";
  };
  close(fp8.forward(x, w), plain.forward(x, w), "forward");
  close(fp8.forward(x, w, res), plain.forward(x, w, res), "forward + residual");
  close(fp8.backward_input(dy, w), plain.backward_input(dy, w), "backward_input");
  Tensor add1 = testing::random_tensor({40, 200}, DType::F32, 5), add2 = add1.clone();
  fp8.backward_input_add(dy, w, add1);
  plain.backward_input_add(dy, w, add2);
  close(add1, add2, "backward_input_add");
  Tensor g1 = testing::random_tensor({136, 200}, DType::F32, 6), g2 = g1.clone();
  fp8.backward_weight(dy, x, g1, /*accumulate=*/false);
  plain.backward_weight(dy, x, g2, false);
  close(g1, g2, "backward_weight");
  fp8.backward_weight(dy, x, g1, /*accumulate=*/true);
  plain.backward_weight(dy, x, g2, true);
  close(g1, g2, "backward_weight, accumulated");
}

// The experts' SwiGLU forward under FP8: from e4m3 operands where both widths are multiples
// of 128 (within e4m3's error of the plain one, and not equal to it), the plain op otherwise
// (bitwise); the three weights kept once each.
// The experts' input gradient follows the forward: FP8 where the widths are whole blocks
// (each expert's W^T blocks kept beside W's, the same bits as made afresh), the BF16 op bit
// for bit elsewhere.
TEST(Projections, ExpertsInputGradientIsFp8WhereTheWidthsAreWholeBlocks) {
  Projections fp8;
  fp8.set_fp8(true);
  const Projections& plain = bf16_projections();
  const Tensor counts = Tensor::from_vector(std::vector<int64_t>{70, 0, 131}, {3});
  for (int64_t I : {128, 64}) {
    SCOPED_TRACE(I);
    const Tensor dy = testing::random_tensor({201, 128}, DType::F32, 5);
    const Tensor gate = testing::random_tensor({201, I}, DType::F32, 6), up = testing::random_tensor({201, I}, DType::F32, 7);
    const Tensor wg = testing::random_tensor({3, I, 128}, DType::F32, 2, 0.1);
    const Tensor wu = testing::random_tensor({3, I, 128}, DType::F32, 3, 0.1);
    const Tensor wd = testing::random_tensor({3, 128, I}, DType::F32, 4, 0.1);
    const ops::SwigluInputGrads fresh = fp8.experts_backward_input(dy, counts, gate, up, wg, wu, wd);
    fp8.keep_weights(true);
    const ops::SwigluInputGrads got = fp8.experts_backward_input(dy, counts, gate, up, wg, wu, wd);
    const ops::SwigluInputGrads again = fp8.experts_backward_input(dy, counts, gate, up, wg, wu, wd);
    EXPECT_EQ(fp8.kept_weights(), I == 128 ? 3u : 0u);
    fp8.keep_weights(false);
    const ops::SwigluInputGrads want = plain.experts_backward_input(dy, counts, gate, up, wg, wu, wd);
    for (auto [a, b, what] : {std::tuple{&got.dgate, &want.dgate, "dgate"}, {&got.dup, &want.dup, "dup"},
                              {&got.dx, &want.dx, "dx"}}) {
      const double e = testing::rel_error(*a, *b);
      if (I == 128) {
        EXPECT_LT(e, 0.1) << what;
        EXPECT_GT(e, 1e-4) << what << ": the FP8 path did not run";
      } else {
        EXPECT_EQ(e, 0.0) << what << ": widths of 64 stay BF16";
      }
    }
    EXPECT_EQ(testing::rel_error(got.dx, fresh.dx), 0.0) << "kept W^T blocks differ from fresh ones";
    EXPECT_EQ(testing::rel_error(again.dx, got.dx), 0.0);
  }
}

TEST(Projections, ExpertsForwardIsFp8WhereTheWidthsAreWholeBlocks) {
  Projections fp8;
  fp8.set_fp8(true);
  const Projections& plain = bf16_projections();
  const Tensor counts = Tensor::from_vector(std::vector<int64_t>{70, 0, 131}, {3});
  for (int64_t I : {128, 64}) {
    SCOPED_TRACE(I);
    const Tensor x = testing::random_tensor({201, 128}, DType::F32, 1);
    const Tensor wg = testing::random_tensor({3, I, 128}, DType::F32, 2, 0.1);
    const Tensor wu = testing::random_tensor({3, I, 128}, DType::F32, 3, 0.1);
    const Tensor wd = testing::random_tensor({3, 128, I}, DType::F32, 4, 0.1);
    fp8.keep_weights(true);
    const ops::SwigluOut got = fp8.experts_forward(x, counts, wg, wu, wd);
    const ops::SwigluOut want = plain.experts_forward(x, counts, wg, wu, wd);
    EXPECT_EQ(fp8.kept_weights(), I == 128 ? 3u : 0u);
    fp8.keep_weights(false);
    for (auto [a, b, what] : {std::tuple{&got.gate, &want.gate, "gate"}, {&got.act, &want.act, "act"},
                              {&got.y, &want.y, "y"}}) {
      const double e = testing::rel_error(*a, *b);
      if (I == 128) {
        EXPECT_LT(e, 0.1) << what;  // measured 3-6% (act and y carry two and three roundings to e4m3)
        EXPECT_GT(e, 1e-4) << what << ": the FP8 path did not run";
      } else {
        EXPECT_EQ(e, 0.0) << what << ": widths of 64 stay BF16";
      }
    }
  }
}

// Kept weights: quantized at the first use, then taken as they are (so a weight changed while
// kept is not seen: the caller's promise is what makes that right), keyed by where the elements
// start and the shape (two row blocks of one tensor, one starting where the tensor does, are
// two weights), forgotten when released.
TEST(Projections, KeptWeightsAreQuantizedOnceUntilReleased) {
  Projections kept, fresh;
  kept.set_fp8(true);
  fresh.set_fp8(true);
  const Tensor x = testing::random_tensor({40, 200}, DType::F32, 1);
  const Tensor dy = testing::random_tensor({40, 136}, DType::F32, 3);
  Tensor w = testing::random_tensor({136, 200}, DType::F32, 2, 0.1);
  const Tensor top = w.slice(0, 64), bottom = w.slice(64, 136);
  auto same = [](const Tensor& a, const Tensor& b) { return testing::rel_error(a, b) == 0.0; };
  kept.keep_weights(true);
  EXPECT_TRUE(same(kept.forward(x, w), fresh.forward(x, w)));
  EXPECT_TRUE(same(kept.forward(x, top), fresh.forward(x, top)));
  EXPECT_TRUE(same(kept.forward(x, bottom), fresh.forward(x, bottom)));
  EXPECT_EQ(kept.kept_weights(), 3u);
  EXPECT_TRUE(same(kept.backward_input(dy, w), fresh.backward_input(dy, w)));  // W^T's blocks, same entry
  EXPECT_TRUE(same(kept.backward_input(dy, w), fresh.backward_input(dy, w)));
  EXPECT_EQ(kept.kept_weights(), 3u);
  const Tensor before = kept.forward(x, w), before_t = kept.backward_input(dy, w);
  ops::scale_(w, 2.0);  // changed while kept: the kept blocks are used
  EXPECT_TRUE(same(kept.forward(x, w), before));
  EXPECT_TRUE(same(kept.backward_input(dy, w), before_t));
  EXPECT_FALSE(same(fresh.forward(x, w), before));
  kept.keep_weights(false);
  EXPECT_EQ(kept.kept_weights(), 0u);
  EXPECT_TRUE(same(kept.forward(x, w), fresh.forward(x, w)));
  EXPECT_TRUE(same(kept.backward_input(dy, w), fresh.backward_input(dy, w)));
  EXPECT_EQ(kept.kept_weights(), 0u);  // not kept: quantized on every use
  // An input prepared once for several products equals one prepared for each.
  const Projections::Input rows = fresh.rows(x);
  EXPECT_TRUE(same(fresh.forward(rows, top), fresh.forward(x, top)));
  Tensor g1 = testing::random_tensor({136, 200}, DType::F32, 6), g2 = g1.clone();
  fresh.backward_weight(dy, fresh.tokens(x), g1, false);
  fresh.backward_weight(dy, x, g2, false);
  EXPECT_TRUE(same(g1, g2));
  EXPECT_THROW(fresh.forward(fresh.tokens(x), w), Error);  // quantized along the wrong dimension
  EXPECT_THROW(fresh.backward_weight(dy, rows, g1, false), Error);
}

// Under keep_weights, an output gradient's codes along the tokens are made in the same pass as
// its codes along the features (by the input gradient) and taken once by the weight gradient
// of the same dy: a dy changed in place between the two is not seen (the codes are used),
// nor by a second weight gradient of it (quantized again, it sees the change); a dy met first
// by the weight gradient is quantized then; an entry whose dy nobody else holds is dropped at
// the next input gradient, at most 16 wait (the oldest go), keep_weights(false) drops them
// all. A projection's input is not held (its forward's codes are along the features only),
// nor a dy that is a view of part of a buffer.
TEST(Projections, OutputGradientCodesAreMadeOnceForBothProducts) {
  Projections kept, fresh;
  kept.set_fp8(true);
  fresh.set_fp8(true);
  const Tensor x = testing::random_tensor({48, 256}, DType::F32, 11);
  const Tensor w = testing::random_tensor({128, 256}, DType::F32, 12, 0.1);
  Tensor dy = testing::random_tensor({48, 128}, DType::F32, 13);
  auto same = [](const Tensor& a, const Tensor& b) { return testing::rel_error(a, b) == 0.0; };
  auto wgrad = [&](const Projections& p, const Tensor& d) {
    Tensor g = Tensor::zeros({128, 256}, DType::F32);
    p.backward_weight(d, x, g, /*accumulate=*/false);
    return g;
  };
  kept.keep_weights(true);
  EXPECT_TRUE(same(kept.forward(x, w), fresh.forward(x, w)));
  EXPECT_EQ(kept.pending_grads(), 0u);  // inputs are not held
  kept.backward_input(testing::random_tensor({96, 128}, DType::F32, 15).slice(0, 48), w);
  EXPECT_EQ(kept.pending_grads(), 0u);  // nor a view of part of a buffer (a slice under tensor parallelism)
  EXPECT_TRUE(same(kept.backward_input(dy, w), fresh.backward_input(dy, w)));
  EXPECT_EQ(kept.pending_grads(), 1u);
  const Tensor before = wgrad(fresh, dy);
  ops::scale_(dy, 2.0);  // changed after its codes were made: the weight gradient uses those codes
  EXPECT_TRUE(same(wgrad(kept, dy), before));
  EXPECT_EQ(kept.pending_grads(), 0u);  // taken
  EXPECT_FALSE(same(wgrad(fresh, dy), before));
  EXPECT_TRUE(same(wgrad(kept, dy), wgrad(fresh, dy)));  // a second weight gradient quantizes again
  const Tensor other = testing::random_tensor({48, 128}, DType::F32, 14);  // no input gradient first
  EXPECT_TRUE(same(wgrad(kept, other), wgrad(fresh, other)));
  Tensor dx = Tensor::zeros({48, 256}, DType::F32);
  kept.backward_input_add(dy, w, dx);
  dy = Tensor();  // nobody else holds it now: its entry goes at the next input gradient
  kept.backward_input_add(other, w, dx);
  EXPECT_EQ(kept.pending_grads(), 1u);  // other's
  std::vector<Tensor> held;
  for (int i = 0; i < 20; ++i) {  // never taken, still held: at most 16 wait
    held.push_back(testing::random_tensor({48, 128}, DType::F32, 20 + i));
    kept.backward_input_add(held.back(), w, dx);
  }
  EXPECT_EQ(kept.pending_grads(), 16u);
  EXPECT_TRUE(same(wgrad(kept, held.back()), wgrad(fresh, held.back())));  // the newest still waits
  EXPECT_EQ(kept.pending_grads(), 15u);
  kept.keep_weights(false);
  EXPECT_EQ(kept.pending_grads(), 0u);
  kept.backward_input(other, w);
  EXPECT_EQ(kept.pending_grads(), 0u);  // not kept: nothing waits
}

template <typename Model, typename Config>
void expect_fp8_step_close(const Config& c, const char* family) {
  SCOPED_TRACE(family);
  Model bf16(c, DType::F32), fp8(c, DType::F32);
  bf16.init_weights(5);
  fp8.init_weights(5);
  fp8.set_fp8(true);
  LocalDispatcher d;
  const Batch b = testing::random_batch(2, 64, static_cast<int32_t>(c.vocab_size), 17);
  const double scale = 1.0 / static_cast<double>(b.num_targets);
  const MicroBatchLoss l1 = bf16.forward_backward(b, d, scale, 1.0, false);
  const MicroBatchLoss l2 = fp8.forward_backward(b, d, scale, 1.0, false);
  EXPECT_NEAR(l2.ce_sum / l1.ce_sum, 1.0, 1e-2);
  EXPECT_NE(l2.ce_sum, l1.ce_sum) << "FP8 changed nothing";
  std::vector<double> errors;
  for (size_t i = 0; i < bf16.parameters().size(); ++i) {
    const Parameter& p = bf16.parameters()[i];
    errors.push_back(testing::rel_error(fp8.parameters()[i].grad, p.grad));
    EXPECT_LT(errors.back(), 0.3) << p.name;
  }
  std::sort(errors.begin(), errors.end());
  const double median = errors[errors.size() / 2];
  EXPECT_LT(median, 0.15);
  std::printf("FP8 projections, %s: loss %.6f against %.6f, gradient errors median %.3e worst %.3e\n", family,
              l2.ce_sum * scale, l1.ce_sum * scale, median, errors.back());
}

// The tiny configs of both families at FP8 widths (hidden 128: whole tiles), every token
// taking every expert (above), small weights.
Qwen3MoeConfig fp8_qwen3_config() {
  Qwen3MoeConfig q = testing::tiny_moe_config(300);
  q.num_experts_per_tok = q.num_experts;
  q.hidden_size = 128;
  q.head_dim = 32;
  q.initializer_range = 0.05;
  return q;
}
DeepseekV3Config fp8_dsv3_config() {
  DeepseekV3Config v = testing::tiny_dsv3_config(300);
  v.n_group = 1;
  v.topk_group = 1;
  v.num_experts_per_tok = v.n_routed_experts;
  v.hidden_size = 128;
  v.initializer_range = 0.05;
  return v;
}

// train_step keeps the weights quantized for the step's micro-batches and releases them before
// the optimizer moves them: three steps of three micro-batches equal, bit for bit, the same
// steps with every weight quantized at every use (the step written out without train_step).
// Keeping them past the step would use the old weights' blocks in the next one; the output
// gradients' codes held for the weight gradients (Projections::pending_) must be those of the
// same tensors, unchanged: both families (DeepSeek-V3's MLA projections among them).
template <typename Model, typename Config>
void expect_steps_equal_quantizing_at_every_use(const Config& c, const char* family) {
  SCOPED_TRACE(family);
  Model stepped(c, DType::F32), plain(c, DType::F32);
  stepped.init_weights(3);
  plain.init_weights(3);
  stepped.set_fp8(true);
  plain.set_fp8(true);
  AdamW opt_s(stepped.parameters(), {}), opt_p(plain.parameters(), {});
  LayerwiseOptimizer lw_s(stepped, opt_s, LayerwiseConfig{.overlap = false});
  LayerwiseOptimizer lw_p(plain, opt_p, LayerwiseConfig{.overlap = false});
  LocalDispatcher d;
  for (int step = 0; step < 3; ++step) {
    std::vector<Batch> bs;
    for (int i = 0; i < 3; ++i) bs.push_back(testing::random_batch(2, 16, static_cast<int32_t>(c.vocab_size), 100 + 10 * step + i));
    const StepResult r = train_step(stepped, d, lw_s, bs, 2e-2, 1.0);
    int64_t targets = 0;
    for (const Batch& b : bs) targets += b.num_targets;
    double loss = 0;
    for (size_t i = 0; i < bs.size(); ++i) {
      if (i + 1 == bs.size()) lw_p.begin_last_micro_batch();
      loss += plain.forward_backward(bs[i], d, 1.0 / static_cast<double>(targets), 1.0 / 3.0, i > 0).ce_sum;
    }
    const GradNorm g = lw_p.step(2e-2, 1.0);
    EXPECT_EQ(r.loss, loss / static_cast<double>(targets)) << "step " << step;
    EXPECT_EQ(r.grad_norm, g.norm) << "step " << step;
  }
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    EXPECT_EQ(testing::rel_error(stepped.parameters()[i].value, plain.parameters()[i].value), 0.0)
        << plain.parameters()[i].name;
  }
}

TEST(Projections, Fp8StepsEqualQuantizingAtEveryUse) {
  expect_steps_equal_quantizing_at_every_use<Qwen3MoeModel>(testing::tiny_moe_config(100, 2), "qwen3_moe");
  expect_steps_equal_quantizing_at_every_use<DeepseekV3Model>(fp8_dsv3_config(), "deepseek_v3");
}

TEST(Projections, Fp8TrainingStepOfBothFamiliesStaysClose) {
  Qwen3MoeConfig q = fp8_qwen3_config();
  expect_fp8_step_close<Qwen3MoeModel>(q, "qwen3_moe");
  q.moe_intermediate_size = 128;  // the experts in FP8 too
  q.intermediate_size = 128;
  expect_fp8_step_close<Qwen3MoeModel>(q, "qwen3_moe, FP8 experts");
  expect_fp8_step_close<DeepseekV3Model>(fp8_dsv3_config(), "deepseek_v3");
}

// The experts' weight gradients in FP8 (MOETRAIN_FP8_EXPERTS_WGRAD=1: quantized along each
// expert's tokens, ops::grouped_swiglu_backward_weight_fp8) against the same FP8 model with
// them in BF16, over two micro-batches whose first defers its expert weight gradients (the
// kept micro-batch's pass): every SwiGLU weight's gradient (routed, shared and dense) within
// e4m3's error and not equal to the BF16 one, every other gradient bit for bit the same (the
// weight gradients feed nothing else).
template <typename Model, typename Config>
void expect_fp8_wgrad_close(const Config& c, const char* family) {
  SCOPED_TRACE(family);
  Model base(c, DType::F32), fp8(c, DType::F32);
  base.init_weights(6);
  fp8.init_weights(6);
  base.set_fp8(true);
  fp8.set_fp8(true);
  LocalDispatcher d;
  const Batch b1 = testing::random_batch(2, 64, static_cast<int32_t>(c.vocab_size), 18);
  const Batch b2 = testing::random_batch(2, 64, static_cast<int32_t>(c.vocab_size), 19);
  const double scale = 1.0 / static_cast<double>(b1.num_targets + b2.num_targets);
  auto run = [&](Model& m) {
    m.forward_backward(b1, d, scale, 1.0, /*accumulate_grads=*/false, /*defer_expert_weights=*/true);
    m.forward_backward(b2, d, scale, 1.0, /*accumulate_grads=*/true, /*defer_expert_weights=*/false);
  };
  // The switch as the caller left it is restored after (scripts/fp8-check runs this with it on).
  const char* was = std::getenv("MOETRAIN_FP8_EXPERTS_WGRAD");
  const std::string saved = was != nullptr ? was : "";
  ::unsetenv("MOETRAIN_FP8_EXPERTS_WGRAD");
  run(base);
  ::setenv("MOETRAIN_FP8_EXPERTS_WGRAD", "1", 1);
  run(fp8);
  if (was != nullptr) {
    ::setenv("MOETRAIN_FP8_EXPERTS_WGRAD", saved.c_str(), 1);
  } else {
    ::unsetenv("MOETRAIN_FP8_EXPERTS_WGRAD");
  }
  int swiglu = 0;
  double worst = 0;
  for (size_t i = 0; i < base.parameters().size(); ++i) {
    const Parameter& p = base.parameters()[i];
    const std::string& n = p.name;
    const bool is_swiglu = n.find("mlp.") != std::string::npos &&
                           (n.find("gate_proj") != std::string::npos || n.find("up_proj") != std::string::npos ||
                            n.find("down_proj") != std::string::npos);
    const Tensor& g = fp8.parameters()[i].grad;
    if (is_swiglu) {
      ++swiglu;
      const double err = testing::rel_error(g, p.grad);
      worst = std::max(worst, err);
      EXPECT_LT(err, 0.15) << n;
      EXPECT_GT(err, 1e-4) << n << ": the FP8 weight gradient changed nothing";
    } else {
      EXPECT_EQ(g.to_double_vector(), p.grad.to_double_vector()) << n;
    }
  }
  EXPECT_GT(swiglu, 0);
  std::printf("FP8 expert weight gradients, %s: %d SwiGLU weights, worst relative error %.3e\n", family, swiglu,
              worst);
}

TEST(Projections, ExpertWeightGradientsInFp8StayClose) {
  Qwen3MoeConfig q = fp8_qwen3_config();
  q.moe_intermediate_size = 128;
  q.intermediate_size = 128;
  expect_fp8_wgrad_close<Qwen3MoeModel>(q, "qwen3_moe");
  DeepseekV3Config v = fp8_dsv3_config();
  v.moe_intermediate_size = 128;
  v.intermediate_size = 256;
  expect_fp8_wgrad_close<DeepseekV3Model>(v, "deepseek_v3");
}

}  // namespace
}  // namespace moetrain
