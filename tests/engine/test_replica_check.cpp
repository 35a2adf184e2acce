// The end-of-run check that replicated state is the same on every data rank: equal copies
// pass, one bit flipped on one rank is named, the expert buckets and (with sharded
// weights) the parameters are left out, the routing biases never.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "comm/comm_test_util.h"
#include "engine/models/deepseek_v3.h"
#include "engine/parallel/replica_check.h"
#include "model_batches.h"
#include "test_util.h"

namespace moetrain {
namespace {

TEST(ReplicaCheck, EqualCopiesPassAndOneFlippedBitIsNamed) {
  testing::run_ranks(3, [](Communicator& group) {
    DeepseekV3Model model(testing::tiny_dsv3_config(19), DType::F32);
    model.init_weights(5);
    std::vector<NamedTensor> state = replicated_state(model, /*whole_weights=*/true);
    EXPECT_TRUE(replicas_that_differ(state, group, Device::cpu()).empty());
    // Rank 2 flips the lowest bit of one element of a routing bias and of the q_b weight.
    if (group.rank() == 2) {
      for (NamedTensor& t : state) {
        if (t.name == "model.layers.2.mlp.gate.e_score_correction_bias" ||
            t.name == "model.layers.0.self_attn.q_b_proj.weight") {
          uint32_t bits;
          std::memcpy(&bits, t.value.data<float>() + 3, 4);
          bits ^= 1u;
          std::memcpy(t.value.data<float>() + 3, &bits, 4);
        }
      }
    }
    const std::vector<std::string> differ = replicas_that_differ(state, group, Device::cpu());
    EXPECT_EQ(differ, (std::vector<std::string>{"model.layers.2.mlp.gate.e_score_correction_bias",
                                                "model.layers.0.self_attn.q_b_proj.weight"}));
  });
}

TEST(ReplicaCheck, ExpertsAndShardedWeightsAreLeftOut) {
  DeepseekV3Model model(testing::tiny_dsv3_config(19), DType::F32);
  const std::vector<NamedTensor> whole = replicated_state(model, true), sharded = replicated_state(model, false);
  auto has = [](const std::vector<NamedTensor>& v, const std::string& name) {
    return std::any_of(v.begin(), v.end(), [&](const NamedTensor& t) { return t.name == name; });
  };
  EXPECT_TRUE(has(whole, "model.layers.1.mlp.gate.weight"));
  EXPECT_TRUE(has(whole, "model.layers.1.mlp.shared_experts.up_proj.weight"));
  EXPECT_TRUE(has(whole, "lm_head.weight"));
  EXPECT_FALSE(has(whole, "model.layers.1.mlp.experts.0.up_proj.weight"));
  EXPECT_TRUE(has(whole, "model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(sharded.size(), 2u);  // the two MoE layers' routing biases only
  EXPECT_TRUE(has(sharded, "model.layers.2.mlp.gate.e_score_correction_bias"));
}

}  // namespace
}  // namespace moetrain
