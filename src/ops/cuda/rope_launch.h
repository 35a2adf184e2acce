// Launcher of the RoPE kernel (rope.cu): bf16 [T, W] with W = heads * head_dim.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// RopeSpec in the kernel's terms. inv_freq holds the given frequencies (given_freqs), else
// inv_freq[i] = 1 / theta^(2i / head_dim) in f32 as Hugging Face computes them.
struct RopeArgs {
  static constexpr int kMaxPairs = 128;
  int head_dim = 0, stride = 0;
  float theta = 0, scale = 1;
  bool interleaved = false, given_freqs = false;
  float inv_freq[kMaxPairs] = {};
};

// RoPE by +angle (sign = +1, forward) or -angle (sign = -1, backward) of x [T, W], W a
// multiple of a.stride; angle = float(pos) * inv_freq[i] in f32.
void launch_rope(const __nv_bfloat16* x, const int32_t* positions, __nv_bfloat16* y, int64_t T, int64_t W,
                 const RopeArgs& a, float sign, cudaStream_t s);

}  // namespace moetrain::ops::cuda
