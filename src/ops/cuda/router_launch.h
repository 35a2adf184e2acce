// Launchers of the router kernels (router.cu); the host wrapper is router.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// The largest expert count the router kernels take (one warp holds a row in registers).
constexpr int kRouterMaxExperts = 512;

// logits [T, E] (bf16 when logits_bf16, else f32) -> probs f32 [T, E], idx i32 [T, K],
// weight f32 [T, K]; bias: f32 [E] added to the probs for the choice only, or nullptr.
// 1 <= K <= E <= kRouterMaxExperts.
void launch_router_forward(const void* logits, bool logits_bf16, const float* bias, int64_t T, int E, int K,
                           bool norm_topk_prob, float* probs, int32_t* idx, float* weight, cudaStream_t stream);
// dlogits [T, E] (bf16 when out_bf16, else f32) from dweight f32 [T, K], optional dprobs
// f32 [T, E] (nullptr when absent), probs f32 [T, E], idx i32 [T, K].
void launch_router_backward(const float* dweight, const float* dprobs, const float* probs, const int32_t* idx,
                            int64_t T, int E, int K, bool norm_topk_prob, void* dlogits, bool out_bf16,
                            cudaStream_t stream);

// DeepSeek-V3's router (ops.h: router_sigmoid_forward / backward), the same layouts; bias
// f32 [E] or nullptr; n_group divides E, 1 <= topk_group <= n_group <= 32.
void launch_router_sigmoid_forward(const void* logits, bool logits_bf16, const float* bias, int64_t T, int E, int K,
                                   int n_group, int topk_group, bool norm_topk_prob, float scaling, float* probs,
                                   int32_t* idx, float* weight, cudaStream_t stream);
void launch_router_sigmoid_backward(const float* dweight, const float* dprobs, const float* probs,
                                    const int32_t* idx, int64_t T, int E, int K, bool norm_topk_prob, float scaling,
                                    void* dlogits, bool out_bf16, cudaStream_t stream);

}  // namespace moetrain::ops::cuda
