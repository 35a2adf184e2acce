// The FP8 (e4m3) quantization's arithmetic on the device, one place for every kernel that
// quantizes (fp8.cu's quantizers, the expert GEMMs' fused epilogues): a tile's scale is its
// amax / 448 (IEEE division; 1 for an all-zero tile) and a code is cvt.rn.satfinite.e4m3 of
// x / scale, the bits of the CPU reference (ops/cpu/fp8.cpp).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace moetrain::ops::cuda::fp8 {

__device__ __forceinline__ float tile_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }
__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace moetrain::ops::cuda::fp8
