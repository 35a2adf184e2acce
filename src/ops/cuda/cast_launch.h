// Launchers of the dtype-conversion kernels (see cast.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {
void launch_cast_f32_to_bf16(__nv_bfloat16* dst, const float* src, int64_t n, cudaStream_t s);
void launch_cast_bf16_to_f32(float* dst, const __nv_bfloat16* src, int64_t n, cudaStream_t s);
// Split f32 masters (ops/adamw_math.h).
void launch_master_join(float* master, const uint16_t* high, const int16_t* low, int64_t n, cudaStream_t s);
void launch_master_split(const float* master, uint16_t* high, int16_t* low, int64_t n, cudaStream_t s);
}  // namespace moetrain::ops::cuda
