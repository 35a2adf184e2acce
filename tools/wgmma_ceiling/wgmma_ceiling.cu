// wgmma_ceiling: what the tensor cores give the experts' FP8 main loop when nothing else is in
// the way. Development tool (docs/fp8.md, session 35), not linked into moetrain.
//
// fp8_rows_kernel (ops/cuda/swiglu.cu) runs at ~620 TFLOP/s on an H100, a third of the FP8
// dense peak, and Nsight shows it neither memory- nor issue-bound. Each variant here is its
// main loop with the operands already in shared memory (no TMA, no epilogue, no producer): a
// block of two consumer warpgroups per SM (two blocks for the 128 x 128 tile) walking `iters`
// k-tiles of a 4-stage ring that never changes. What a variant reaches is the ceiling of
// that loop's structure; the gaps between variants price each structural choice:
//   bf16       the BF16 rows kernel's loop: 64 x 256 a warpgroup, m64n256k16, one running sum
//   fp8_acc    FP8 with no promotion: 8 x m64n128k32 a k-tile into the running sums (the
//              recipe forbids it: the ceiling of FP8 on this tile)
//   fp8_halves today's loop: each 128-column half a fresh sum (4 x k32), waited for, then
//              scaled into the running sums (DeepSeek-V3's promotion every 128 of K); x1wg
//              one warpgroup alone (what a ping-pong kernel's main loop gets while the other
//              warpgroup is in its epilogue)
//   fp8_128    the same with a 64 x 128 tile a warpgroup (fresh 64 + running 64 registers):
//              x2blk two blocks of two warpgroups an SM (128 registers a thread: ptxas
//              spills a few), x3wg one block of three (a 192 x 128 tile): more warpgroups to
//              hide each other's promotions
//   rs_halves  fp8_halves with A from registers (ldmatrix once a k-tile): shared memory
//              feeds only B
//   rs_quarters / ss_quarters  64-column quarters into two fresh sums, each promoted while
//              the next quarter's MMAs run (A from registers / from shared memory)
// FLOPs: 2 x 128 x 256 x 128 a k-tile a block (64 deep for bf16; 64 wgs x 128 for fp8_128).
//
//   wgmma_ceiling [iters]        (one Hopper GPU; prints TFLOP/s per variant)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "ops/cuda/hopper.cuh"

namespace {
using namespace moetrain::ops::cuda::sm90;

enum Variant { kBf16, kFp8Acc, kFp8Halves, kFp8Tile128, kRsHalves, kRsQuarters, kSsQuarters };
constexpr const char* kNames[] = {"bf16", "fp8_acc", "fp8_halves", "fp8_128", "rs_halves", "rs_quarters", "ss_quarters"};
constexpr int kStages = 4;  // the ring's stages (3 where two blocks must share an SM)

#if MT_SM90A
// The e4m3 m64n64k32 forms the quarters need (hopper.cuh has the m64n128k32 ones): A from
// shared memory (a descriptor) or from registers (ldmatrix_a_e4m3's fragment), B K-major.
__device__ __forceinline__ void ss_n64(float (&d)[32], uint64_t da, uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : MT_WGMMA_D32(d)
      : "l"(da), "l"(db), "r"(acc));
}
__device__ __forceinline__ void rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : MT_WGMMA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

// The promotion: a fresh sum times its row's and block's scales into the running sums
// (part[4 j + 2 h + c]: h picks the row, so the scale alternates in pairs).
template <int N>
__device__ __forceinline__ void promote(float* acc, const float (&part)[N], float s0, float s1) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] += part[i] * ((i & 2) ? s1 : s0);
}
#endif

// kWgs consumer warpgroups of 64 rows each (A: 64 kWgs rows, then B at a_bytes).
template <int V, int kMinBlocks, int kWgs>
__global__ void __launch_bounds__(128 * kWgs, kMinBlocks)
    ceiling_kernel(int iters, int stages, int stage_bytes, float* out) {
#if MT_SM90A
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  // Operands: e4m3 bytes (and bf16 pairs) of small magnitude, no NaN (clear bit 7 and bit 3 of
  // the exponent), varied so that the tensor cores' power is that of real data.
  for (int i = threadIdx.x; i < stages * stage_bytes / 4; i += blockDim.x) {
    uint32_t h = i * 2654435761u + 12345u;
    h ^= h >> 13;
    reinterpret_cast<uint32_t*>(smem)[i] = h & 0x37373737u;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int cw = threadIdx.x >> 7;
  const uint32_t base = smem_u32(smem);
  float wide[V == kBf16 ? 128 : 1];  // bf16's running sums (m64n256)
  constexpr int kHalves = V == kFp8Tile128 ? 1 : 2;
  float acc[kHalves][64];  // FP8's, a 128-column half each
#pragma unroll
  for (int i = 0; i < (V == kBf16 ? 128 : 1); ++i) wide[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 64 * kHalves; ++i) acc[i / 64][i % 64] = 0.f;
  uint32_t frags[4][4];
  for (int kt = 0; kt < iters; ++kt) {
    const uint32_t st = base + (kt % stages) * stage_bytes;
    const uint32_t a = st + cw * 64 * 128, b = st + kWgs * 8192;
    const float s0 = 1.f + kt * 1e-9f, s1 = 1.f - kt * 1e-9f;  // the scales of a real k-tile
    if constexpr (V == kBf16) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_m64n256k16<0, 0>(wide, sw128_desc(a + kk * 32, 16, 1024), sw128_desc(b + kk * 32, 16, 1024));
      }
      wgmma_commit();
      wgmma_wait<1>();
      pin(wide);
    } else if constexpr (V == kFp8Acc) {
      wgmma_fence();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n128k32_e4m3(acc[half], sw128_desc(a + kk * 32, 16, 1024),
                                sw128_desc(b + half * 16384 + kk * 32, 16, 1024), 1);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
#pragma unroll
      for (int h = 0; h < kHalves; ++h) pin(acc[h]);
    } else if constexpr (V == kFp8Halves || V == kRsHalves) {
      if constexpr (V == kRsHalves) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldmatrix_a_e4m3(frags[kk], a, kk);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float part[64];  // fp8_rows_kernel's k-tile, half by half
        if constexpr (V == kRsHalves) {
          fp8_fresh_sum_rs(part, frags, b + half * 16384);
        } else {
          fp8_fresh_sum(part, a, b + half * 16384);
        }
        promote(acc[half], part, s0, s1);
      }
    } else if constexpr (V == kFp8Tile128) {
      float part[64];
      fp8_fresh_sum(part, a, b);
      promote(acc[0], part, s0, s1);
    } else {  // quarters: q into pa / pb alternately, each promoted under the next one's MMAs
      constexpr bool kRs = V == kRsQuarters;
      if constexpr (kRs) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldmatrix_a_e4m3(frags[kk], a, kk);
      }
      float pa[32], pb[32];
      auto issue = [&](float(&p)[32], int q) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t db = sw128_desc(b + q * 8192 + kk * 32, 16, 1024);
          if constexpr (kRs) {
            rs_n64(p, frags[kk], db, kk);
          } else {
            ss_n64(p, sw128_desc(a + kk * 32, 16, 1024), db, kk);
          }
        }
        wgmma_commit();
      };
      issue(pa, 0);
      issue(pb, 1);
      wgmma_wait<1>();
      pin(pa);
      promote(&acc[0][0], pa, s0, s1);
      issue(pa, 2);
      wgmma_wait<1>();
      pin(pb);
      promote(&acc[0][32], pb, s0, s1);
      issue(pb, 3);
      wgmma_wait<1>();
      pin(pa);
      promote(&acc[1][0], pa, s0, s1);
      wgmma_wait<0>();
      pin(pb);
      promote(&acc[1][32], pb, s0, s1);
    }
  }
  wgmma_wait<0>();
  pin(wide);
#pragma unroll
  for (int h = 0; h < kHalves; ++h) pin(acc[h]);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < (V == kBf16 ? 128 : 1); ++i) sum += wide[i];
#pragma unroll
  for (int i = 0; i < 64 * kHalves; ++i) sum += acc[i / 64][i % 64];
  if (sum == 12345.f) out[threadIdx.x] = sum;  // keeps the loop alive
#endif
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "wgmma_ceiling: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int V, int kMinBlocks, int kWgs = 2>
void run(int sms, int iters, float* out, double peak_fp8, double peak_bf16) {
  const int stage_bytes = kWgs * 8192 + (V == kFp8Tile128 ? 16384 : 32768);
  const int stages = kMinBlocks > 1 ? 3 : kStages;  // two blocks of 4 x 32 KB would not fit an SM
  const int smem = stages * stage_bytes + 1024;
  auto kernel = ceiling_kernel<V, kMinBlocks, kWgs>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem attribute");
  int resident = 0;  // blocks an SM holds at once: the variant means what it says only at kMinBlocks
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, 128 * kWgs, smem), "occupancy");
  const int blocks = sms * kMinBlocks;
  kernel<<<blocks, 128 * kWgs, smem>>>(iters, stages, stage_bytes, out);  // warm-up
  check(cudaGetLastError(), kNames[V]);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(t0);
    kernel<<<blocks, 128 * kWgs, smem>>>(iters, stages, stage_bytes, out);
    cudaEventRecord(t1);
    check(cudaEventSynchronize(t1), kNames[V]);
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    if (ms < best) best = ms;
  }
  const double k_depth = V == kBf16 ? 64 : 128, cols = V == kFp8Tile128 ? 128 : 256;
  const double flops = 2.0 * 64 * kWgs * cols * k_depth * iters * blocks;
  const double tflops = flops / (best * 1e-3) / 1e12;
  const double peak = V == kBf16 ? peak_bf16 : peak_fp8;
  char name[32];
  const char* suffix = V == kFp8Tile128 ? (kWgs == 3 ? "x3wg" : "x2blk") : kWgs == 1 ? "x1wg" : "";
  std::snprintf(name, sizeof name, "%s%s", kNames[V], suffix);
  std::printf("%-14s %8.3f ms  %7.1f TFLOP/s  %5.1f%% of the %s dense peak  (%d of %d blocks an SM resident)\n",
              name, best, tflops, 100.0 * tflops / peak, V == kBf16 ? "BF16" : "FP8", resident, kMinBlocks);
}
}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 4000;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device");
  if (prop.major != 9) {
    std::fprintf(stderr, "wgmma_ceiling: needs a Hopper GPU (sm_90), found %s (sm_%d%d)\n", prop.name, prop.major,
                 prop.minor);
    return 1;
  }
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  // Dense tensor-core rates of an SM a clock: 4096 bf16, 8192 e4m3 FLOPs, at the clock the
  // device reports (its boost maximum: 1,980 MHz on an H100 SXM, so 1,071 / 2,141 TFLOP/s;
  // the data sheet's 989 / 1,979 are the same rates at 1.83 GHz).
  const double peak_bf16 = 4096.0 * prop.multiProcessorCount * clock_khz * 1e3 / 1e12;
  std::printf("%s, %d SMs, %.0f MHz: dense peaks %.0f (BF16) and %.0f (FP8) TFLOP/s; %d k-tiles a block\n",
              prop.name, prop.multiProcessorCount, clock_khz / 1e3, peak_bf16, 2 * peak_bf16, iters);
  float* out = nullptr;
  check(cudaMalloc(&out, 512 * sizeof(float)), "cudaMalloc");  // a thread index of any variant
  const int sms = prop.multiProcessorCount;
  run<kBf16, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kFp8Acc, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kFp8Halves, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kFp8Halves, 1, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kFp8Tile128, 2>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kFp8Tile128, 1, 3>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kRsHalves, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kRsQuarters, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  run<kSsQuarters, 1>(sms, iters, out, 2 * peak_bf16, peak_bf16);
  cudaFree(out);
  return 0;
}
