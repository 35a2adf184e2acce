// Launchers of the MoE auxiliary-loss kernels (moe_losses.cu): load balancing and the
// router z-loss. probs, prob_sum, selections, lse, loss_sum, dprobs are f32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// Bytes of device scratch launch_load_balance_accumulate needs.
size_t load_balance_scratch_bytes(int64_t R, int64_t E);
// selections[e] += number of (r, k) with topk_idx[r, k] == e; prob_sum[e] += sum_r
// probs[r, e] (in double, fixed order). An index outside [0, E) makes every selections
// entry NaN (no host check: it would wait for the device).
void launch_load_balance_accumulate(const float* probs, const int32_t* topk_idx, float* selections,
                                    float* prob_sum, int64_t R, int64_t E, int64_t K, void* scratch,
                                    cudaStream_t s);
// dprobs[r, e] = float(coef * E * selections[e] / total_rows^2) for r < rows.
void launch_load_balance_backward(const float* selections, float* dprobs, int64_t rows, int64_t E,
                                  int64_t total_rows, double coef, cudaStream_t s);

// out[0] = sum_r -sum_e probs[r, e] log probs[r, e] (fixed order); h is caller scratch [R].
void launch_router_entropy_sum(const float* probs, float* h, float* out, int64_t R, int64_t E, cudaStream_t s);
// lse[r] = log sum_e exp(logits[r, e]); loss_sum[0] = sum_r lse[r]^2 (fixed order);
// sq is caller scratch [R].
void launch_router_z_loss_forward(const float* logits, float* lse, float* sq, float* loss_sum, int64_t R,
                                  int64_t E, cudaStream_t s);
void launch_router_z_loss_forward(const __nv_bfloat16* logits, float* lse, float* sq, float* loss_sum, int64_t R,
                                  int64_t E, cudaStream_t s);
// dlogits[r, e] = bf16(scale * 2 * lse[r] * probs[r, e]).
void launch_router_z_loss_backward(const float* probs, const float* lse, __nv_bfloat16* dlogits, int64_t R,
                                   int64_t E, float scale, cudaStream_t s);

// DeepSeek-V3's sequence-wise balance loss over B sequences of S rows (ops.h): per_seq [B]
// caller scratch (zeroed: an empty sequence adds 0), loss_sum[0] = their fixed-order sum. An
// expert id outside [0, E) is not counted (no host check: it would wait for the device).
// whole (f64 [B, E], or null): the whole sequences' counts, of length s_whole, when the S rows
// are a part of each (context parallelism).
void launch_seq_balance_loss_sum(const float* probs, const int32_t* topk_idx, const double* whole, int64_t s_whole,
                                  float* per_seq, float* loss_sum, int64_t B, int64_t S, int64_t E, int64_t K,
                                  cudaStream_t s);
void launch_seq_balance_backward(const float* probs, const int32_t* topk_idx, const double* whole, int64_t s_whole,
                                 float* dprobs, int64_t B, int64_t S, int64_t E, int64_t K, float scale,
                                 cudaStream_t s);
// counts (f64 [B, E]) = each expert's selections in each sequence.
void launch_seq_balance_counts(const int32_t* topk_idx, double* counts, int64_t B, int64_t S, int64_t E, int64_t K,
                               cudaStream_t s);

}  // namespace moetrain::ops::cuda
