// The FP8 (e4m3) quantization's arithmetic on the device, one place for every kernel that
// quantizes (fp8.cu's quantizers, the expert GEMMs' fused epilogues): a tile's scale is its
// amax / 448 (IEEE division; 1 for an all-zero tile) and a code is cvt.rn.satfinite.e4m3 of
// x / scale, the bits of the CPU reference (ops/cpu/fp8.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace moetrain::ops::cuda::fp8 {

__device__ __forceinline__ float tile_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }
__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Division by a tile's scale, correctly rounded (the bits of IEEE x / s), for kernels whose
// arithmetic rather than their memory traffic the divisions would bound (one that quantizes
// every element twice, along both dimensions): CUDA's x / s is a subroutine of ~10
// instructions with a range check and a branch. Here the tile's reciprocal r = RN(1 / s) is
// made once (one IEEE division) and each quotient takes three instructions: q = RN(x r) is
// within an ulp of x / s, the remainder x - q s is exact in one FMA, and RN(q + rem r) is
// RN(x / s) (Markstein's theorem: r within half an ulp of 1 / s, q faithful, no underflow
// or overflow). That holds for scales in [2^-90, 2^100]: |x| <= 448 s there, so a remainder
// that underflows belongs to a quotient below 2^-13, a zero code either way; other scales
// (tiles of subnormals, infinite or NaN amax) divide as IEEE does. The sign is copied from x
// so that -0 / s stays -0. Measured on an H100 (2026-12-07) over every bf16 value against a
// spread of scales (BackendFp8.QuantizerCodesMatchTheCpuOverEveryBf16Value, with the rows
// quantizer built on it): the CPU's codes. In the memory-bound kernels it was measured in it
// saved nothing (the rows quantizer of then 1.65 TB/s either way, the combine's backward with
// codes the same), so those divide; quantize_tiles_kernel (every one-pass mode, the rows
// quantizer's among them) takes it for one code path.
struct ScaleDivisor {
  float s, r;
  bool fast;
  __device__ __forceinline__ explicit ScaleDivisor(float scale)
      : s(scale), r(1.f / scale), fast(scale >= 0x1p-90f && scale <= 0x1p100f) {}
  __device__ __forceinline__ float quotient(float x) const {
    if (!fast) return x / s;
    const float q = x * r;
    const float rem = fmaf(-q, s, x);
    return copysignf(fmaf(rem, r, q), x);
  }
  __device__ __forceinline__ uint8_t code(float x) const { return to_e4m3(quotient(x)); }
};

__device__ __forceinline__ unsigned lane_id() {
  return (threadIdx.z * blockDim.y * blockDim.x + threadIdx.y * blockDim.x + threadIdx.x) & 31u;
}
// The amax of a 1 x 128 tile held by the 16 lanes of an aligned half-warp, 8 values a lane:
// this lane's, then four shuffles within the half (which must be converged here).
__device__ __forceinline__ float half_warp_amax(const float (&f)[8]) {
  const unsigned half = 0xffffu << (lane_id() & 16u);
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(f[k]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, o));
  return amax;
}
// This lane's 8 codes of a 1 x 128 tile held by a half-warp (f: the values, already rounded
// to bf16; s: the tile's scale), stored at q at once; s at *scale by the half's first lane.
__device__ __forceinline__ void store_half_warp_codes(const float (&f)[8], float s, uint8_t* q, float* scale) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    lo |= static_cast<uint32_t>(to_e4m3(f[k] / s)) << (8 * k);
    hi |= static_cast<uint32_t>(to_e4m3(f[k + 4] / s)) << (8 * k);
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(lo, hi);
  if ((lane_id() & 15u) == 0) *scale = s;
}

// One 1 x 128 tile of a bf16 row held by the 16 lanes of an aligned half-warp, 8 columns a
// lane (f: this lane's values before their bf16 rounding), quantized as quantize_fp8's rows
// mode quantizes the stored bf16 row: the tile's amax by four shuffles within the half, the
// 8 codes stored at q at once, the scale at *scale by the half's first lane. The half-warp
// must be converged here (its 16 lanes all inside the row or all past it: rows a multiple
// of 128 long); f is left holding the rounded values. For the kernels that write a bf16 row
// and its codes in one pass (the norm, the combine's backward).
__device__ __forceinline__ void quantize_half_warp_tile(float (&f)[8], uint8_t* q, float* scale) {
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = __bfloat162float(__float2bfloat16_rn(f[k]));
  store_half_warp_codes(f, tile_scale(half_warp_amax(f)), q, scale);
}

}  // namespace moetrain::ops::cuda::fp8
