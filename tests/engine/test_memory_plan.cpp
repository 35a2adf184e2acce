// The memory planner (engine/plan/memory_plan.h) against what moetrain allocates, on the
// CPU (f32: the planner's `act` = 4): each family's parameter count from the config equals
// the built model's, whole and with the experts split over two ranks; the activations a
// training forward keeps for its backward (host bytes live after forward_chunk, less
// before) within 3% of the planned ones, with and without full recomputation (which must
// plan and keep far less); and the planner's layouts of N ranks and refusals. The GPU's
// figures against peak_memory_bytes are in docs/memory.md.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/allocator.h"
#include "engine/models/model.h"
#include "engine/plan/memory_plan.h"
#include "engine/run_config.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

RunConfig config(const std::string& file, std::vector<std::string> overrides) {
  overrides.push_back("training.device=cpu");
  return RunConfig::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + file, overrides);
}

double part(const MemoryPlan& p, const std::string& name) {
  for (const MemoryPart& m : p.parts) {
    if (m.name == name) return m.bytes;
  }
  return 0;
}

void expect_plan_matches(const std::string& file, const std::vector<std::string>& overrides) {
  SCOPED_TRACE(file);
  for (const std::string recompute : {"none", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    std::vector<std::string> o = overrides;
    o.push_back("training.recompute=" + recompute);
    const RunConfig cfg = config(file, o);
    const MemoryPlan plan = plan_memory(cfg, PlanLayout{}, /*gpu=*/false);
    std::unique_ptr<Model> model = build_model(*cfg.model, DType::F32, Device::cpu(), ModelPlacement{});
    model->init_weights(1);
    if (recompute != "none") {
      std::vector<int64_t> all;
      for (int64_t id = 0; id < cfg.model->shape().num_layers; ++id) all.push_back(id);
      model->set_recompute(all, recompute == "full" ? RecomputeMode::kFull : RecomputeMode::kSelective);
    }
    // Parameters: the weights part is 4 bytes each on the CPU.
    EXPECT_EQ(part(plan, "weights") / 4, static_cast<double>(count_elements(model->parameters())));
    // Activations of one training forward.
    const Batch b = testing::random_batch(cfg.training.micro_batch_size, cfg.training.seq_len,
                                          static_cast<int32_t>(cfg.model->shape().vocab_size), 5);
    LocalDispatcher d;
    ChunkActivations a;
    RouterTotals totals = model->new_totals();
    MicroBatchLoss loss;
    const int64_t before = host_memory_stats().live_bytes;
    model->forward_chunk(model->whole(), b, Tensor(), d, a, totals, ChunkPass{true, 1e-3, 1.0, false}, &loss);
    const double kept = static_cast<double>(host_memory_stats().live_bytes - before);
    const double planned = part(plan, "activations");
    std::printf("%s, recompute %s: activations kept %.3f MB, planned %.3f MB\n", file.c_str(), recompute.c_str(),
                kept / 1e6, planned / 1e6);
    EXPECT_NEAR(planned / kept, 1.0, 0.03);
    model->backward_chunk(model->whole(), b, Tensor(), d, a, 1.0, true, false);
  }
}

TEST(MemoryPlan, ParametersAndActivationsMatchWhatTheModelHoldsQwen3) {
  expect_plan_matches("tiny.toml", {"training.micro_batch_size=4", "training.seq_len=128"});
}

TEST(MemoryPlan, ParametersAndActivationsMatchWhatTheModelHoldsDeepseekV3) {
  expect_plan_matches("dsv3-tiny.toml", {"training.micro_batch_size=4", "training.seq_len=64"});
}

// Experts split over two ranks: each holds half of every MoE layer's routed experts.
TEST(MemoryPlan, ExpertParallelRanksHoldHalfTheExperts) {
  for (const char* file : {"tiny.toml", "dsv3-tiny.toml"}) {
    SCOPED_TRACE(file);
    const RunConfig cfg = config(file, {"parallel.ep=2", "parallel.shard_weights=false"});
    PlanLayout l;
    l.ep = 2;
    const MemoryPlan plan = plan_memory(cfg, l, false);
    ModelPlacement half;
    half.ep_size = 2;
    half.ep_rank = 1;
    std::unique_ptr<Model> model = build_model(*cfg.model, DType::F32, Device::cpu(), half);
    EXPECT_EQ(part(plan, "weights") / 4, static_cast<double>(count_elements(model->parameters())));
    EXPECT_GT(part(plan, "optimizer shards"), 0);
  }
}

// A pipeline's head helper (DualPipeV over 4 layers: rank 1 computes half the head's rows)
// holds a copy of the head and its f32 gradient: planned on that rank only, and not when off.
TEST(MemoryPlan, TheHeadHelperHoldsACopyOfTheHead) {
  for (const char* share : {"-1", "0"}) {
    const RunConfig cfg = config("tiny.toml", {"parallel.pp=2", "training.grad_accum_steps=4",
                                               std::string("parallel.head_share=") + share});
    PlanLayout l;
    l.pp = 2;
    const double head = static_cast<double>(cfg.model->shape().vocab_size * cfg.model->shape().hidden_size);
    EXPECT_EQ(part(plan_memory(cfg, l, true, 0), "head copy"), 0);
    EXPECT_EQ(part(plan_memory(cfg, l, true, 1), "head copy"), std::string(share) == "0" ? 0 : 6 * head) << share;
  }
}

TEST(MemoryPlan, LayoutsOfNRanksAndWhatFits) {
  const RunConfig cfg = config("tiny.toml", {});
  const std::vector<PlanLayout> ls = layouts_of(cfg, 4, 80.0 * (1 << 30));
  std::vector<std::string> names;
  for (const PlanLayout& l : ls) names.push_back(l.str());
  // tiny.toml: 4 layers (DualPipeV over 4 would need 8), 8 experts.
  EXPECT_EQ(names, (std::vector<std::string>{"pp1 dp4 ep1 zero2", "pp1 dp2 ep2 zero2", "pp1 dp1 ep4 zero2",
                                             "pp2 dp2 ep1 dualpipev zero2", "pp2 dp1 ep2 dualpipev zero2"}));
  const MemoryPlan one = plan_memory(cfg, PlanLayout{}, true);
  EXPECT_TRUE(one.fits(80.0 * (1 << 30)));
  EXPECT_FALSE(one.fits(one.peak()));  // the context and workspaces come on top
  const std::string text = format_memory_plan(one, 1e6);
  EXPECT_NE(text.find("does NOT fit"), std::string::npos) << text;
  EXPECT_THROW(layout_of(config("tiny.toml", {"parallel.pp=3"}), 4, 1e12), Error);
  // The trainer's start-up check: refused before allocating, the parts named; or let through.
  try {
    check_memory_at_start(cfg, 1, 1, 1, 1, 1e6, false, /*refuse=*/true);
    ADD_FAILURE() << "a 1 MB GPU should not fit";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("will not fit the GPU's memory"), std::string::npos) << m;
    EXPECT_NE(m.find("optimizer"), std::string::npos) << m;
    EXPECT_NE(m.find("--training.check_memory=false"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(check_memory_at_start(cfg, 1, 1, 1, 1, 1e6, false, /*refuse=*/false));
  EXPECT_NO_THROW(check_memory_at_start(cfg, 1, 1, 1, 1, 80e9, false, true));
}

// Context parallelism: a cp rank holds half of every sequence (its two zigzag chunks), so
// what it keeps per token halves against one rank with the same micro-batch, and its shards
// are cut over dp x cp; the backward carries the ring's key/value blocks besides. Layouts of
// N ranks keep the config's cp.
TEST(MemoryPlan, ContextParallelRanksHoldHalfTheTokens) {
  const RunConfig one_cfg = config("tiny.toml", {});
  const RunConfig cfg = config("tiny.toml", {"parallel.cp=2"});
  const PlanLayout l = layout_of(cfg, 2, 1e12);
  EXPECT_EQ(l.cp, 2);
  EXPECT_EQ(l.dp, 1);
  EXPECT_EQ(l.str(), "pp1 dp1 cp2 ep1 zero2");
  const MemoryPlan one = plan_memory(one_cfg, layout_of(one_cfg, 1, 1e12), false);
  const MemoryPlan two = plan_memory(cfg, l, false);
  EXPECT_NEAR(part(two, "activations"), part(one, "activations") / 2, 1e-6 * part(one, "activations"));
  EXPECT_GT(part(two, "backward"), part(one, "backward") / 2) << "the ring's blocks";
  const MemoryPlan dp2 = plan_memory(one_cfg, layout_of(one_cfg, 2, 1e12), false);
  EXPECT_NEAR(part(two, "optimizer shards"), part(dp2, "optimizer shards"), 1.0) << "cut over dp x cp as over dp";
  std::vector<std::string> names;
  for (const PlanLayout& x : layouts_of(cfg, 4, 1e12)) names.push_back(x.str());
  EXPECT_EQ(names, (std::vector<std::string>{"pp1 dp2 cp2 ep1 zero2", "pp1 dp1 cp2 ep2 zero2",
                                             "pp2 dp1 cp2 ep1 dualpipev zero2"}));
  EXPECT_THROW(layout_of(config("tiny.toml", {"parallel.cp=2", "parallel.ep=4"}), 4, 1e12), Error);
}

}  // namespace
}  // namespace moetrain
