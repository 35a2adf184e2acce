// Hopper (sm_90a) device primitives shared by the TMA + wgmma kernels (grouped SwiGLU,
// attention backward): shared-memory mbarriers, TMA tensor and bulk copies, 128-byte-swizzle
// matrix descriptors, the warpgroup MMAs and the FP8 fresh sums (a k-tile of 128, waited for
// its promotion). Every function here exists only when compiling for sm_90a (MT_SM90A);
// kernels guard their bodies with the same macro, so the portable targets compile them as
// empty stubs that the host never launches (see tensor_map.h).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MT_SM90A 1
#else
#define MT_SM90A 0
#endif

namespace moetrain::ops::cuda::sm90 {

#if MT_SM90A
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// Makes the barrier inits visible to the copy engine; then a __syncthreads.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const void* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// A plain contiguous copy global -> shared (bytes a multiple of 16, both ends 16-byte aligned).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// The box at src (laid out as tma_load_2d writes one) to the tensor at coordinates (c0, c1);
// the parts of a box past the tensor's end are not written. Then cp.async.bulk.commit_group,
// and cp.async.bulk.wait_group.read before src is written again.
__device__ __forceinline__ void tma_store_2d(const void* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand (tiles 1024-byte aligned),
// as TMA writes a box whose inner dimension is 64 bf16. sbo: bytes between groups of 8 rows
// (K-major) or 8 k (MN-major): 1024 for such boxes. lbo: MN-major only, bytes between the
// 64-element column blocks along M or N (ignored for K-major). A k16 step moves the start by
// 32 bytes (K-major) or by 16 rows = 2048 bytes (MN-major).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

// A barrier among `threads` threads of the block (a multiple of 32) on barrier id (1..15;
// 0 is __syncthreads'), e.g. the two consumer warpgroups without the producer.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later reads of the async proxy
// (wgmma operands, TMA stores); a barrier then passes that on to the other threads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma fence/wait.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of the wgmma wrappers below: "+f"(d[0]) .. "+f"(d[N - 1]), which
// their asm names %0 .. %N-1.
#define MT_WGMMA_D8(d, i)                                                                      \
  "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]),        \
      "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define MT_WGMMA_D32(d) MT_WGMMA_D8(d, 0), MT_WGMMA_D8(d, 8), MT_WGMMA_D8(d, 16), MT_WGMMA_D8(d, 24)
#define MT_WGMMA_D64(d) \
  MT_WGMMA_D32(d), MT_WGMMA_D8(d, 32), MT_WGMMA_D8(d, 40), MT_WGMMA_D8(d, 48), MT_WGMMA_D8(d, 56)
#define MT_WGMMA_D128(d)                                                                          \
  MT_WGMMA_D64(d), MT_WGMMA_D8(d, 64), MT_WGMMA_D8(d, 72), MT_WGMMA_D8(d, 80), MT_WGMMA_D8(d, 88), \
      MT_WGMMA_D8(d, 96), MT_WGMMA_D8(d, 104), MT_WGMMA_D8(d, 112), MT_WGMMA_D8(d, 120)

// Accumulator layout of every m64nN wgmma below (per warpgroup): warp w, lane l holds rows
// 16w + l/4 (h = 0) and 16w + l/4 + 8 (h = 1); d[4j + 2h + c] is column 8j + 2(l%4) + c.
// A register fragment (RS forms) for a 16-wide k chunk: the same rows, {a0, a1} columns
// 2(l%4).. of the chunk's first 8, {a2, a3} of its second 8, rows l/4 for a0/a2 and
// l/4 + 8 for a1/a3 (two bf16 per register, the lower column in the low half).

// D[64 x 128] += A[64 x 16] B[16 x 128], both from shared memory (descriptors); kTransA /
// kTransB: the operand is MN-major in shared memory (K-major otherwise).
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, 1, 1, 1, %66, %67;\n"
      "}\n"
      : MT_WGMMA_D64(d)
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// D[64 x 256] += A[64 x 16] B[16 x 256], both from shared memory (the accumulator layout
// above, 32 column blocks of 8).
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, 1, 1, 1, %130, %131;\n"
      "}\n"
      : MT_WGMMA_D128(d)
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// D[64 x 128] (+)= A[64 x 32] B[32 x 128] with e4m3 operands, both K-major in shared memory
// (the FP8 forms have no transposed operands); a k32 step moves the start by 32 bytes. With
// accumulate 0, D = A B (a fresh sum: the first k step of a scale block).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : MT_WGMMA_D64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The same with A from registers (the RS form): a[0..3] are the k32 step's A fragment of
// this thread, four e4m3 a register: rows 16 w + l / 4 (a0, a2) and + 8 (a1, a3), bytes
// 4 (l % 4) .. + 3 of the step's first 16 (a0, a1) and of its second 16 (a2, a3), as
// ldmatrix_a_e4m3 loads them. Shared memory then feeds B alone.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                         int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : MT_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// The RS form's A fragment of k32 step kk from a warpgroup's 64 K-major rows of e4m3 codes
// at `tile` (128-byte rows, 16-byte chunks swizzled by row % 8, as TMA writes them): four
// 8 x 16-byte matrices (rows +0 / +8, the step's two 16-byte chunks), one ldmatrix.
__device__ __forceinline__ void ldmatrix_a_e4m3(uint32_t (&a)[4], uint32_t tile, int kk) {
  const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
  const int r = 16 * w + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = 2 * kk + (lane >> 4);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(tile + r * 128 + ((chunk ^ (r & 7)) << 4)));
}

// One k-tile's fresh sum in FP8 of a consumer warpgroup's 64 K-major rows of A (at a) and 128
// K-major rows of B (at b), both 128 codes deep in 128-byte swizzled rows: four k32 MMAs,
// waited for, since the promotion (every 128 of K, DeepSeek-V3's) reads it next.
__device__ __forceinline__ void fp8_fresh_sum(float (&part)[64], uint32_t a, uint32_t b) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_m64n128k32_e4m3(part, sw128_desc(a + kk * 32, 16, 1024), sw128_desc(b + kk * 32, 16, 1024), kk);
  }
  wgmma_commit();
  wgmma_wait<0>();
  pin(part);
}
// The same with A's fragments in registers (loaded once a k-tile for both halves).
__device__ __forceinline__ void fp8_fresh_sum_rs(float (&part)[64], const uint32_t (&af)[4][4], uint32_t b) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k32_e4m3_rs(part, af[kk], sw128_desc(b + kk * 32, 16, 1024), kk);
  wgmma_commit();
  wgmma_wait<0>();
  pin(part);
}

// Warp-specialised kernels: a warpgroup gives registers back (the producer, which only
// issues copies) or takes them (the consumers, whose accumulators need them). Every warp of
// the warpgroup executes it; the counts are per thread, multiples of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// D[64 x 64] += A[64 x 16] B[16 x 64], both from shared memory.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, 1, 1, 1, %34, %35;\n"
      "}\n"
      : MT_WGMMA_D32(d)
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// D[64 x 64] += A[64 x 16] B[16 x 64], A from registers, B from shared memory (kTransB: MN-major).
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, %37;\n"
      "}\n"
      : MT_WGMMA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A from registers (the fragment above), B from
// shared memory; kTransB: B is MN-major.
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, 1, 1, 1, %69;\n"
      "}\n"
      : MT_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB));
}
#endif  // MT_SM90A

}  // namespace moetrain::ops::cuda::sm90
