// Launcher of the RoPE kernel (rope.cu): bf16 [T, W] with W = heads * head_dim.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// Rotate-half RoPE by +angle (sign = +1, forward) or -angle (sign = -1, backward), with
// angle = float(pos) * inv_freq[i] and inv_freq[i] = 1 / theta^(2i / head_dim), all in f32
// as Hugging Face computes them.
void launch_rope(const __nv_bfloat16* x, const int32_t* positions, __nv_bfloat16* y, int64_t T, int64_t W,
                 int64_t head_dim, float theta, float sign, cudaStream_t s);

}  // namespace moetrain::ops::cuda
