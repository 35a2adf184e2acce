// One Qwen3-MoE training micro-step on the GPU (bf16 compute, f32 gradients) against the
// same step on the CPU (f32), from the same weights: the loss and every gradient agree
// within bf16 tolerance. Skips without a GPU.
#include <gtest/gtest.h>

#include "core/cuda_runtime.h"
#include "engine/models/qwen3_moe.h"
#include "test_util.h"

namespace moetrain {
namespace {

TEST(Qwen3MoeCuda, TrainingStepMatchesCpu) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  Qwen3MoeConfig c;
  c.vocab_size = 300;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.moe_intermediate_size = 64;
  c.num_hidden_layers = 3;
  c.mlp_only_layers = {0};
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.router_aux_loss_coef = 0.01;
  c.router_z_loss_coef = 0.001;

  Qwen3MoeModel gpu(c, DType::BF16, Device::cuda(0));
  gpu.init_weights(5);
  Qwen3MoeModel cpu(c, DType::F32);
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
  Batch bg = b;
  bg.inputs = b.inputs.to(Device::cuda(0));
  bg.targets = b.targets.to(Device::cuda(0));
  bg.positions = b.positions.to(Device::cuda(0));

  LocalDispatcher d;
  zero_grads(cpu.parameters());
  zero_grads(gpu.parameters());
  MicroBatchLoss lc = cpu.forward_backward(b, d, 1.0 / (B * S), 1.0);
  MicroBatchLoss lg = gpu.forward_backward(bg, d, 1.0 / (B * S), 1.0);
  std::printf("loss cpu %.6f gpu %.6f | aux cpu %.6f gpu %.6f\n", lc.ce_sum / (B * S), lg.ce_sum / (B * S),
              lc.aux_loss, lg.aux_loss);
  EXPECT_NEAR(lg.ce_sum / lc.ce_sum, 1.0, 1e-2);
  EXPECT_NEAR(lg.aux_loss / lc.aux_loss, 1.0, 2e-2);
  double worst = 0;
  for (size_t i = 0; i < cpu.parameters().size(); ++i) {
    const Parameter& p = cpu.parameters()[i];
    const double e = testing::rel_error(gpu.parameters()[i].grad.to(Device::cpu()), p.grad);
    worst = std::max(worst, e);
    EXPECT_LT(e, 5e-2) << p.name;
  }
  std::printf("GPU vs CPU gradients: worst relative error %.3e over %zu parameters\n", worst,
              cpu.parameters().size());
}

}  // namespace
}  // namespace moetrain
