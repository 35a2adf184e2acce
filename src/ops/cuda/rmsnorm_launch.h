// Launchers of the RMSNorm kernels (rmsnorm.cu). x, dy, w, y and dx are bf16; rstd and
// dw are f32. Rows are [R, D] with D = w's length (D = hidden, or head_dim for q/k norm).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// rstd[r] = 1 / sqrt(mean(x[r]^2) + eps); y = x * rstd * w. With q, y also quantized per
// 1 x 128 tile in the same pass where the kernel can (16-byte rows, D a multiple of 128):
// codes q [R, D], scales qscale [D / 128, R] (ops.h's rows mode). Returns whether it did (q
// and qscale untouched otherwise).
bool launch_rmsnorm_forward(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, float* rstd,
                            int64_t R, int64_t D, float eps, cudaStream_t s, uint8_t* q = nullptr,
                            float* qscale = nullptr);
// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)).
// residual: nullptr, or [R, D] added to dx before it is rounded.
void launch_rmsnorm_backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                   const float* rstd, const __nv_bfloat16* residual, __nv_bfloat16* dx, int64_t R,
                                   int64_t D, cudaStream_t s);
// Floats of device scratch launch_rmsnorm_backward_weight needs.
int64_t rmsnorm_backward_weight_scratch_floats(int64_t R, int64_t D);
// dw += sum_r dy[r] * x[r] * rstd[r], in two deterministic passes.
void launch_rmsnorm_backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, const float* rstd, float* dw,
                                    int64_t R, int64_t D, float* scratch, cudaStream_t s);

// Per-head norm then RoPE (ops.h's rmsnorm_rope_*), one pass, for rows of head_dim = D = 128
// with 16-byte aligned x, w and y/dx: rmsnorm_rope_fusable says when. positions: i32 [R / heads].
bool rmsnorm_rope_fusable(const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* y, int64_t D,
                          int64_t head_dim);
void launch_rmsnorm_rope_forward(const __nv_bfloat16* x, const __nv_bfloat16* w, const int32_t* positions,
                                 __nv_bfloat16* y, float* rstd, int64_t R, int64_t heads, float eps, float theta,
                                 cudaStream_t s);
// Floats of device scratch launch_rmsnorm_rope_backward needs.
int64_t rmsnorm_rope_backward_scratch_floats(int64_t R);
// dx, and dw += sum_r rope_backward(dy)[r] * x[r] * rstd[r] (two deterministic passes);
// dy bf16, or f32 (the attention backward's one-pass dQ sums, read as they are).
void launch_rmsnorm_rope_backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                  const float* rstd, const int32_t* positions, __nv_bfloat16* dx, float* dw,
                                  int64_t R, int64_t heads, float theta, float* scratch, cudaStream_t s);
void launch_rmsnorm_rope_backward(const float* dy, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                  const float* rstd, const int32_t* positions, __nv_bfloat16* dx, float* dw,
                                  int64_t R, int64_t heads, float theta, float* scratch, cudaStream_t s);

}  // namespace moetrain::ops::cuda
