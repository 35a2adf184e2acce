// Device helpers of the MoE kernels (router, permutation, grouped SwiGLU): a block-wide
// prefix sum, cp.async copies, ldmatrix loads and the bf16 tensor-core MMA (sm_80+
// instructions, which Hopper runs too), and 8-wide bf16/f32 vector loads.
// Only CUDA headers here: .cu files include it (nvcc cannot compile fmt). Everything is in
// namespace moe, so these inline definitions never meet same-named helpers of other kernel
// families (vec_io.cuh has its own load8/store8) in one namespace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moetrain::ops::cuda::moe {

// ---- block-wide exclusive prefix sum ---------------------------------------------------
// Replaces data[0..n) (shared or global memory) by its exclusive prefix sum, in index order
// (so the result is deterministic), and returns the total to every thread. Every thread of
// the block must call it; blockDim.x a multiple of 32, at most 1024; scratch is 33 T of
// shared memory. Ends with a barrier when n > 0. T: int or long long.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T* data, int n, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  T carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const T v = i < n ? data[i] : T(0);
    T x = v;  // inclusive scan within the warp
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
      const T w = lane < nwarps ? scratch[lane] : T(0);
      T wx = w;
      for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, wx, o);
        if (lane >= o) wx += y;
      }
      if (lane < nwarps) scratch[lane] = wx - w;  // exclusive offset of each warp
      if (lane == 31) scratch[32] = wx;           // total of this chunk
    }
    __syncthreads();
    if (i < n) data[i] = carry + scratch[warp] + x - v;
    carry += scratch[32];
    __syncthreads();  // scratch is reused by the next chunk
  }
  return carry;
}

// ---- cp.async (global -> shared, 16 bytes, L2 only) -----------------------------------
// Copies 16 bytes, or writes 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- ldmatrix: four 8x8 b16 matrices; lane l gives the row address of matrix l/8 -------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// ---- D = A B + D, m16n8k16, bf16 inputs, f32 accumulators ------------------------------
// a: 16x16 row-major fragment (4 regs), b: 16x8 "col" fragment (2 regs), d: 4 floats
// (rows lane/4 and lane/4 + 8, columns 2*(lane%4) and +1).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- 8 consecutive elements as floats (16-byte bf16 or 2 x 16-byte f32 accesses) -------
// p must be aligned to 8 elements.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
  uint4 u;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

}  // namespace moetrain::ops::cuda::moe
