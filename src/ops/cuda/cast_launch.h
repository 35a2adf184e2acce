// Launchers of the dtype-conversion kernels (see cast.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {
void launch_cast_f32_to_bf16(__nv_bfloat16* dst, const float* src, int64_t n, cudaStream_t s);
void launch_cast_bf16_to_f32(float* dst, const __nv_bfloat16* src, int64_t n, cudaStream_t s);
}  // namespace moetrain::ops::cuda
