// Device-side helpers for the CUDA kernels (.cu files): bf16 conversions and warp/block
// reductions. Kernel sources include no fmt-based header (nvcc cannot compile fmt's
// consteval checks): each op family's host wrapper (.cpp) checks shapes, allocates and
// reports errors, and calls the plain launchers its .cu file defines.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::ops::cuda {

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// RoPE's cos and sin for pair i of a head of head_dim hd at position pos, as Hugging Face
// forms them in f32: inv_freq = 1 / theta^(2i/hd) (f32 pow), angle = pos * inv_freq, and the
// full-range sincosf (angles reach tens of thousands of radians). One rule for rope.cu and
// the one-pass norm + RoPE of rmsnorm.cu, so that both give the same rotation.
__device__ __forceinline__ void rope_cos_sin(float pos, int i, int hd, float theta, float* c, float* s) {
  const float inv_freq = 1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(hd));
  sincosf(pos * inv_freq, s, c);
}

// The multiprocessor this thread runs on (%smid: stable while the block runs; used to
// look the multiprocessor up in the L2 half map, l2_halves.h).
__device__ __forceinline__ unsigned sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return fmax(a, b); }  // NaN-dropping, as fmaxf
};

// Butterfly reduction over the warp; every lane gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduction over a 1-D block (blockDim.x a multiple of 32, at most 1024) in a fixed tree
// order, so the result is bitwise reproducible; every thread gets it. `identity` pads the
// unused warp slots.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity) {
  __shared__ T partial[32];
  __shared__ T total;
  v = warp_reduce(v, op);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : identity;
    w = warp_reduce(w, op);
    if (lane == 0) total = w;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, MaxOp{}); }
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp{}, 0.f); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp{}, -INFINITY); }
__device__ __forceinline__ double block_sum_double(double v) { return block_reduce(v, SumOp{}, 0.0); }

}  // namespace moetrain::ops::cuda
