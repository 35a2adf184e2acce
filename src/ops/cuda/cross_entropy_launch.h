// Launchers of the cross-entropy kernels (cross_entropy.cu): logits bf16 [T, V],
// targets i32 [T] (-100 = ignored), lse f32 [T], loss_sum f32 [1], dlogits bf16 [T, V].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// lse[t] = log sum_v exp(logits[t, v]); row_loss[t] = lse[t] - logits[t, target[t]]
// (0 where ignored, NaN for a target outside [0, V) that is not -100); then
// loss_sum[0] = sum_t row_loss[t] in a fixed order. row_loss is caller scratch [T].
void launch_cross_entropy_forward(const __nv_bfloat16* logits, const int32_t* targets, float* lse,
                                  float* row_loss, float* loss_sum, int64_t T, int64_t V, cudaStream_t s);
// dlogits[t, v] = scale * (exp(logits[t, v] - lse[t]) - [v == target[t]]); zero rows where
// ignored, NaN rows for an invalid target.
void launch_cross_entropy_backward(const __nv_bfloat16* logits, const int32_t* targets, const float* lse,
                                   __nv_bfloat16* dlogits, int64_t T, int64_t V, float scale, cudaStream_t s);
// A vocabulary split across ranks (ops.h's vocab_shard_*): logits [T, V] are the columns
// [v0, v0 + V) of a vocabulary of v_whole. stats: lse [T] of the shard's columns and the
// target's logit where the shard holds it (else 0; NaN for an invalid target). loss: from R
// shards' stats stacked [R, T], the whole rows' lse, row_loss scratch [T] and loss_sum[0] in
// a fixed order. backward: as launch_cross_entropy_backward with the target at column
// target - v0 (outside the shard: no one-hot).
void launch_vocab_shard_stats(const __nv_bfloat16* logits, const int32_t* targets, float* lse, float* target_logit,
                              int64_t T, int64_t V, int64_t v0, int64_t v_whole, cudaStream_t s);
void launch_vocab_parallel_loss(const float* shard_lse, const float* shard_target_logit, const int32_t* targets,
                                float* lse, float* row_loss, float* loss_sum, int64_t R, int64_t T, cudaStream_t s);
void launch_vocab_shard_backward(const __nv_bfloat16* logits, const int32_t* targets, const float* lse,
                                 __nv_bfloat16* dlogits, int64_t T, int64_t V, int64_t v0, int64_t v_whole,
                                 float scale, cudaStream_t s);
// Both in one pass, the gradient written over the logits (the same values, bit for bit):
// one block a row holding its logits in shared memory. false, with nothing launched, where a
// row does not fit (V % 8 != 0, an unaligned pointer, or V > kCrossEntropyFusedMaxV).
constexpr int64_t kCrossEntropyFusedMaxV = 32768;
bool launch_cross_entropy_fused(__nv_bfloat16* logits, const int32_t* targets, float* lse, float* row_loss,
                                float* loss_sum, int64_t T, int64_t V, float scale, cudaStream_t s);

}  // namespace moetrain::ops::cuda
