// One Qwen3-MoE training micro-step on the GPU (bf16 compute, f32 gradients) against the
// same step on the CPU (f32), from the same bf16 weights. Skips without a GPU.
//
// Top-k routing is discontinuous: where two experts' router logits are closer than bf16's
// rounding, the GPU may pick the other one, and that expert's gradient then differs by a
// whole token's contribution. So the strict check (every gradient within bf16 tolerance)
// routes every token to every expert (top-k = E), which exercises the same router, permute,
// grouped-GEMM and combine kernels with a continuous routing; the top-k check then bounds
// the loss and the share of tokens whose routing changed.
//
// Norm gains (1-D) get a looser bound than matrices: each gain's gradient is one sum over
// every token of terms of both signs, so bf16 noise in the terms shows up relative to a
// sum that is much smaller than the terms (observed 1.8e-2 to 2.1e-2 on k_norm). In the
// top-k check, a MoE layer's router and the norm in front of it see each flipped token's
// whole contribution (observed up to 0.11 with 4 of 768 assignments moved): they are
// bounded loosely, everything else as before. The GPU step starts from NaN
// gradients and overwrites them (a step's first micro-batch), the CPU step adds to zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/cuda_runtime.h"
#include "engine/models/qwen3_moe.h"
#include "engine/optim/layerwise.h"
#include "engine/trainer.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

Qwen3MoeConfig step_config(int64_t experts, int64_t top_k, int64_t head_dim = 64) {
  return testing::cuda_moe_config(experts, top_k, head_dim);
}

Batch on_gpu(Batch b) {
  b.inputs = b.inputs.to(Device::cuda(0));
  b.targets = b.targets.to(Device::cuda(0));
  b.positions = b.positions.to(Device::cuda(0));
  return b;
}

bool is_norm_gain(const std::string& name) { return name.find("norm.weight") != std::string::npos; }
// Parameters that see a routing flip directly: the router of a MoE layer and the RMSNorm
// gain in front of it (layer 0 is dense in step_config).
bool at_routing_edge(const std::string& name) {
  return name.rfind("model.layers.0.", 0) != 0 &&
         (name.find(".mlp.gate.weight") != std::string::npos ||
          name.find(".post_attention_layernorm.weight") != std::string::npos);
}

struct StepPair {
  MicroBatchLoss cpu, gpu;
  std::vector<std::string> names;
  std::vector<double> grad_errors;  // GPU vs CPU, per parameter
};

StepPair run_both(const Qwen3MoeConfig& c, bool fp8 = false) {
  Qwen3MoeModel gpu(c, DType::BF16, Device::cuda(0));
  gpu.init_weights(5);
  Qwen3MoeModel cpu(c, DType::F32);
  gpu.set_fp8(fp8);
  cpu.set_fp8(fp8);
  for (size_t i = 0; i < cpu.parameters().size(); ++i) {  // the bf16 weights the GPU computes with
    cpu.parameters()[i].value.copy_from(gpu.parameters()[i].value.to(Device::cpu()));
  }
  const int64_t B = 2, S = 96;
  Batch b;
  b.batch = B;
  b.seq = S;
  b.inputs = testing::random_ints({B * S}, 0, static_cast<int32_t>(c.vocab_size), 77);
  b.targets = testing::random_ints({B * S}, 0, static_cast<int32_t>(c.vocab_size), 78);
  std::vector<int32_t> pos(B * S);
  for (int64_t i = 0; i < B * S; ++i) pos[i] = static_cast<int32_t>(i % S);
  b.positions = Tensor::from_vector(pos, {B * S});
  b.num_targets = B * S;
  const Batch bg = on_gpu(b);

  LocalDispatcher d;
  zero_grads(cpu.parameters());
  for (auto& p : gpu.parameters()) p.grad.fill_(NAN);  // the GPU step overwrites (first micro-batch)
  StepPair r;
  r.cpu = cpu.forward_backward(b, d, 1.0 / (B * S), 1.0);
  r.gpu = gpu.forward_backward(bg, d, 1.0 / (B * S), 1.0, /*accumulate_grads=*/false);
  std::printf("E=%lld k=%lld: loss cpu %.6f gpu %.6f | aux cpu %.6f gpu %.6f\n",
              static_cast<long long>(c.num_experts), static_cast<long long>(c.num_experts_per_tok),
              r.cpu.ce_sum / (B * S), r.gpu.ce_sum / (B * S), r.cpu.term("aux_loss"), r.gpu.term("aux_loss"));
  for (size_t i = 0; i < cpu.parameters().size(); ++i) {
    r.names.push_back(cpu.parameters()[i].name);
    r.grad_errors.push_back(testing::rel_error(gpu.parameters()[i].grad.to(Device::cpu()), cpu.parameters()[i].grad));
  }
  return r;
}

// head_dim 64 and 128: the q/k norms with RoPE as two kernels, and as one (ops.h).
TEST(Qwen3MoeCuda, TrainingStepMatchesCpuEveryGradient) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  for (int64_t head_dim : {64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    StepPair r = run_both(step_config(/*experts=*/4, /*top_k=*/4, head_dim));
    EXPECT_NEAR(r.gpu.ce_sum / r.cpu.ce_sum, 1.0, 1e-2);
    EXPECT_NEAR(r.gpu.term("aux_loss") / r.cpu.term("aux_loss"), 1.0, 1e-2);
    EXPECT_NEAR(r.gpu.term("z_loss") / r.cpu.term("z_loss"), 1.0, 2e-2);
    EXPECT_EQ(r.gpu.expert_counts, r.cpu.expert_counts);
    double worst = 0;
    for (size_t i = 0; i < r.names.size(); ++i) {
      worst = std::max(worst, r.grad_errors[i]);
      EXPECT_LT(r.grad_errors[i], is_norm_gain(r.names[i]) ? 4e-2 : 2e-2) << r.names[i];
    }
    std::printf("GPU vs CPU gradients (head_dim %lld): worst relative error %.3e over %zu parameters\n",
                static_cast<long long>(head_dim), worst, r.names.size());
  }
}

// [training].fp8: the projections in block-scaled FP8 on both (cuBLASLt's GEMM on the GPU,
// the f32 product of the dequantized operands on the CPU). The GPU quantizes bf16
// activations, the CPU f32 ones, so some e4m3 codes differ by a step (6% of that element),
// and every FP8 input gradient passes its error down: looser bounds than the BF16 step's
// (H200: median 5.6e-2, worst 1.1e-1; FP8 against the CPU's f32 step alone: median 1.2e-1).
TEST(Qwen3MoeCuda, Fp8ProjectionsStepMatchesTheCpusFp8Step) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  // Experts 64 wide stay BF16; 128 wide run the FP8 grouped forward (the wgmma kernels
  // against the CPU's dequantized products), as the dense layer 0 (256) does in both.
  for (int64_t moe_width : {64, 128}) {
    SCOPED_TRACE(moe_width);
    Qwen3MoeConfig c = step_config(/*experts=*/4, /*top_k=*/4, 128);
    c.moe_intermediate_size = moe_width;
    StepPair r = run_both(c, /*fp8=*/true);
    EXPECT_NEAR(r.gpu.ce_sum / r.cpu.ce_sum, 1.0, 1e-2);
    std::vector<double> e = r.grad_errors;
    for (size_t i = 0; i < r.names.size(); ++i) EXPECT_LT(r.grad_errors[i], 0.25) << r.names[i];
    std::sort(e.begin(), e.end());
    EXPECT_LT(e[e.size() / 2], 0.1);
    std::printf("FP8 GPU vs CPU gradients (experts %lld wide): median %.3e worst %.3e over %zu parameters\n",
                static_cast<long long>(moe_width), e[e.size() / 2], e.back(), e.size());
  }
}

TEST(Qwen3MoeCuda, TopKStepMatchesCpuUpToRoutingFlips) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  StepPair r = run_both(step_config(/*experts=*/8, /*top_k=*/2));
  EXPECT_NEAR(r.gpu.ce_sum / r.cpu.ce_sum, 1.0, 1e-2);
  EXPECT_NEAR(r.gpu.term("aux_loss") / r.cpu.term("aux_loss"), 1.0, 2e-2);
  ASSERT_EQ(r.gpu.expert_counts.size(), r.cpu.expert_counts.size());
  int64_t moved = 0, total = 0;
  for (size_t l = 0; l < r.cpu.expert_counts.size(); ++l) {
    for (size_t e = 0; e < r.cpu.expert_counts[l].size(); ++e) {
      moved += std::abs(r.gpu.expert_counts[l][e] - r.cpu.expert_counts[l][e]);
      total += r.cpu.expert_counts[l][e];
    }
  }
  std::printf("routing: %lld of %lld assignments moved\n", static_cast<long long>(moved / 2),
              static_cast<long long>(total));
  EXPECT_LE(moved / 2, total / 50) << "more than 2% of the top-k assignments changed between CPU and GPU";
  double worst_dense = 0, worst_edge = 0;
  for (size_t i = 0; i < r.names.size(); ++i) {
    if (r.names[i].find(".experts.") != std::string::npos) continue;  // flips move whole tokens
    if (at_routing_edge(r.names[i])) {
      worst_edge = std::max(worst_edge, r.grad_errors[i]);
      EXPECT_LT(r.grad_errors[i], 0.25) << r.names[i];
      continue;
    }
    worst_dense = std::max(worst_dense, r.grad_errors[i]);
    EXPECT_LT(r.grad_errors[i], is_norm_gain(r.names[i]) ? 8e-2 : 5e-2) << r.names[i];
  }
  std::printf("GPU vs CPU non-expert gradients: worst relative error %.3e (router and its norm: %.3e)\n",
              worst_dense, worst_edge);
}

// A micro-batch's forward and backward queue without the host waiting for the device: the
// loss terms (cross-entropy, load-balancing and z-loss sums) and expert counts stay on the
// GPU until the backward is queued and are then read in one wait (a wait per layer would
// drain the launch queue each time).
TEST(Qwen3MoeCuda, MicroBatchWaitsForTheDeviceOnce) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const Qwen3MoeConfig c = step_config(/*experts=*/8, /*top_k=*/2);
  Qwen3MoeModel m(c, DType::BF16, Device::cuda(0));
  m.init_weights(3);
  LocalDispatcher d;
  const Batch b = on_gpu(testing::random_batch(2, 128, 300, 7));
  const MicroBatchLoss first = m.forward_backward(b, d, 1.0 / 256, 1.0, false);  // one-time set-up waits
  const int64_t before = cuda::host_waits();
  const MicroBatchLoss l = m.forward_backward(b, d, 1.0 / 256, 1.0, false);
  EXPECT_EQ(cuda::host_waits() - before, 1);
  // What was read is the pass's: the same weights and tokens give the same terms.
  EXPECT_EQ(l.ce_sum, first.ce_sum);
  EXPECT_EQ(l.term("aux_loss"), first.term("aux_loss"));
  EXPECT_GT(l.term("aux_loss"), 0);
  EXPECT_EQ(l.term("z_loss"), first.term("z_loss"));
  EXPECT_GT(l.term("z_loss"), 0);
  EXPECT_EQ(l.expert_counts, first.expert_counts);
  ASSERT_EQ(l.expert_counts.size(), 2u);  // layers 1 and 2 (layer 0 is dense)
  for (const auto& layer : l.expert_counts) {
    int64_t sum = 0;
    for (int64_t n : layer) sum += n;
    EXPECT_EQ(sum, 2 * 128 * 2);  // every token's top-2
  }
}

// The optimizer on its own stream (norm parts under the backward, updates under the next
// forward) gives the same steps as the same optimizer in line, bit for bit: loss, norm,
// every master, bf16 weight and moment. Clipping is on, one step has two micro-batches,
// a validation forward runs between steps (it too must wait for the updates), and the
// moments are bf16 (stochastic rounding keyed by element, not by launch). A missing wait
// would read a half-updated weight and show up as a difference.
TEST(Qwen3MoeCuda, OverlappedOptimizerEqualsInLine) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const Qwen3MoeConfig c = step_config(/*experts=*/8, /*top_k=*/2);
  Qwen3MoeModel over(c, DType::BF16, Device::cuda(0)), line(c, DType::BF16, Device::cuda(0));
  over.init_weights(9);
  line.init_weights(9);
  const AdamWConfig ac{0.9, 0.95, 1e-8, 0.1, /*bf16_moments=*/true};
  AdamW opt_o(over.parameters(), ac), opt_l(line.parameters(), ac);
  // Later layers' updates on 7 multiprocessors (the capped sweep): the same bits as well.
  LayerwiseOptimizer lo(over, opt_o, LayerwiseConfig{.overlap = true, .update_sms = 7});
  LayerwiseOptimizer ll(line, opt_l, LayerwiseConfig{.overlap = false});
  ASSERT_TRUE(lo.overlapping());
  ASSERT_FALSE(ll.overlapping());
  LocalDispatcher d;
  for (int step = 0; step < 4; ++step) {
    std::vector<Batch> bs{on_gpu(testing::random_batch(2, 128, 300, 40 + 10 * step))};
    if (step == 1) bs.push_back(on_gpu(testing::random_batch(2, 128, 300, 45 + 10 * step)));
    const StepResult ro = train_step(over, d, lo, bs, 1e-3, 1.0);
    const StepResult rl = train_step(line, d, ll, bs, 1e-3, 1.0);
    EXPECT_EQ(ro.loss, rl.loss) << "step " << step;
    EXPECT_EQ(ro.grad_norm, rl.grad_norm) << "step " << step;
    // One micro-batch: the experts' share came from the weight-gradient kernels; a pass
    // over the same gradients agrees.
    const double pass = global_grad_norm(line.parameters(), 0.0).norm;
    EXPECT_NEAR(rl.grad_norm, pass, 1e-12 * pass) << "step " << step;
    if (step == 2) {  // a validation pass while the updates may still run
      const Batch v = on_gpu(testing::random_batch(1, 128, 300, 99));
      EXPECT_EQ(over.forward_loss(v, d).ce_sum, line.forward_loss(v, d).ce_sum);
    }
  }
  lo.drain();
  cuda::device_synchronize();
  for (size_t i = 0; i < over.parameters().size(); ++i) {
    const Parameter &a = over.parameters()[i], &b = line.parameters()[i];
    EXPECT_TRUE(testing::bytes_equal(a.master_low.to(Device::cpu()), b.master_low.to(Device::cpu()))) << a.name;
    EXPECT_TRUE(testing::bytes_equal(a.value.to(Device::cpu()), b.value.to(Device::cpu()))) << a.name;
    EXPECT_TRUE(testing::bytes_equal(opt_o.exp_avg()[i].to(Device::cpu()), opt_l.exp_avg()[i].to(Device::cpu())))
        << a.name;
    EXPECT_TRUE(testing::bytes_equal(opt_o.exp_avg_sq()[i].to(Device::cpu()), opt_l.exp_avg_sq()[i].to(Device::cpu())))
        << a.name;
  }
}

// Micro-batches in groups on the GPU (the Hopper group kernel where it runs): every gradient
// as with the micro-batches in turn up to f32 summation order, and the norm of a step whose
// group writes the experts' gradients (their sum of squares from the group's pass) equal to a
// pass over the gradients.
TEST(Qwen3MoeCuda, GroupedExpertWeightGradientsMatchMicroBatchesInTurn) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const Qwen3MoeConfig c = step_config(/*experts=*/8, /*top_k=*/2);
  LocalDispatcher d;
  for (int n : {2, 3}) {
    Qwen3MoeModel grouped(c, DType::BF16, Device::cuda(0)), in_turn(c, DType::BF16, Device::cuda(0));
    grouped.init_weights(5);
    in_turn.init_weights(5);
    for (int i = 0; i < n; ++i) {
      const Batch b = on_gpu(testing::random_batch(2, 128, 300, 70 + i));
      const bool defer = (i + 1) % 2 != 0 && i + 1 < n;
      grouped.forward_backward(b, d, 1.0 / 512.0, 1.0 / n, i > 0, defer);
      in_turn.forward_backward(b, d, 1.0 / 512.0, 1.0 / n, i > 0);
    }
    double worst = 0;
    for (size_t i = 0; i < grouped.parameters().size(); ++i) {
      const double err = testing::rel_error(grouped.parameters()[i].grad.to(Device::cpu()),
                                            in_turn.parameters()[i].grad.to(Device::cpu()));
      worst = std::max(worst, err);
      EXPECT_LT(err, 1e-5) << n << " micro-batches: " << grouped.parameters()[i].name;
    }
    std::printf("grouped expert weight gradients, %d micro-batches: worst relative difference %.3e\n", n, worst);
  }
  Qwen3MoeModel model(c, DType::BF16, Device::cuda(0));
  model.init_weights(6);
  model.set_expert_wgrad_group(2);
  AdamW opt(model.parameters(), AdamWConfig{});
  LayerwiseOptimizer lw(model, opt, LayerwiseConfig{.overlap = false});
  const std::vector<Batch> bs{on_gpu(testing::random_batch(2, 128, 300, 80)),
                              on_gpu(testing::random_batch(2, 128, 300, 81))};
  const StepResult r = train_step(model, d, lw, bs, 1e-3, 1.0);
  const double pass = global_grad_norm(model.parameters(), 0.0).norm;
  EXPECT_NEAR(r.grad_norm, pass, 1e-12 * pass) << "the group's sum of squares";
}

// Recomputation on the GPU (docs/memory.md): full and selective give the gradients of no
// recomputation bit for bit (the same kernels in the same order: cuBLASLt picks the same
// algorithm for the same shapes, the attention and grouped kernels are deterministic), over two
// micro-batches, the first's expert weight gradients deferred; the recomputed run's kept
// activations are smaller (the device's live bytes after a training forward).
TEST(Qwen3MoeCuda, RecomputationGivesTheSameBits) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const Qwen3MoeConfig c = step_config(/*experts=*/8, /*top_k=*/2);
  LocalDispatcher d;
  const std::vector<Batch> bs{on_gpu(testing::random_batch(2, 128, 300, 90)),
                              on_gpu(testing::random_batch(2, 128, 300, 91))};
  Qwen3MoeModel plain(c, DType::BF16, Device::cuda(0));
  plain.init_weights(9);
  plain.set_expert_wgrad_group(2);
  for (size_t i = 0; i < bs.size(); ++i) plain.forward_backward(bs[i], d, 1.0 / 512.0, 0.5, i > 0, i == 0);
  // Copied now: the memory measurement below runs more passes through `plain`.
  std::vector<Tensor> plain_grads;
  for (const auto& p : plain.parameters()) plain_grads.push_back(p.grad.to(Device::cpu()));
  for (RecomputeMode mode : {RecomputeMode::kSelective, RecomputeMode::kFull}) {
    SCOPED_TRACE(mode == RecomputeMode::kFull ? "full" : "selective");
    Qwen3MoeModel re(c, DType::BF16, Device::cuda(0));
    re.init_weights(9);
    re.set_expert_wgrad_group(2);
    re.set_recompute({0, 1, 2}, mode);
    for (size_t i = 0; i < bs.size(); ++i) re.forward_backward(bs[i], d, 1.0 / 512.0, 0.5, i > 0, i == 0);
    for (size_t i = 0; i < plain.parameters().size(); ++i) {
      EXPECT_TRUE(testing::bytes_equal(re.parameters()[i].grad.to(Device::cpu()), plain_grads[i]))
          << plain.parameters()[i].name;
    }
    // What a training forward keeps, against no recomputation.
    auto kept = [&](Qwen3MoeModel& m) {
      ChunkActivations a;
      RouterTotals totals = m.new_totals();
      MicroBatchLoss loss;
      const int64_t before = cuda::device_memory_stats().live_bytes;
      m.forward_chunk(m.whole(), bs[0], Tensor(), d, a, totals, ChunkPass{true, 1.0 / 512.0, 1.0, false}, &loss);
      const int64_t bytes = cuda::device_memory_stats().live_bytes - before;
      m.backward_chunk(m.whole(), bs[0], Tensor(), d, a, 1.0, true, false);
      return bytes;
    };
    const int64_t with = kept(re), without = kept(plain);
    std::printf("kept by a training forward: %.2f MB without recomputation, %.2f MB with\n", without / 1e6, with / 1e6);
    EXPECT_LT(with, without);
  }
}

}  // namespace
}  // namespace moetrain
