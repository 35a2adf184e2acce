// The training state a run carries (TrainState), the step hooks fault tolerance plugs into
// (a discarded step changes nothing, in one process and under FSDP), and the checkpoint
// context saving and restoring the state with the model's buffers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "comm/comm_test_util.h"
#include "engine/checkpoint/checkpoint_context.h"
#include "engine/parallel/fsdp.h"
#include "engine/parallel/replica_bridge.h"
#include "engine/train_context.h"
#include "engine/train_state.h"
#include "engine/trainer.h"
#include "model_batches.h"
#include "scratch_dir.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::error_of;

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), static_cast<size_t>(a.numel()) * dtype_size(a.dtype())) == 0;
}

TEST(TrainState, JsonRoundTripAndMissingKeys) {
  TrainState s;
  s.step = 17;
  s.optimizer_steps = 15;
  s.data_position = {{"sequence", 1234}, {"epoch", 2}};
  nlohmann::json st;
  st["seed"] = 5;  // a key of the checkpoint's, left alone
  s.write_json(st);
  EXPECT_EQ(st["seed"], 5);
  TrainState back;
  back.read_json(st, "ckpt");
  EXPECT_EQ(back.step, 17);
  EXPECT_EQ(back.optimizer_steps, 15);
  EXPECT_EQ(back.data_position, s.data_position);

  nlohmann::json no_data = st;
  no_data.erase("data");
  std::string e = error_of([&] { back.read_json(no_data, "step-5"); });
  EXPECT_NE(e.find("checkpoint step-5: trainer_state.json lacks step, data or optimizer"), std::string::npos) << e;
  nlohmann::json no_steps = st;
  no_steps["optimizer"].erase("steps_taken");
  e = error_of([&] { back.read_json(no_steps, "step-5"); });
  EXPECT_NE(e.find("optimizer.steps_taken"), std::string::npos) << e;
  nlohmann::json float_step = st;  // a float would be cast to int64: undefined beyond its range
  float_step["step"] = 1e300;
  e = error_of([&] { back.read_json(float_step, "step-5"); });
  EXPECT_NE(e.find("checkpoint step-5: trainer_state.json: step and optimizer.steps_taken must be integers (got 1e+300"),
            std::string::npos)
      << e;
}

std::vector<Batch> step_batches(int step, int64_t vocab) {
  std::vector<Batch> bs;
  for (int i = 0; i < 2; ++i) bs.push_back(testing::random_batch(2, 6, static_cast<int32_t>(vocab), 200 + 10 * step + i));
  return bs;
}

// One process (LayerwiseOptimizer, expert weight gradients grouped over the two
// micro-batches): steps 1, 2 (discarded), 3 against steps 1, 3. The discarded step leaves
// weights, masters and the optimizer's count as step 1 left them, and step 3 after it is
// bitwise step 3 without it.
TEST(StepHooks, DiscardedStepChangesNothingInOneProcess) {
  const Qwen3MoeConfig c = testing::tiny_moe_config(40, 2);
  Qwen3MoeModel with(c, DType::F32), without(c, DType::F32);
  with.init_weights(4);
  without.init_weights(4);
  with.set_expert_wgrad_group(2);
  without.set_expert_wgrad_group(2);
  AdamW opt_w(with.parameters(), {}), opt_o(without.parameters(), {});
  LayerwiseOptimizer lw_w(with, opt_w, LayerwiseConfig{}), lw_o(without, opt_o, LayerwiseConfig{});
  LocalDispatcher d;
  int asked = 0;
  train_step(with, d, lw_w, step_batches(1, c.vocab_size), 1e-2, 1.0, [&] { return ++asked > 0; });
  train_step(without, d, lw_o, step_batches(1, c.vocab_size), 1e-2, 1.0);
  EXPECT_EQ(asked, 1);
  std::vector<Tensor> after_one;
  for (const Parameter& p : with.parameters()) after_one.push_back(p.value.clone());

  const StepResult dropped =
      train_step(with, d, lw_w, step_batches(2, c.vocab_size), 1e-2, 1.0, [&] { return ++asked < 0; });
  EXPECT_EQ(asked, 2);
  EXPECT_FALSE(dropped.committed);
  EXPECT_TRUE(std::isfinite(dropped.grad_norm) && dropped.grad_norm > 0);
  EXPECT_EQ(opt_w.steps_taken(), 1);
  for (size_t i = 0; i < after_one.size(); ++i) {
    EXPECT_TRUE(same_bits(with.parameters()[i].value, after_one[i])) << with.parameters()[i].name;
  }

  const StepResult a = train_step(with, d, lw_w, step_batches(3, c.vocab_size), 1e-2, 1.0);
  const StepResult b = train_step(without, d, lw_o, step_batches(3, c.vocab_size), 1e-2, 1.0);
  EXPECT_TRUE(a.committed);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.grad_norm, b.grad_norm);
  EXPECT_EQ(opt_w.steps_taken(), 2);
  for (size_t i = 0; i < with.parameters().size(); ++i) {
    EXPECT_TRUE(same_bits(with.parameters()[i].value, without.parameters()[i].value)) << with.parameters()[i].name;
  }
}

// The same under FSDP on two ranks (Gloo, threads): the discard comes after the gradients
// are reduced, and the next step is bitwise the one without it.
TEST(StepHooks, DiscardedStepChangesNothingUnderFsdp) {
  const Qwen3MoeConfig c = testing::tiny_moe_config(40, 2);
  testing::run_ranks(2, [&](Communicator& world) {
    auto make = [&] {
      auto m = std::make_unique<Qwen3MoeModel>(c, DType::F32, Device::cpu(), ModelPlacement{1, 0, 2});
      m->init_weights(4);
      m->set_data_group(&world);
      return m;
    };
    std::unique_ptr<Qwen3MoeModel> with = make(), without = make();
    FsdpContext f_w(*with, world, world, world, AdamWConfig{}, /*shard_weights=*/true);
    FsdpContext f_o(*without, world, world, world, AdamWConfig{}, /*shard_weights=*/true);
    LocalDispatcher d;
    auto rank_batches = [&](int step) {  // this rank's rows: another seed per rank
      std::vector<Batch> bs;
      for (int i = 0; i < 2; ++i) {
        bs.push_back(testing::random_batch(1, 6, 40, 300 + 10 * step + 2 * i + world.rank()));
      }
      return bs;
    };
    train_step(*with, d, f_w, world, rank_batches(1), 1e-2, 1.0);
    train_step(*without, d, f_o, world, rank_batches(1), 1e-2, 1.0);
    const StepResult dropped = train_step(*with, d, f_w, world, rank_batches(2), 1e-2, 1.0, [] { return false; });
    EXPECT_FALSE(dropped.committed);
    EXPECT_EQ(f_w.optimizer().steps_taken(), 1);
    const StepResult a = train_step(*with, d, f_w, world, rank_batches(3), 1e-2, 1.0);
    const StepResult b = train_step(*without, d, f_o, world, rank_batches(3), 1e-2, 1.0);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    for (size_t i = 0; i < f_w.shard_params().size(); ++i) {
      EXPECT_TRUE(same_bits(f_w.shard_params()[i].value, f_o.shard_params()[i].value)) << i;
    }
  });
}

// The router losses over data ranks take the global row count as this rank's times the
// ranks (no host wait inside a pass); ranks whose micro-batches differ in tokens break that,
// and the loss terms, read at the step's end, say so instead of using a wrong count.
TEST(StepHooks, RouterLossesRefuseDataRanksOfUnequalTokens) {
  Qwen3MoeConfig c = testing::tiny_moe_config(40, 2);
  c.router_aux_loss_coef = 0.01;
  std::vector<std::string> errors(2);
  testing::run_ranks(2, [&](Communicator& world) {
    Qwen3MoeModel m(c, DType::F32, Device::cpu(), ModelPlacement{1, 0, 2});
    m.init_weights(4);
    m.set_data_group(&world);
    LocalDispatcher d;
    // Equal tokens on both ranks: the same aux loss on each, as the reduced counts say.
    MicroBatchLoss equal = m.forward_loss(testing::random_batch(1, 6, 40, 7 + world.rank()), d);
    equal.read_device_values();
    EXPECT_GT(equal.term("aux_loss"), 0.0);
    try {  // 2 layers x (6 + 5) tokens routed; rank 0 assumed 2 x 6 x 2, rank 1 2 x 5 x 2
      MicroBatchLoss unequal = m.forward_loss(testing::random_batch(1, world.rank() == 0 ? 6 : 5, 40, 9), d);
      unequal.read_device_values();
    } catch (const Error& e) {
      errors[static_cast<size_t>(world.rank())] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("router losses: the data ranks routed 22 rows in all, but 24 were assumed"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("router losses: the data ranks routed 22 rows in all, but 20 were assumed"),
            std::string::npos)
      << errors[1];
}

// A family with a non-gradient buffer (as DeepSeek-V3's routing bias will be): the
// checkpoint context saves it by name with the weights and restores it with the state.
class BufferedModel : public Qwen3MoeModel {
 public:
  using Qwen3MoeModel::Qwen3MoeModel;
  std::vector<NamedBuffer> buffers() override { return {{"model.layers.0.mlp.gate.e_score_correction_bias", bias}}; }
  Tensor bias = Tensor::zeros({4}, DType::F32);
};

class CheckpointContextTest : public ScratchDirTest {};

std::unique_ptr<TrainContext> one_process_context(const RunConfig& cfg) {
  auto ctx = std::make_unique<TrainContext>();
  auto model = std::make_unique<BufferedModel>(cfg.model.as<Qwen3MoeConfig>(), DType::F32);
  model->init_weights(static_cast<uint64_t>(cfg.training.seed));
  ctx->model = std::move(model);
  ctx->dispatcher = std::make_unique<LocalDispatcher>();
  ctx->single_opt = std::make_unique<AdamW>(ctx->model->parameters(), AdamWConfig{});
  ctx->layerwise = std::make_unique<LayerwiseOptimizer>(*ctx->model, *ctx->single_opt, LayerwiseConfig{});
  return ctx;
}

TEST_F(CheckpointContextTest, SavesAndRestoresTheStateWithTheBuffers) {
  RunConfig cfg;
  cfg.model.as<Qwen3MoeConfig>() = testing::tiny_moe_config(300, 2);
  cfg.metrics.dir = path("run");
  cfg.checkpoint.every = 2;
  cfg.checkpoint.async = false;
  cfg.training.steps = 10;
  std::unique_ptr<TrainContext> ctx = one_process_context(cfg);
  auto& bias = static_cast<BufferedModel&>(*ctx->model).bias;
  {
    CheckpointContext ck(cfg, *ctx);
    TrainState s = ck.restore();
    EXPECT_EQ(s.step, 0);
    ASSERT_EQ(s.buffers.size(), 1u);
    for (int64_t e = 0; e < 4; ++e) bias.data<float>()[e] = 0.25f * static_cast<float>(e + 1);
    ctx->step(step_batches(1, 300), 1e-2, 1.0);
    s.step = 1;
    EXPECT_FALSE(ck.after_step(s, false).has_value());  // not a save step
    s.step = 2;
    s.optimizer_steps = ctx->optimizer().steps_taken();
    s.data_position = {{"sequence", 42}};
    EXPECT_TRUE(ck.after_step(s, false).has_value());
    ck.finish();
  }
  // A fresh process: another initialisation, a zero bias; resume takes step 2's everything.
  cfg.training.seed = 99;
  std::unique_ptr<TrainContext> again = one_process_context(cfg);
  CheckpointContext ck(cfg, *again);
  const TrainState s = ck.restore();
  EXPECT_EQ(s.step, 2);
  EXPECT_EQ(s.optimizer_steps, 1);
  EXPECT_EQ(s.data_position["sequence"], 42);
  EXPECT_EQ(again->optimizer().steps_taken(), 1);
  const Tensor& restored = static_cast<BufferedModel&>(*again->model).bias;
  EXPECT_TRUE(same_bits(restored, bias));
  for (size_t i = 0; i < ctx->model->parameters().size(); ++i) {
    EXPECT_TRUE(same_bits(again->model->parameters()[i].value, ctx->model->parameters()[i].value))
        << ctx->model->parameters()[i].name;
  }
}

}  // namespace
}  // namespace moetrain

namespace moetrain {
namespace {

// The bridge across replica groups: sums over it, becomes a no-op with one replica group,
// and is rebuilt in place (the components holding it see the new group at their next use).
TEST(ReplicaBridge, SumsAcrossReplicasAndIsRebuiltInPlace) {
  testing::run_ranks(4, [](Communicator& world) {
    // Replica group = rank / 2; a rank's peers in the other group hold the same shard.
    std::shared_ptr<Communicator> peers(world.split(world.rank() % 2, world.rank(), "replicate"));
    std::shared_ptr<Communicator> inside(world.split(world.rank() / 2, world.rank(), "replica_data"));
    ReplicaBridge bridge(peers);
    EXPECT_TRUE(bridge.crosses());
    EXPECT_EQ(bridge.replicas(), 2);
    EXPECT_EQ(bridge.index(), world.rank() / 2);
    std::vector<double> v{static_cast<double>(world.rank() + 1)};
    bridge.all_reduce_doubles(v, Device::cpu());
    EXPECT_EQ(v[0], world.rank() % 2 == 0 ? 1 + 3 : 2 + 4);
    // Inside the group, then across: every rank of every group holds the batch-wide sum.
    std::vector<double> all{static_cast<double>(world.rank() + 1)};
    sum_over_data(inside.get(), &bridge, all, Device::cpu());
    EXPECT_EQ(all[0], 10);
    std::vector<double> most{static_cast<double>(world.rank())};
    bridge.all_reduce_doubles(most, Device::cpu(), ReduceOp::Max);
    EXPECT_EQ(most[0], world.rank() % 2 == 0 ? 2 : 3);
    // Replica group 1 leaves: the bridge holds no peer, and sums stay inside the group.
    bridge.rebuild(nullptr);
    EXPECT_FALSE(bridge.crosses());
    EXPECT_EQ(bridge.replicas(), 1);
    std::vector<double> alone{static_cast<double>(world.rank() + 1)};
    sum_over_data(inside.get(), &bridge, alone, Device::cpu());
    EXPECT_EQ(alone[0], world.rank() / 2 == 0 ? 1 + 2 : 3 + 4);
    // ... and back: a new communicator, the same bridge object.
    bridge.rebuild(std::shared_ptr<Communicator>(world.split(world.rank() % 2, world.rank(), "replicate2")));
    std::vector<double> again{1.0};
    bridge.all_reduce_doubles(again, Device::cpu());
    EXPECT_EQ(again[0], 2.0);
  });
}

}  // namespace
}  // namespace moetrain
