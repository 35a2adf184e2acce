// Stochastic rounding of f32 to bf16 for optimizer state kept in bf16 (AdamW moments with
// [optimizer].moments = "bf16"). Round-to-nearest would drop every update smaller than half
// a bf16 ulp (2^-9 relative): with beta2 = 0.999 the second moment moves by 0.1% a step and
// would stall. Rounding up with probability equal to the discarded fraction keeps each
// stored value unbiased. The random bits are a hash of (element index, step, stream), not a
// generator's state (the index: the element's place in the moments' flat buffer, the same
// however the update is cut into launches), so a rerun or a resumed run rounds exactly the
// same way. Shared by the CPU reference and the CUDA kernel (host and device functions).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MT_HOST_DEVICE inline
#endif

namespace moetrain::ops {

// 32 well-mixed bits of (index, step, stream) (a murmur3-style finalizer).
MT_HOST_DEVICE uint32_t rounding_bits(int64_t index, int64_t step, uint32_t stream) {
  const uint64_t i = static_cast<uint64_t>(index);
  uint32_t h = static_cast<uint32_t>(i ^ (i >> 32)) * 0x9E3779B1u;
  h ^= static_cast<uint32_t>(step) * 0x85EBCA77u + stream * 0xC2B2AE3Du;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

// The bf16 bits of the f32 with bits `f`, rounded away from zero with probability (the 16
// discarded bits) / 2^16 using the low 16 bits of `random`. Infinities and NaN are kept.
MT_HOST_DEVICE uint16_t bf16_bits_stochastic(uint32_t f, uint32_t random) {
  if ((f & 0x7F800000u) == 0x7F800000u) {
    return static_cast<uint16_t>((f >> 16) | ((f & 0x7FFFFFFFu) > 0x7F800000u ? 0x40u : 0u));
  }
  return static_cast<uint16_t>((f + (random & 0xFFFFu)) >> 16);
}

}  // namespace moetrain::ops
