// Launchers of the weighted-combine kernels (combine.cu); the host wrapper is combine.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// y [T, H] = residual [T, H] (nullptr: 0) + sum_k weight[t, k] * expert_out[r(t, k)], r(t, k)
// = order[t*K + k] (nullptr: t*K + k; rows outside [0, R), R expert_out's rows, are
// skipped: absent slots); expert_out, residual and y bf16 (is_bf16) or f32; weight f32 [T, K].
void launch_combine_forward(const void* expert_out, const float* weight, const void* residual, const int32_t* order,
                            int64_t T, int K, int64_t R, int64_t H, void* y, bool is_bf16, cudaStream_t stream);
// dexpert_out's e4m3 codes [R, H] and their scales [H / 128][R] (quantize_fp8's rows mode).
struct Fp8Codes {
  uint8_t* q;
  float* scale;
};
// dexpert_out[r(t, k)] = weight[t, k] * dy[t]; dweight[t, k] = <dy[t], expert_out[r(t, k)]>
// (f32, summed in a fixed order; 0 for absent slots). With codes.q (bf16, H % 128 == 0), also
// dexpert_out's codes, the bits quantize_fp8 makes of it, when the vectorized kernel runs
// (16-byte aligned rows): returns whether it wrote them.
bool launch_combine_backward(const void* dy, const void* expert_out, const float* weight, const int32_t* order,
                             int64_t T, int K, int64_t R, int64_t H, void* dexpert_out, float* dweight, bool is_bf16,
                             Fp8Codes codes, cudaStream_t stream);

}  // namespace moetrain::ops::cuda
