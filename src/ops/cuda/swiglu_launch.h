// Launchers of the grouped expert SwiGLU (swiglu.cu); the host wrapper is swiglu.cpp.
// All matrices bf16 except the f32 weight gradients; counts i64 [E] stay on the device.
// Requirements checked by the wrapper: H and I multiples of 8, 16-byte aligned pointers,
// E <= kSwigluMaxExperts, N small enough for swiglu_max_tiles to fit a grid dimension.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::ops::cuda {

constexpr int kSwigluMaxExperts = 2048;
constexpr int64_t kSwigluMaxGridY = 65535;

// Upper bound of the row tiles of a grouped GEMM over N rows split among E experts.
int64_t swiglu_max_tiles(int64_t N, int E);
// Device scratch (4-byte words) that each launcher below needs.
int64_t swiglu_workspace_words(int64_t N, int E);

// gate = x Wg[e]^T, up = x Wu[e]^T (one launch), act = silu(gate) * up (same epilogue;
// act is scratch [N, I] that the caller provides), y = act Wd[e]^T.
void launch_swiglu_forward(const void* x, const int64_t* counts, const void* w_gate, const void* w_up,
                           const void* w_down, int64_t N, int H, int I, int E, void* gate, void* up, void* act,
                           void* y, int32_t* workspace, cudaStream_t stream);
// The forward in FP8 (issue 30): x_q [N, H] e4m3 with x_scale [H / 128][N] (1 x 128 tiles);
// each weight's codes [E, n, k] with block scales [E n / 128][round_up(k / 128, 4)] (128 x 128
// blocks of each expert: H and I multiples of 128); gate, up, act bf16 as above; act_q [N, I]
// and act_scale [I / 128][N]: scratch for act quantized per 1 x 128 tile, the down GEMM's
// input. Hopper only: returns false, launching nothing, elsewhere.
// ops::grouped_wgrad_fp8 on Hopper: dw [E, M, Nc] f32 = (or +=) the sum over the n sources
// (at most kFp8WgradMaxSources) and each expert's tiles [first_tile[e], first_tile[e + 1]) of
// a_t's and b_t's columns (codes [M, P], [Nc, P], scales [P / 128][M], [P / 128][Nc]);
// counters: 2 ints of scratch. False where the Hopper kernels can't run.
struct Fp8WgradSource {
  const uint8_t* a_q;
  const float* a_scale;
  const uint8_t* b_q;
  const float* b_scale;
  int64_t P;
  const int* first_tile;  // [E + 1]
};
constexpr int kFp8WgradMaxSources = 4;  // ops::kFp8WgradSourcesPerPass
bool launch_grouped_wgrad_fp8(const Fp8WgradSource* src, int n, int64_t M, int64_t Nc, int E, float* dw,
                              bool accumulate, int* counters, cudaStream_t stream);
bool launch_swiglu_forward_fp8(const uint8_t* x_q, const float* x_scale, const int64_t* counts, const uint8_t* wg_q,
                               const float* wg_scale, const uint8_t* wu_q, const float* wu_scale, const uint8_t* wd_q,
                               const float* wd_scale, int64_t N, int H, int I, int E, void* gate, void* up, void* act,
                               uint8_t* act_q, float* act_scale, void* y, int32_t* workspace, cudaStream_t stream);
// The input gradient in FP8 (issue 30): dy per 1 x 128 tile, each expert's W^T per 128 x 128
// block (ops::transpose_fp8_experts: wgt, wut [E H, I], wdt [E I, H]); da = dy Wd with dgate
// and dup (bf16, also kept for the weight gradients) in its epilogue, then both quantized per
// 1 x 128 tile into dgate_q/dup_q and their scales ([I / 128][N]) and dx = dgate Wg + dup Wu.
// false where the Hopper kernels cannot run (nothing launched).
bool launch_swiglu_backward_input_fp8(const uint8_t* dy_q, const float* dy_scale, const int64_t* counts,
                                      const void* gate, const void* up, const uint8_t* wgt_q, const float* wgt_scale,
                                      const uint8_t* wut_q, const float* wut_scale, const uint8_t* wdt_q,
                                      const float* wdt_scale, int64_t N, int H, int I, int E, void* dgate, void* dup,
                                      uint8_t* dgate_q, float* dgate_scale, uint8_t* dup_q, float* dup_scale, void* dx,
                                      int32_t* workspace, cudaStream_t stream);
// da = dy Wd[e] with dgate/dup in its epilogue; dx = dgate Wg[e] + dup Wu[e] (one launch).
void launch_swiglu_backward_input(const void* dy, const int64_t* counts, const void* gate, const void* up,
                                  const void* w_gate, const void* w_up, const void* w_down, int64_t N, int H, int I,
                                  int E, void* dgate, void* dup, void* dx, int32_t* workspace, cudaStream_t stream);
// dWd[e] += dy_e^T act_e (act_ready: act [N, I] holds the forward's activations; else it is
// scratch that silu(gate) * up is computed into first);
// dWg[e] += dgate_e^T x_e and dWu[e] += dup_e^T x_e (one launch). f32 dW. With
// accumulate false, = instead of += (an expert without rows gets zeros), and then, when
// squares_result is given, *squares_result = the sum of the squares of the three
// gradients as written (Hopper: from the tiles still in registers, one double per block
// in squares_scratch, summed in block order; elsewhere a pass over the gradients).
void launch_swiglu_backward_weight(const void* dy, const void* x, const int64_t* counts, const void* gate,
                                   const void* up, const void* dgate, const void* dup, int64_t N, int H, int I,
                                   int E, void* act, bool act_ready, float* dw_gate, float* dw_up, float* dw_down,
                                   bool accumulate, int32_t* workspace, double* squares_scratch,
                                   double* squares_result, cudaStream_t stream);
// Doubles of squares_scratch that launch_swiglu_backward_weight needs.
int64_t swiglu_squares_scratch_doubles(int H, int I, int E);

// One micro-batch's rows for launch_swiglu_backward_weight_group: dy [N, H], x [N, H],
// dgate, dup and the forward's act [N, I]; a workspace of swiglu_workspace_words(N, E).
struct SwigluWgradSource {
  const void *dy, *x, *dgate, *dup, *act;
  const int64_t* counts;
  int64_t N;
  int32_t* workspace;
};
// dW (+)= the weight gradients of the n sources (2 <= n <= swiglu_wgrad_group_max(), each with
// rows) in one pass: each tile's k loop runs over the first source's rows of its expert, then
// the next source's, ..., so f32 dW is written (or added to) once. Hopper only: returns false,
// launching nothing, where it does not apply (the caller then makes one call per source).
// With accumulate false and squares_result given: *squares_result = the sum of the squares of
// the gradients written, from the tiles in registers (squares_scratch: as for
// launch_swiglu_backward_weight).
bool launch_swiglu_backward_weight_group(const SwigluWgradSource* src, int n, int H, int I, int E, float* dw_gate,
                                         float* dw_up, float* dw_down, bool accumulate, double* squares_scratch,
                                         double* squares_result, cudaStream_t stream);
int swiglu_wgrad_group_max();

}  // namespace moetrain::ops::cuda
