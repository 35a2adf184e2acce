// ZeRO-3 weight gathering on two ranks (threads, Gloo): whole weights exist only around a
// layer's use, the next layer's gather starts when a layer is gathered (prefetch, forward and
// backward order), and a sharded forward gives the loss of the unsharded model.
#include <gtest/gtest.h>
#include <unistd.h>

#include "comm/comm_test_util.h"
#include "core/allocator.h"
#include "engine/parallel/fsdp.h"
#include "engine/train_context.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

Qwen3MoeConfig three_layers() {
  Qwen3MoeConfig c;
  c.vocab_size = 17;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.moe_intermediate_size = 6;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  return c;
}

TEST(Fsdp, AutoShardsWeightsOnlyWhenWholeOnesWouldCrowdTheMemory) {
  Qwen3MoeModel small(three_layers(), DType::F32);
  EXPECT_FALSE(choose_shard_weights("auto", small, Device::cpu(), false)) << "a few KB: ZeRO-2";
  EXPECT_TRUE(choose_shard_weights("true", small, Device::cpu(), false));
  EXPECT_FALSE(choose_shard_weights("false", small, Device::cpu(), false));
  EXPECT_FALSE(choose_shard_weights("true", small, Device::cpu(), true)) << "a pipeline keeps weights whole";
  // The same model on a rank with less than 4x its weights and gradients in memory.
  int64_t whole = 0;
  for (const Parameter& p : small.parameters()) whole += 8 * p.value.numel();  // f32 value + f32 gradient
  EXPECT_TRUE(choose_shard_weights("auto", small, Device::cpu(), false, 4 * whole - 4)) << "ZeRO-3";
  EXPECT_FALSE(choose_shard_weights("auto", small, Device::cpu(), false, 4 * whole)) << "ZeRO-2 at the quarter";
}

// ep_overlap "auto": the paired micro-batches keep weights whole, so it is on only on GPUs,
// with two micro-batches or more, where whole weights fit and nobody asked for ZeRO-3.
TEST(Fsdp, AutoEpOverlapOnlyWherePairsCanRunAndWholeWeightsFit) {
  Qwen3MoeModel small(three_layers(), DType::F32);
  int64_t whole = 0;
  for (const Parameter& p : small.parameters()) whole += 8 * p.value.numel();
  RunConfig cfg;
  cfg.training.device = "cuda";
  cfg.training.grad_accum_steps = 2;
  const int64_t roomy = 4 * whole;
  EXPECT_TRUE(choose_ep_overlap(cfg, small, Device::cpu(), roomy));
  EXPECT_FALSE(choose_ep_overlap(cfg, small, Device::cpu(), roomy - 4)) << "whole weights crowd the memory";
  cfg.parallel.shard_weights = "true";
  EXPECT_FALSE(choose_ep_overlap(cfg, small, Device::cpu(), roomy)) << "ZeRO-3 asked for";
  cfg.parallel.shard_weights = "auto";
  cfg.training.grad_accum_steps = 1;
  EXPECT_FALSE(choose_ep_overlap(cfg, small, Device::cpu(), roomy)) << "one micro-batch";
  cfg.training.grad_accum_steps = 2;
  cfg.training.device = "cpu";
  EXPECT_FALSE(choose_ep_overlap(cfg, small, Device::cpu(), roomy)) << "the CPU";
  cfg.parallel.ep_overlap = "true";
  EXPECT_TRUE(choose_ep_overlap(cfg, small, Device::cpu(), roomy)) << "asked for";
  cfg.parallel.ep_overlap = "false";
  cfg.training.device = "cuda";
  EXPECT_FALSE(choose_ep_overlap(cfg, small, Device::cpu(), roomy)) << "turned off";
}

TEST(Fsdp, ShardedWeightsAreGatheredJustInTimeWithTheNextLayerPrefetched) {
  const Qwen3MoeConfig c = three_layers();
  Qwen3MoeModel whole(c, DType::F32);
  whole.init_weights(1);
  LocalDispatcher d;
  const Batch b = testing::random_batch(1, 6, static_cast<int32_t>(c.vocab_size), 5);
  const double expected = whole.forward_loss(b, d).ce_sum;

  testing::run_ranks(2, [&](Communicator& world) {
    Qwen3MoeModel model(c, DType::F32, Device::cpu(), ModelPlacement{1, 0, 2});
    model.init_weights(1);
    FsdpContext fsdp(model, world, world, world, AdamWConfig{}, /*shard_weights=*/true);
    auto resident = [&](int64_t layer) {
      bool all = true, any = false;
      for (ParamBucket& bk : model.buckets()) {
        if (bk.layer != layer) continue;
        all = all && bk.values.memory_resident();
        any = any || bk.values.memory_resident();
      }
      EXPECT_EQ(all, any) << "layer " << layer << " is half gathered";
      return all;
    };
    for (int64_t l = -1; l < 3; ++l) EXPECT_FALSE(resident(l)) << l;
    // Forward: using layer L gathers it and starts L + 1.
    fsdp.before_forward(-1);
    EXPECT_TRUE(resident(-1));
    EXPECT_TRUE(resident(0));
    EXPECT_FALSE(resident(1));
    fsdp.before_forward(0);
    EXPECT_TRUE(resident(1));
    EXPECT_FALSE(resident(2));
    fsdp.after_forward(0, false);
    EXPECT_FALSE(resident(0));
    fsdp.before_forward(1);
    fsdp.after_forward(1, false);
    fsdp.before_forward(2);
    fsdp.after_forward(2, /*backward_follows=*/true);
    EXPECT_TRUE(resident(2));
    // Backward (the head first, as the model does): using layer L starts L - 1.
    fsdp.before_backward(-1);
    fsdp.before_backward(2);
    EXPECT_TRUE(resident(1));
    EXPECT_FALSE(resident(0));
    fsdp.after_backward(2);
    EXPECT_FALSE(resident(2));
    fsdp.before_backward(1);
    EXPECT_TRUE(resident(0));
    fsdp.after_backward(1);
    fsdp.before_backward(0);
    fsdp.after_backward(0);
    fsdp.after_backward(-1);
    for (int64_t l = -1; l < 3; ++l) EXPECT_FALSE(resident(l)) << l;

    // The model drives the hooks itself: the sharded forward is the whole model's.
    const double got = model.forward_loss(b, d).ce_sum;
    EXPECT_NEAR(got, expected, 1e-6 * std::abs(expected));
    for (int64_t l = 0; l < 3; ++l) EXPECT_FALSE(resident(l)) << l;
  });
}

// ZeRO-3's start holds the shards beside one bucket's whole weights at most: the whole
// gradients go before the shards are made and each bucket's whole weights once its shard has
// its copy (it held the whole model's weights and gradients beside every shard: 8 of the f32
// model's bytes a parameter more, which the full Qwen3-30B-A3B under ep8 could not afford).
TEST(Fsdp, ShardedWeightsStartWithoutTheWholeModelBesideTheShards) {
  Qwen3MoeConfig c = three_layers();
  c.vocab_size = 301;
  c.hidden_size = 32;
  c.moe_intermediate_size = 24;
  testing::run_ranks(1, [&](Communicator& world) {
    Qwen3MoeModel model(c, DType::F32, Device::cpu(), ModelPlacement{1, 0, 1});
    model.init_weights(1);
    int64_t whole = 0, largest = 0;
    for (ParamBucket& b : model.buckets()) {
      whole += b.values.nbytes() + b.grads.nbytes();
      largest = std::max<int64_t>(largest, b.values.nbytes());
    }
    const int64_t before = host_memory_stats().live_bytes;
    reset_host_peak();
    FsdpContext fsdp(model, world, world, world, AdamWConfig{}, /*shard_weights=*/true);
    const int64_t after = host_memory_stats().live_bytes, peak = host_memory_stats().peak_bytes;
    EXPECT_LT(after, before + 3 * whole) << "the shards: gradient, scratch, weights and two moments";
    // The peak: the shards and one bucket's whole weights (and a little bookkeeping).
    EXPECT_LE(peak, std::max(before, after + largest) + 64 * 1024)
        << "before " << before << ", after " << after << ", whole weights and gradients " << whole;
  });
}

// The overlap wants a GPU and whole weights: on the CPU, and with sharded weights, the steps
// stay in line.
TEST(Fsdp, OverlapStaysOffOnTheCpuAndWithShardedWeights) {
  const Qwen3MoeConfig c = three_layers();
  testing::run_ranks(2, [&](Communicator& world) {
    for (bool shard : {false, true}) {
      Qwen3MoeModel model(c, DType::F32, Device::cpu(), ModelPlacement{1, 0, 2});
      model.init_weights(1);
      FsdpContext fsdp(model, world, world, world, AdamWConfig{}, shard);
      EXPECT_FALSE(fsdp.set_overlap(true));
      EXPECT_FALSE(fsdp.overlapping());
      EXPECT_EQ(model.weight_hooks() != nullptr, shard) << "hooks only where weights are gathered on use";
    }
  });
}

// On a GPU, FSDP with whole weights and the overlap on (the last backward's reduce-scatters,
// each layer's AdamW and gather on the communication stream, the next forward waiting layer by
// layer) against the same steps in line: the same bits, a validation pass in the middle
// included. One rank (a group of one gathers nothing: the updates and the waits are what run
// on the other stream; two GPUs under NCCL: ParallelCli.TwoGpusMatchOneGpu).
TEST(Fsdp, OverlappedStepsOnAGpuEqualTheStepsInLine) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const Qwen3MoeConfig c = testing::cuda_moe_config(/*experts=*/8, /*top_k=*/2);
  auto on_gpu = [](Batch b) { return b.to(Device::cuda(0)); };
  testing::run_ranks(1, [&](Communicator& world) {
    Qwen3MoeModel over(c, DType::BF16, Device::cuda(0)), line(c, DType::BF16, Device::cuda(0));
    over.init_weights(9);
    line.init_weights(9);
    const AdamWConfig ac{0.9, 0.95, 1e-8, 0.1, /*bf16_moments=*/true};
    FsdpContext fo(over, world, world, world, ac, /*shard_weights=*/false);
    FsdpContext fl(line, world, world, world, ac, /*shard_weights=*/false);
    ASSERT_TRUE(fo.set_overlap(true));
    ASSERT_FALSE(fl.overlapping());
    LocalDispatcher d;
    for (int step = 0; step < 4; ++step) {
      std::vector<Batch> bs{on_gpu(testing::random_batch(2, 128, 300, 40 + 10 * step)),
                            on_gpu(testing::random_batch(2, 128, 300, 45 + 10 * step))};
      const StepResult ro = train_step(over, d, fo, world, bs, 1e-3, 1.0);
      const StepResult rl = train_step(line, d, fl, world, bs, 1e-3, 1.0);
      EXPECT_EQ(ro.loss, rl.loss) << "step " << step;
      EXPECT_EQ(ro.grad_norm, rl.grad_norm) << "step " << step;
      if (step == 2) {  // a validation pass while the updates may still run
        const Batch v = on_gpu(testing::random_batch(1, 128, 300, 99));
        EXPECT_EQ(over.forward_loss(v, d).ce_sum, line.forward_loss(v, d).ce_sum);
      }
    }
    fo.drain();
    cuda::device_synchronize();
    for (size_t i = 0; i < fo.shard_params().size(); ++i) {
      const Parameter &a = fo.shard_params()[i], &b = fl.shard_params()[i];
      EXPECT_TRUE(testing::bytes_equal(a.value.to(Device::cpu()), b.value.to(Device::cpu()))) << a.name;
      EXPECT_TRUE(testing::bytes_equal(a.master_low.to(Device::cpu()), b.master_low.to(Device::cpu()))) << a.name;
      EXPECT_TRUE(testing::bytes_equal(fo.optimizer().exp_avg()[i].to(Device::cpu()),
                                       fl.optimizer().exp_avg()[i].to(Device::cpu())))
          << a.name;
    }
  });
}

}  // namespace
}  // namespace moetrain
