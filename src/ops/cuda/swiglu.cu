// Grouped expert SwiGLU: grouped GEMMs on the tensor cores (bf16 in, f32 accumulation), one
// launch per projection for all experts, no host synchronisation. Two implementations of the
// same tiles and schedule: wgmma + TMA on Hopper (sm_90a, the "Hopper path" below), and
// mma.sync m16n8k16 + cp.async everywhere else (and with MOETRAIN_SWIGLU_MMA_SYNC=1).
//
// Floor and expectation, at the bench model's shape (E = 128, H = 2048, I = 768, N = 65536
// rows, uneven counts; benchmarks/bench_grouped_swiglu.cpp), on an H100 SXM (989 TFLOP/s
// dense bf16, 3.35 TB/s):
//   each of forward, backward_input, backward_weight is 6 N H I = 0.62 TFLOP: 0.63 ms of
//   tensor-core time. forward / backward_input also read the 1.2 GB of bf16 weights (0.36
//   ms), under the MMA time. backward_weight reads and writes the f32 dW (2 x 2.4 GB, 1.45
//   ms): it is memory-bound, floor ~1.5 ms. Floor of the three: ~2.8 ms a layer (~660 TFLOP/s).
//   mma.sync kernels (before): 2.48 + 2.78 + 4.11 ms = 9.4 ms (~200 TFLOP/s). Expected with
//   wgmma at 128 x 128 tiles, ~600 TFLOP/s in the row GEMMs: ~1.1 + 1.1 + ~1.8 ms = ~4 ms
//   a layer (~460 TFLOP/s).
//   Measured (H100 SXM): 1.63 + 1.77 + 2.84 ms = 6.2 ms (~300 TFLOP/s; 380 / 350 / 217 for
//   the three ops). The row GEMMs ran at ~55% SM throughput with L2 at ~80% (Nsight
//   Compute): 128 x 128 tiles reload too much per FLOP. With 128 x 256 tiles, a producer
//   warpgroup and one persistent block per SM: 1.53 + 1.75 ms (404 / 353 TFLOP/s); L2 is
//   still the limit, now its partition-to-partition fabric (lts__ltcfabric2ltc 88%: both
//   halves of the GPU read every expert's weights, which are used by only ~4.5 row tiles
//   each). backward_weight's main loops take 1.3 ms alone; its f32 dW add-back is not
//   overlapped with them yet (a persistent kernel would overlap one tile's reduce with the
//   next tile's loads).
//
// Schedule. A one-block kernel turns counts [E] (device) into row offsets [E+1] and a
// list of row tiles: expert e owns ceil(c_e / 128) tiles of up to 128 of its rows. The
// host knows only the bound max_tiles = ceil(N/128) + E, so the row-grouped GEMMs launch
// grid (column tiles, max_tiles); a block looks up its (expert, first row) and exits when
// its tile index is past the real count. Weight-gradient GEMMs (the reduction runs over an
// expert's rows) launch grid (column tiles, row tiles, E [x 2]) and loop over the
// expert's rows read from the offsets; an expert with no rows leaves its dW untouched.
// Each output element is owned by one block and reduced in a fixed order: deterministic.
//
// mma.sync path: block tile 128 x 128 x 64, 8 warps as 2 (M) x 4 (N), warp tile 64 x 32, a 3-stage
// cp.async pipeline (96 KB of shared memory, 2 blocks per SM). Operand tiles are stored
// either K-major ([128 rows][64 k], 128-byte rows) or MN-major ([64 k][128], 256-byte
// rows), 16-byte chunks XOR-swizzled by (row & 7) so that ldmatrix (.trans for MN-major)
// reads them without bank conflicts. Rows or columns past the end are zero-filled.
//
//   forward    gate|up = x Wg|Wu^T   A = x (K-major)      B = Wg, Wu (K-major)  epilogue: gate, up, act
//              y = act Wd^T          A = act (K-major)    B = Wd (K-major)
//   dgrad      da = dy Wd            A = dy (K-major)     B = Wd (MN-major)     epilogue: dgate, dup
//              dx = [dgate|dup] [Wg;Wu]   (K = 2I, the operands switch source at k = I)
//   wgrad      dWd += dy^T act       A = dy (MN-major)    B = act (MN-major)    epilogue: f32 +=
//              dWg|dWu += dgate|dup^T x   (two problems in one launch, grid z = 2E)
// The gate/up launch puts 64 gate rows and the same 64 up rows of the weights in one B
// tile, and lays the warps out so that each thread holds g and u of the same elements:
// silu(g) * u is computed from the f32 accumulators.
#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/fp8_device.cuh"
#include "ops/cuda/fp8_launch.h"
#include "ops/cuda/hopper.cuh"
#include "ops/cuda/kernels.cuh"
#include "ops/cuda/l2_halves.h"
#include "ops/cuda/moe_device.cuh"
#include "ops/cuda/swiglu_launch.h"
#include "ops/cuda/tensor_map.h"

namespace moetrain::ops::cuda {
namespace {

using namespace moe;

using bf16 = __nv_bfloat16;

constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256;
constexpr int kTileBytes = 128 * 64 * 2;  // one operand tile, either layout
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = kStages * kStageBytes;  // 96 KB
constexpr int kScheduleThreads = 1024;
constexpr int kQueueWords = 8;  // rows kernels: [tiles, split, launch 0 counters x 2, launch 1 counters x 2, spare]

enum Epilogue { kEpiGateUp, kEpiStore, kEpiDSwiglu };

// Byte offset of 16-byte chunk `chunk` of row r in a tile.
template <bool kKMajor>
__device__ __forceinline__ uint32_t tile_offset(int r, int chunk) {
  if constexpr (kKMajor) return r * 128 + ((chunk ^ (r & 7)) << 4);  // [128][64]: 8 chunks a row
  else return r * 256 + ((chunk ^ (r & 7)) << 4);                    // [64][128]: 16 chunks a row
}

// One 64-deep stage of the warp's 64 x 32 tile: 4 k16 steps of 4 x 4 MMAs.
template <bool kAKMajor, bool kBKMajor, bool kGateUp>
__device__ __forceinline__ void mma_stage(float (&acc)[4][4][4], const char* sA, const char* sB, int lane, int wm,
                                          int wn) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4][4], b[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      const int m_base = wm * 64 + mi * 16;
      if constexpr (kAKMajor) {
        ldmatrix_x4(a[mi], sA + tile_offset<true>(m_base + (lane & 15), kk * 2 + (lane >> 4)));
      } else {
        ldmatrix_x4_trans(a[mi], sA + tile_offset<false>(kk * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                          (m_base >> 3) + ((lane >> 3) & 1)));
      }
    }
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      // gate/up: n8 blocks 0,1 are gate rows wn*16.., blocks 2,3 the same rows of up
      const int n_base = kGateUp ? p * 64 + wn * 16 : wn * 32 + p * 16;
      uint32_t r[4];
      if constexpr (kBKMajor) {
        ldmatrix_x4(r, sB + tile_offset<true>(n_base + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
      } else {
        ldmatrix_x4_trans(r, sB + tile_offset<false>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                      (n_base >> 3) + (lane >> 4)));
      }
      b[2 * p][0] = r[0];
      b[2 * p][1] = r[1];
      b[2 * p + 1][0] = r[2];
      b[2 * p + 1][1] = r[3];
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) mma_bf16_16816(acc[mi][nb], a[mi], b[nb]);
    }
  }
}

// The multistage main loop: load_a(tile, kt) / load_b(tile, kt) issue the cp.async copies
// of k-tile kt into a tile of shared memory.
template <bool kAKMajor, bool kBKMajor, bool kGateUp, typename LoadA, typename LoadB>
__device__ __forceinline__ void gemm_mainloop(float (&acc)[4][4][4], char* smem, int ktiles, const LoadA& load_a,
                                              const LoadB& load_b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp & 1, wn = warp >> 1;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) {
      load_a(smem + s * kStageBytes, s);
      load_b(smem + s * kStageBytes + kTileBytes, s);
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();  // k-tile kt has landed (for this thread) ...
    __syncthreads();               // ... for all threads; and stage (kt-1) % kStages is free
    const int next = kt + kStages - 1;
    if (next < ktiles) {
      char* st = smem + (next % kStages) * kStageBytes;
      load_a(st, next);
      load_b(st + kTileBytes, next);
    }
    cp_async_commit();
    const char* st = smem + (kt % kStages) * kStageBytes;
    mma_stage<kAKMajor, kBKMajor, kGateUp>(acc, st, st + kTileBytes, lane, wm, wn);
  }
  cp_async_wait<0>();
}

// sigmoid(g) from the fast exp2 and reciprocal: relative error ~1e-7, far below the bf16
// rounding of every result it feeds (4e-3); 0 and 1 at the extremes, NaN for NaN. With the
// exact expf and division the dSwiGLU epilogue (below) cost more than the MMAs of its da
// GEMM: bench_ops BM_GroupedSwigluBackwardInput (da + dx, bench shape) 1.66-1.70 -> 1.50-1.52
// ms on an H200 with this and the epilogue's branch-free batches (1.41 with no epilogue
// math at all), 1.60-1.61 -> 1.55 ms on an H100.
__device__ __forceinline__ float sigmoidf_(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }

// The dSwiGLU epilogue of two adjacent columns: from da = d(silu(g) u) (v0, v1) and the
// saved g, u, dgate = da u silu'(g) = da u s (1 + g (1 - s)) = da u (s + gs (1 - s)) and
// dup = da silu(g) = da gs (s = sigmoid(g), gs = g s), as bf16 pairs. Both row GEMM
// kernels (mma.sync and Hopper) end their da this way.
__device__ __forceinline__ void dswiglu_pair(float v0, float v1, __nv_bfloat162 gb, __nv_bfloat162 ub, uint32_t& dgate,
                                             uint32_t& dup) {
  const float2 g = __bfloat1622float2(gb), u = __bfloat1622float2(ub);
  const float s0 = sigmoidf_(g.x), s1 = sigmoidf_(g.y);
  const float gs0 = g.x * s0, gs1 = g.y * s1;
  const __nv_bfloat162 dg = __floats2bfloat162_rn(v0 * u.x * fmaf(gs0, 1.f - s0, s0), v1 * u.y * fmaf(gs1, 1.f - s1, s1));
  const __nv_bfloat162 du = __floats2bfloat162_rn(v0 * gs0, v1 * gs1);
  dgate = *reinterpret_cast<const uint32_t*>(&dg);
  dup = *reinterpret_cast<const uint32_t*>(&du);
}
__device__ __forceinline__ void store_dswiglu_pair(float v0, float v1, __nv_bfloat162 gb, __nv_bfloat162 ub,
                                                   __nv_bfloat16* dgate, __nv_bfloat16* dup) {
  uint32_t dg, du;
  dswiglu_pair(v0, v1, gb, ub, dg, du);
  *reinterpret_cast<uint32_t*>(dgate) = dg;
  *reinterpret_cast<uint32_t*>(dup) = du;
}

// ---- row-grouped GEMM: out[rows of e, n] = sum_k A[row, k] B_e[k, n] --------------------
struct RowsArgs {
  const bf16* a0;  // A [N, K] row-major, k < ksplit read from a0, else from a1 at k - ksplit
  const bf16* a1;
  int64_t lda;
  const bf16* b0;  // per expert: K-major B [n][k] (ldb), or MN-major B [k][n]; b1 as a1
  const bf16* b1;
  int64_t ldb, b_stride;  // b_stride: elements between experts
  int K, ksplit, n_extent;
  const int* offsets;  // [E + 1]
  const int* tile_expert;
  const int* tile_row;
  bf16* out0;  // [N, n_extent]: store / gate / dgate
  bf16* out1;  // up / dup
  bf16* out2;  // act
  int64_t ldo;
  const bf16* g;  // dswiglu: gate and up [N, n_extent]
  const bf16* u;
  // Hopper rows kernel: its two tile queues (see rows_kernel). queue[0]: the real row
  // tiles, queue[1]: where queue 1's row tiles start; next: the queues' two counters, zero
  // before the launch; sm_half: [%smid] -> the queue a block takes first (nullptr: 0).
  const int* queue;
  int* next;
  const uint8_t* sm_half;
};

template <bool kBKMajor, int kEpi>
__global__ void __launch_bounds__(kThreads, 2) grouped_rows_gemm_kernel(const RowsArgs args) {
  constexpr bool kGateUp = kEpi == kEpiGateUp;
  const int e = args.tile_expert[blockIdx.y];
  if (e < 0) return;
  const int row0 = args.tile_row[blockIdx.y];
  const int row_end = args.offsets[e + 1];
  const int n0 = blockIdx.x * (kGateUp ? 64 : kBN);
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  const bf16* b0 = args.b0 + e * args.b_stride;
  const bf16* b1 = args.b1 + e * args.b_stride;
  const int K = args.K, ksplit = args.ksplit, n_extent = args.n_extent;

  auto load_a = [&](char* tile, int kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + i * kThreads, r = q >> 3, c = q & 7;
      const int64_t row = row0 + r;
      const int k = kt * kBK + c * 8;
      const bool valid = row < row_end && k < K;
      const bf16* src = args.a0;
      if (valid) src = k < ksplit ? args.a0 + row * args.lda + k : args.a1 + row * args.lda + (k - ksplit);
      cp_async_16(tile + tile_offset<true>(r, c), src, valid);
    }
  };
  auto load_b = [&](char* tile, int kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + i * kThreads;
      if constexpr (kBKMajor) {
        const int r = q >> 3, c = q & 7;
        const int k = kt * kBK + c * 8;
        const int64_t n = kGateUp ? n0 + (r & 63) : n0 + r;
        const bf16* base = (kGateUp && r >= 64) ? b1 : b0;
        const bool valid = n < n_extent && k < K;
        cp_async_16(tile + tile_offset<true>(r, c), valid ? base + n * args.ldb + k : args.b0, valid);
      } else {
        const int r = q >> 4, c = q & 15;
        const int64_t k = static_cast<int64_t>(kt) * kBK + r;
        const int n = n0 + c * 8;
        const bool valid = k < K && n < n_extent;
        const bf16* src = args.b0;
        if (valid) src = (k < ksplit ? b0 + k * args.ldb : b1 + (k - ksplit) * args.ldb) + n;
        cp_async_16(tile + tile_offset<false>(r, c), src, valid);
      }
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nb = 0; nb < 4; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][nb][j] = 0.f;
  gemm_mainloop<true, kBKMajor, kGateUp>(acc, smem, (K + kBK - 1) / kBK, load_a, load_b);

  const int lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (row >= row_end) continue;
      if constexpr (kGateUp) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
          const int col = n0 + wn * 16 + nb * 8 + (lane & 3) * 2;
          if (col >= n_extent) continue;
          const float g0 = acc[mi][nb][half * 2], g1 = acc[mi][nb][half * 2 + 1];
          const float u0 = acc[mi][nb + 2][half * 2], u1 = acc[mi][nb + 2][half * 2 + 1];
          const int64_t o = row * args.ldo + col;
          *reinterpret_cast<__nv_bfloat162*>(args.out0 + o) = __floats2bfloat162_rn(g0, g1);
          *reinterpret_cast<__nv_bfloat162*>(args.out1 + o) = __floats2bfloat162_rn(u0, u1);
          *reinterpret_cast<__nv_bfloat162*>(args.out2 + o) =
              __floats2bfloat162_rn(g0 * sigmoidf_(g0) * u0, g1 * sigmoidf_(g1) * u1);
        }
      } else {
        if constexpr (kEpi == kEpiStore) {
#pragma unroll
          for (int nb = 0; nb < 4; ++nb) {
            const int col = n0 + wn * 32 + nb * 8 + (lane & 3) * 2;
            if (col >= n_extent) continue;
            *reinterpret_cast<__nv_bfloat162*>(args.out0 + row * args.ldo + col) =
                __floats2bfloat162_rn(acc[mi][nb][half * 2], acc[mi][nb][half * 2 + 1]);
          }
        } else {  // da -> dgate = da * u * silu'(g), dup = da * silu(g)
          // all loads of g and u first, so that they are in flight together
          __nv_bfloat162 gb[4], ub[4];
#pragma unroll
          for (int nb = 0; nb < 4; ++nb) {
            const int col = n0 + wn * 32 + nb * 8 + (lane & 3) * 2;
            const int64_t o = row * args.ldo + col;
            if (col < n_extent) {
              gb[nb] = *reinterpret_cast<const __nv_bfloat162*>(args.g + o);
              ub[nb] = *reinterpret_cast<const __nv_bfloat162*>(args.u + o);
            }
          }
#pragma unroll
          for (int nb = 0; nb < 4; ++nb) {
            const int col = n0 + wn * 32 + nb * 8 + (lane & 3) * 2;
            if (col >= n_extent) continue;
            const int64_t o = row * args.ldo + col;
            store_dswiglu_pair(acc[mi][nb][half * 2], acc[mi][nb][half * 2 + 1], gb[nb], ub[nb], args.out0 + o,
                               args.out1 + o);
          }
        }
      }
    }
  }
}

// ---- weight-gradient GEMM: C_e[m, n] += sum over e's rows r of A[r, m] B[r, n] ----------
// Micro-batches one weight-gradient pass takes (WgradArgs::n_more + 1 at most).
constexpr int kWgradSources = 8;
struct WgradArgs {
  const bf16* a0;  // A [N, M] (problem 0), a1 for problem 1
  const bf16* a1;
  int64_t lda;
  const bf16* b;  // B [N, Nc], shared by the problems
  int64_t ldb;
  float* c0;  // C [E, M, Nc] f32, accumulated
  float* c1;
  int64_t c_stride;
  int M, Nc;
  const int* offsets;  // [E + 1]
  int accumulate;      // 0: C = sum (every block writes, an expert without rows writes zeros)
  // Hopper: more micro-batches' rows (WgradMaps::xa / xb), whose k-tiles follow the first's
  // in each tile's k loop: the offsets [E + 1] of each (n_more of them; 0: one micro-batch).
  const int* offsets_more[kWgradSources - 1];
  int n_more;
  double* squares;     // Hopper, accumulate 0: the sums of squares of each tile's two halves
                       // at 2 tile + squares_base and the next slot (nullptr: not asked)
  int64_t squares_base;
  // Hopper: tiles (numbered column tile fastest, then row tile, then expert and problem)
  // come from two queues, [0, queue_split) and [queue_split, all), counted by next[0] and
  // next[1] (zeroed); a block takes from its L2 half's queue (sm_half), then from the other.
  // Without sm_half, one queue of all the tiles.
  const uint8_t* sm_half;
  int* next;
  int queue_split;
};

template <int kProblems>
__global__ void __launch_bounds__(kThreads, 2) grouped_wgrad_kernel(const WgradArgs args) {
  const int e = blockIdx.z / kProblems, prob = blockIdx.z % kProblems;
  const int r0 = args.offsets[e], r1 = args.offsets[e + 1];
  if (r1 <= r0 && args.accumulate) return;  // nothing to add (an overwrite still stores zeros)
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const bf16* A = prob ? args.a1 : args.a0;
  float* C = (prob ? args.c1 : args.c0) + e * args.c_stride;
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x;
  const int M = args.M, Nc = args.Nc;

  auto load_a = [&](char* tile, int kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + i * kThreads, r = q >> 4, c = q & 15;
      const int64_t row = r0 + kt * kBK + r;
      const int m = m0 + c * 8;
      const bool valid = row < r1 && m < M;
      cp_async_16(tile + tile_offset<false>(r, c), valid ? A + row * args.lda + m : A, valid);
    }
  };
  auto load_b = [&](char* tile, int kt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + i * kThreads, r = q >> 4, c = q & 15;
      const int64_t row = r0 + kt * kBK + r;
      const int n = n0 + c * 8;
      const bool valid = row < r1 && n < Nc;
      cp_async_16(tile + tile_offset<false>(r, c), valid ? args.b + row * args.ldb + n : args.b, valid);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int nb = 0; nb < 4; ++nb)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][nb][j] = 0.f;
  gemm_mainloop<false, false, false>(acc, smem, (r1 - r0 + kBK - 1) / kBK, load_a, load_b);

  const int lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;
  // C += acc, a row of the warp tile at a time: its 4 loads of C go out before any store.
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = m0 + wm * 64 + mi * 16 + (lane >> 2) + half * 8;
      if (m >= M) continue;
      float* crow = C + static_cast<int64_t>(m) * Nc;
      float2 c[4] = {};
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) {
        const int n = n0 + wn * 32 + nb * 8 + (lane & 3) * 2;
        if (n < Nc && args.accumulate) c[nb] = *reinterpret_cast<const float2*>(crow + n);
      }
#pragma unroll
      for (int nb = 0; nb < 4; ++nb) {
        const int n = n0 + wn * 32 + nb * 8 + (lane & 3) * 2;
        if (n < Nc) {
          *reinterpret_cast<float2*>(crow + n) =
              make_float2(c[nb].x + acc[mi][nb][half * 2], c[nb].y + acc[mi][nb][half * 2 + 1]);
        }
      }
    }
  }
}

// ==== Hopper path (sm_90a): TMA loads + wgmma ==============================================
// Same schedule as above (row tiles of 128 rows of one expert, one owner per output
// element), but the operands are fetched by the tensor copy engine (TMA) into
// 128-byte-swizzled shared memory, completion signalled on mbarriers, and consumed by
// warpgroup MMAs straight from shared memory: no ldmatrix, no per-thread address arithmetic
// in the main loop, and the copies of the ring run while the tensor cores work.
//   row GEMMs: 128 x 256 tiles, warp-specialised and persistent (rows_kernel below);
//   weight gradients: the same tiles and structure (wgrad_ws_kernel below).
//
// Ragged edges cost nothing in the main loop: TMA zero-fills the parts of a box outside the
// tensor (rows past N, k past K, columns past the extent). A row tile reads up to 127 rows
// of the next expert; they only feed output rows that the epilogue does not store. The
// weight-gradient GEMMs reduce over an expert's rows, so there the rows past the expert's
// end in its last k-tile are zeroed in shared memory before the MMA, and their f32 tile is
// added into dW by a TMA reduce-add copy rather than by thread loads and stores.
namespace hopper {

[[maybe_unused]] constexpr int kConsumerThreads = 256;  // two consumer warpgroups a block
constexpr int kTile = 128 * 64 * 2;  // one operand's k-tile: 16 KB, as 128 x 128-byte rows
[[maybe_unused]] constexpr int kChunk = kTile / 2;  // MN-major operands: two [64 k][64 mn] boxes of 8 KB
// A ring of `stages` stages of stage_bytes, + alignment slack and the full/empty barriers.
constexpr int smem_bytes(int stages, int stage_bytes) { return stages * stage_bytes + 1024 + 2 * stages * 8; }

struct Maps {
  CUtensorMap a[2];  // A operand (rows: [N, K]; wgrad: [N, M]), per k source
  CUtensorMap b[2];  // B operand (weights [E, ., .]; wgrad: [N, Nc]), per k source / gate, up
  CUtensorMap c[2];  // wgrad: the f32 gradient [E, M, Nc] of each problem (box 32 x 64)
};
// The weight-gradient kernel's maps: the first micro-batch's in m, those of the micro-batches
// after it (WgradArgs::n_more) in xa / xb. 3.5 KB of kernel parameters with 8 micro-batches.
struct WgradMaps {
  Maps m;
  CUtensorMap xa[kWgradSources - 1][2], xb[kWgradSources - 1];
};

#if MT_SM90A
using namespace sm90;

// The tiles of a persistent launch in two queues, [0, split) and [split, end), counted by
// next[0] and next[1] (zeroed before the launch): a block takes from its own L2 half's
// queue (own), then helps empty the other one. One thread a block calls take().
struct TileQueues {
  int* next;
  int split, end, own;
  bool own_open = true, other_open = true;
  // The next tile of queue q, or -1 when that queue is empty.
  __device__ int take_from(int q) {
    const int first = q == 0 ? 0 : split, last = q == 0 ? split : end;
    const int u = first + atomicAdd(&next[q], 1);
    return u < last ? u : -1;
  }
  // The next tile of either queue, or -1 when both are empty.
  __device__ int take() {
    int t = -1;
    if (own_open && (t = take_from(own)) < 0) own_open = false;
    if (t < 0 && other_open && (t = take_from(own ^ 1)) < 0) other_open = false;
    return t;
  }
};

// The ring of both kernels (at least smem_bytes(S, kStageBytes) of dynamic shared memory):
// S stages 1024-byte aligned, then full[S] (one arrival: the thread issuing the copies) and
// empty[S] (one arrival per consumer warp: the 8 warps of two warpgroups).
// init_ring_barriers sets the counts up, for the kernels that place the barriers themselves;
// every thread of the block calls it (it holds a __syncthreads).
template <int S>
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint64_t* empty) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerThreads / 32);
    }
    mbar_fence_init();
  }
  __syncthreads();
}
template <int S, int kStageBytes>
__device__ __forceinline__ char* setup_smem(char* raw, uint64_t*& full, uint64_t*& empty) {
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  full = reinterpret_cast<uint64_t*>(smem + S * kStageBytes);
  empty = full + S;
  init_ring_barriers<S>(full, empty);
  return smem;
}
#endif  // MT_SM90A

// Row-grouped GEMM, as grouped_rows_gemm_kernel, warp-specialised and persistent. A block
// owns a multiprocessor (one per SM, grid = min(SMs, tiles)) and walks the output tiles t =
// blockIdx.x, + gridDim.x, ... in row-tile-major order (the blocks running together share A
// rows and one or two experts' weights in L2). Tiles are 128 rows x 256 columns: against
// the 128 x 128 tiles of the first version, 36% fewer operand bytes per FLOP come through
// L2, which Nsight showed to be the limit (L2 82%, SM 52%).
//   warpgroup 0  the producer: gives its registers back; one thread issues the TMA copies of
//                every k-tile of every tile into a 4-stage ring (48 KB a stage), running
//                ahead into the next tile while the consumers are in their epilogue;
//   warpgroups 1, 2  the consumers: 64 rows x 256 columns each (wgmma m64n256k16, 128 f32
//                accumulators a thread), then the epilogue: when all 64 of a warpgroup's
//                rows are the expert's, its outputs go through two 8 KB staging boxes by
//                TMA stores that drain while the next tile's MMAs run; a warpgroup whose
//                rows cross the expert's end (a TMA box would write the next expert's
//                rows) stores straight from registers, row by row.
// The stores from registers took the consumers longer than the ring could cover: the
// producer runs at most 4 k-tiles ahead, so the L2 reads, which these kernels wait for,
// stopped during every epilogue. Nsight (bench_ops, H100): gate/up 833 us, 646 us with no
// epilogue at all, 800 us with no MMAs; down 471 / 310 / 452. With the TMA stores: gate/up
// 811 -> 707 us, down 462 -> 357, dx 758 -> 669, da 525 -> 496 (2026-11-26).
// Tried and slower: clusters of two blocks sharing each stage by TMA multicast (two row
// tiles of one expert, half the weight tile loaded by each block): a third fewer L2 reads,
// but gate/up 824 -> 1240 us with the L2 fabric busier (docs/perf.md, twelfth session).
// Tiles come from two queues, each a run of row tiles taken row tile by row tile (all the
// column tiles of a row tile, then the next): queue 0 holds row tiles [0, split), queue 1
// [split, real tiles), split in proportion to the multiprocessors of each L2 half. A block
// takes tiles from its own half's queue (sm_l2_halves), then helps empty the other one, so
// each expert's weights and rows are read mostly by blocks of one half and cached there
// once instead of in both halves through the fabric. The producer fetches each tile index
// (one atomic a tile, ahead of the consumers) and passes it in tile_of[stage] with the
// tile's first k-tile; -1 there, with no data, tells the consumers to stop.
// Operand maps: a[src] over the rows [N, K_src] (box 64 k x 128 rows); b[src] over the
// weights [E, n, k] (K-major, box 64 x 128; gate/up: b[0] = Wg, b[1] = Wu, 128 rows of each)
// or [E, k, n] (MN-major, box 64 n x 64 k, four of them). K = nsrc sources of ktiles_src
// k-tiles each (dx: dgate then dup).
constexpr int kWsThreads = 384, kWsStages = 4, kWsBN = 256;
constexpr int kWsBTile = kWsBN * 64 * 2;  // 32 KB
constexpr int kWsStage = kTile + kWsBTile;
constexpr int ws_tile_cols(int epi) { return epi == kEpiGateUp ? kWsBN / 2 : kWsBN; }  // output columns a tile
// The epilogue's staging: per consumer warpgroup two boxes of 64 rows x 64 bf16 columns
// (128-byte rows, swizzled), each stored by a TMA copy while the next is written; behind
// the ring and its barriers (1024 bytes, for the alignment).
constexpr int kOutBox = 64 * 64 * 2;
constexpr int kRowsSmem = smem_bytes(kWsStages, kWsStage) + 1024 + 4 * kOutBox;
static_assert(kRowsSmem <= 232448 - 64, "shared memory of the rows kernel");
// The outputs of a rows launch (bf16: box 64 columns x 64 rows): store / gate, up, act.
struct OutMaps {
  CUtensorMap o[4];  // the FP8 gate/up kernel's o[3]: act's codes (ActCodes)
};

#if MT_SM90A
// The rows kernels' producer (one thread of warpgroup 0): takes tiles from the queues and, for
// each k-tile of a tile, waits for its stage of the S-stage ring (kStage bytes a stage) to be
// free, publishes the tile in tile_of[stage] with its first k-tile, expects the stage's bytes
// and calls load(stage, &full[stage], kt, expert, first row, first column), which issues the
// stage's copies. No tile left: an empty stage marked -1 ends the consumers' loop.
template <int S, int kStage, typename Load>
__device__ __forceinline__ void produce_row_tiles(char* smem, uint64_t* full, uint64_t* empty, int* tile_of,
                                                  const RowsArgs& args, int col_tiles, int max_tiles, int ktiles,
                                                  int tile_cols, Load load) {
  const int rows = min(args.queue[0], max_tiles), split = min(args.queue[1], rows);
  TileQueues queues{args.next, split * col_tiles, rows * col_tiles, args.sm_half ? args.sm_half[sm_id()] : 0};
  int it = 0;  // k-tiles issued so far over all of this block's tiles: the ring position
  for (;;) {
    const int t = queues.take();
    if (t < 0) {
      const int s = it % S;
      if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);
      tile_of[s] = -1;
      mbar_arrive(&full[s]);
      return;
    }
    const int rt = t / col_tiles, e = args.tile_expert[rt];
    const int row0 = args.tile_row[rt], n0 = (t % col_tiles) * tile_cols;
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % S;
      if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);  // k-tile it - S has left it
      if (kt == 0) tile_of[s] = t;                             // published by the arrive below
      mbar_arrive_expect_tx(&full[s], kStage);  // boxes count in full, zero-filled parts included
      load(smem + s * kStage, &full[s], kt, e, row0, n0);
    }
  }
}
#endif  // MT_SM90A

// The FP8 forward's act codes, quantized in the gate/up epilogue: a gate/up tile's 128 act
// columns of a row are one 1 x 128 tile (n0 is a multiple of 128, I of 128), so the tile's
// amax is the four lanes of a quad's; the bf16 act as stored is what is quantized, so the
// codes and scales are the bits quantize_fp8 (rows mode) makes of it. out.o[3] maps the
// codes (box 128 x 64 bytes) for the TMA path.
struct ActCodes {
  uint8_t* q;    // [N, I] e4m3
  float* scale;  // [I / 128][N]
  int n_rows, ld;  // N, I
};

#if MT_SM90A
// Where column block j (8 bf16, 16 bytes) of row r lands in a 128-byte-swizzled staging box,
// plus the lane's pair.
__device__ __forceinline__ int staging_offset(int r, int j, int lane) {
  return r * 128 + ((j ^ (r & 7)) << 4) + (lane & 3) * 4;
}

// The rows kernels' epilogue (gate/up with act, or a plain store) of a consumer warpgroup's
// 64 rows x 256 columns in acc (the wgmma m64n256 layout: acc[nb * 4 + h * 2 + c] is row
// 16 w + lane / 4 + 8 h, column nb * 8 + 2 (lane % 4) + c; gate/up: gate columns nb < 16,
// up columns nb + 16). When all 64 rows are the expert's, 64 x 64 boxes go through the
// warpgroup's two staging buffers by TMA stores that drain while the next tile's MMAs run
// (`boxes` counts them); else the rows of the expert are stored from registers. Gate/up:
// gate and up go out first, then act replaces gate in acc (as the bf16 that is stored) and
// goes out, then, with kActFp8, its codes and scales (ActCodes).
template <bool kGateUp, bool kActFp8 = false>
__device__ __forceinline__ void store_rows_tile(float (&acc)[128], const OutMaps& out, const RowsArgs& args,
                                                char* staging, int& boxes, int row0, int row_end, int n0, int cw,
                                                const ActCodes& codes = {}) {
  const int tid = threadIdx.x & 127, lane = tid & 31, w = tid >> 5;
  // Stores the warpgroup's 64 rows of a 128-byte-wide box at (col0, row) of `map` through the
  // next staging buffer; fill(buf, r, h) writes row r (row half h) of this thread's part.
  auto stage_box = [&](const CUtensorMap* map, int col0, int row, auto fill) {
    char* buf = staging + (boxes++ & 1) * kOutBox;
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");  // its last copy has read it
    named_barrier(2 + cw, 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) fill(buf, 16 * w + (lane >> 2) + 8 * h, h);
    fence_proxy_async();  // generic writes -> copy engine reads
    named_barrier(2 + cw, 128);
    if (tid == 0) {
      tma_store_2d(map, buf, col0, row);
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  };
  // 64 rows x 64 bf16 columns; value(j, h) is the bf16 pair of column block j (8 columns).
  auto store_box = [&](const CUtensorMap* map, int col0, int row, auto value) {
    stage_box(map, col0, row, [&](char* buf, int r, int h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) *reinterpret_cast<uint32_t*>(buf + staging_offset(r, j, lane)) = value(j, h);
    });
  };
  auto pack = [](float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
  const bool whole = row0 + cw * 64 + 64 <= row_end;  // all 64 of the warpgroup's rows are the expert's
  const int r0 = row0 + cw * 64;
  if constexpr (kGateUp) {
    // Output o from the 16 column blocks nb0.. of acc (gate: 0, up: 16), columns n0..
    auto store_half = [&](int o, int nb0, bf16* dst) {
      if (whole) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          store_box(&out.o[o], n0 + 64 * q, r0, [&](int j, int h) {
            const int nb = nb0 + 8 * q + j;
            return pack(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1]);
          });
        }
        return;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = r0 + w * 16 + (lane >> 2) + h * 8;
        if (row >= row_end) continue;
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
          const int col = n0 + nb * 8 + (lane & 3) * 2;
          if (col >= args.n_extent) continue;
          *reinterpret_cast<__nv_bfloat162*>(dst + row * args.ldo + col) =
              __floats2bfloat162_rn(acc[(nb0 + nb) * 4 + h * 2], acc[(nb0 + nb) * 4 + h * 2 + 1]);
        }
      }
    };
    store_half(0, 0, args.out0);
    store_half(1, 16, args.out1);
    // act = silu(gate) * up, in place of gate, rounded to the bf16 that is stored
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const float g = acc[i], u = acc[64 + i];
      acc[i] = __bfloat162float(__float2bfloat16_rn(g * sigmoidf_(g) * u));
    }
    store_half(2, 0, args.out2);
    if constexpr (kActFp8) {
      // Each row's 128 act columns: 32 in this thread, the rest in its quad's other lanes.
      float inv[2];  // this thread's rows' scales
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float amax = 0.f;
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) amax = fmaxf(amax, fmaxf(fabsf(acc[nb * 4 + h * 2]), fabsf(acc[nb * 4 + h * 2 + 1])));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        inv[h] = fp8::tile_scale(amax);
      }
      auto code_pair = [&](int nb, int h) {  // columns nb * 8 + 2 (lane % 4) + 0, 1 as two codes
        return static_cast<uint16_t>(fp8::to_e4m3(acc[nb * 4 + h * 2] / inv[h]) |
                                     (fp8::to_e4m3(acc[nb * 4 + h * 2 + 1] / inv[h]) << 8));
      };
      if (whole) {
        // 16-code chunk c of row r sits at chunk c ^ (r % 8) of the 128-byte swizzled row.
        stage_box(&out.o[3], n0, r0, [&](char* buf, int r, int h) {
#pragma unroll
          for (int nb = 0; nb < 16; ++nb) {
            *reinterpret_cast<uint16_t*>(buf + r * 128 + (((nb >> 1) ^ (r & 7)) << 4) + (nb & 1) * 8 + (lane & 3) * 2) =
                code_pair(nb, h);
          }
        });
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = r0 + w * 16 + (lane >> 2) + h * 8;
        if (row >= row_end) continue;
        if ((lane & 3) == 0) codes.scale[static_cast<int64_t>(n0 / 128) * codes.n_rows + row] = inv[h];
        if (whole) continue;
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
          *reinterpret_cast<uint16_t*>(codes.q + row * codes.ld + n0 + nb * 8 + (lane & 3) * 2) = code_pair(nb, h);
        }
      }
    }
  } else if (whole) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      store_box(&out.o[0], n0 + 64 * q, r0, [&](int j, int h) {
        const int nb = 8 * q + j;
        return pack(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1]);
      });
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = r0 + w * 16 + (lane >> 2) + h * 8;
      if (row >= row_end) continue;
#pragma unroll
      for (int nb = 0; nb < 32; ++nb) {
        const int col = n0 + nb * 8 + (lane & 3) * 2;
        if (col >= args.n_extent) continue;
        *reinterpret_cast<__nv_bfloat162*>(args.out0 + row * args.ldo + col) =
            __floats2bfloat162_rn(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1]);
      }
    }
  }
}

// The dSwiGLU epilogue of a consumer warpgroup's 64 rows x 256 columns of da in acc (layout
// as store_rows_tile's): dgate = da * u * silu'(g), dup = da * silu(g), g and u read from
// memory (args.g, args.u), dgate and dup stored (out.o[0], o[1] / args.out0, out1).
__device__ __forceinline__ void store_dswiglu_tile(const float (&acc)[128], const OutMaps& out, const RowsArgs& args,
                                                   char* staging, int row0, int row_end, int n0, int cw) {
  const int tid = threadIdx.x & 127, lane = tid & 31, w = tid >> 5;
  auto box_offset = [&](int r, int j) { return staging_offset(r, j, lane); };
  // da -> dgate = da * u * silu'(g), dup = da * silu(g), with g and u read from memory in
  // eight batches (h, 8 column blocks), the next batch's loads issued before this one's
  // stores: the compiler may not move the loads above stores that could alias them, and
  // one batch at a time left the tensor cores idle for a memory round trip per batch
  // (this kernel ran at 331 TFLOP/s against 430-540 for the other row GEMMs).
  // A tile whose columns all exist (every one at the bench shapes) takes no branch per
  // column: each batch's 8 pairs are one block the compiler interleaves.
  const bool all_cols = n0 + kWsBN <= args.n_extent;
  if (all_cols && row0 + cw * 64 + 64 <= row_end) {
    // The warpgroup's 64 rows are the expert's: four boxes of 64 columns, dgate in one
    // staging buffer and dup in the other, each half of the rows computed in place from
    // g and u (the next half's loads issued first), then both boxes go out by TMA.
    const int r0 = row0 + cw * 64;
    uint32_t gv[2][8], uv[2][8];  // [batch parity][column block]
    auto load = [&](int b, uint32_t(&g)[8], uint32_t(&u)[8]) {  // batch b: box b / 2, row half b % 2
      const int64_t o = static_cast<int64_t>(r0 + 16 * w + (lane >> 2) + 8 * (b & 1)) * args.ldo + n0 +
                        64 * (b >> 1) + (lane & 3) * 2;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        g[j] = *reinterpret_cast<const uint32_t*>(args.g + o + 8 * j);
        u[j] = *reinterpret_cast<const uint32_t*>(args.u + o + 8 * j);
      }
    };
    load(0, gv[0], uv[0]);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // both buffers read
      named_barrier(2 + cw, 128);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int b = 2 * q + h;
        if (b + 1 < 8) load(b + 1, gv[(b + 1) & 1], uv[(b + 1) & 1]);
        uint32_t(&g)[8] = gv[b & 1];
        uint32_t(&u)[8] = uv[b & 1];
        const int r = 16 * w + (lane >> 2) + 8 * h;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int nb = 8 * q + j;
          dswiglu_pair(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1], *reinterpret_cast<__nv_bfloat162*>(&g[j]),
                       *reinterpret_cast<__nv_bfloat162*>(&u[j]), g[j], u[j]);
          const int off = box_offset(r, j);
          *reinterpret_cast<uint32_t*>(staging + off) = g[j];
          *reinterpret_cast<uint32_t*>(staging + kOutBox + off) = u[j];
        }
      }
      fence_proxy_async();  // generic writes -> copy engine reads
      named_barrier(2 + cw, 128);
      if (tid == 0) {
        tma_store_2d(&out.o[0], staging, n0 + 64 * q, r0);            // dgate
        tma_store_2d(&out.o[1], staging + kOutBox, n0 + 64 * q, r0);  // dup
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
    }
    return;
  }
  __nv_bfloat162 gb[2][8], ub[2][8];
  auto load = [&](int b, __nv_bfloat162(&g)[8], __nv_bfloat162(&u)[8]) {
    const int64_t row = row0 + cw * 64 + w * 16 + (lane >> 2) + (b >> 2) * 8;
    if (row >= row_end) return;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = n0 + ((b & 3) * 8 + j) * 8 + (lane & 3) * 2;
      if (all_cols || col < args.n_extent) {
        g[j] = *reinterpret_cast<const __nv_bfloat162*>(args.g + row * args.ldo + col);
        u[j] = *reinterpret_cast<const __nv_bfloat162*>(args.u + row * args.ldo + col);
      }
    }
  };
  auto finish = [&](int b, const __nv_bfloat162(&g)[8], const __nv_bfloat162(&u)[8]) {
    const int h = b >> 2;
    const int64_t row = row0 + cw * 64 + w * 16 + (lane >> 2) + h * 8;
    if (row >= row_end) return;
    const int64_t o = row * args.ldo + n0 + (b & 3) * 64 + (lane & 3) * 2;
    if (all_cols) {
      uint32_t dg[8], du[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int nb = (b & 3) * 8 + j;
        dswiglu_pair(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1], g[j], u[j], dg[j], du[j]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<uint32_t*>(args.out0 + o + 8 * j) = dg[j];
        *reinterpret_cast<uint32_t*>(args.out1 + o + 8 * j) = du[j];
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int nb = (b & 3) * 8 + j;
      if (n0 + nb * 8 + (lane & 3) * 2 >= args.n_extent) return;
      store_dswiglu_pair(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1], g[j], u[j], args.out0 + o + 8 * j, args.out1 + o + 8 * j);
    }
  };
  load(0, gb[0], ub[0]);
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    if (b + 1 < 8) load(b + 1, gb[(b + 1) & 1], ub[(b + 1) & 1]);
    finish(b, gb[b & 1], ub[b & 1]);
  }
}

#endif  // MT_SM90A

template <bool kBKMajor, int kEpi>
__global__ void __launch_bounds__(kWsThreads, 1)
    rows_kernel(const __grid_constant__ Maps maps, const __grid_constant__ OutMaps out, const RowsArgs args,
                int ktiles_src, int nsrc, int col_tiles, int max_tiles) {
#if MT_SM90A
  constexpr bool kGateUp = kEpi == kEpiGateUp;
  constexpr int S = kWsStages;
  extern __shared__ char smem_raw[];
  uint64_t *full, *empty;
  char* smem = setup_smem<S, kWsStage>(smem_raw, full, empty);
  __shared__ int tile_of[S];
  const int wg = threadIdx.x >> 7, ktiles = ktiles_src * nsrc;

  if (wg == 0) {  // producer
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    produce_row_tiles<S, kWsStage>(smem, full, empty, tile_of, args, col_tiles, max_tiles, ktiles, ws_tile_cols(kEpi),
                                   [&](char* st, uint64_t* bar, int kt, int e, int row0, int n0) {
      char* sb = st + kTile;
      const int src = kt >= ktiles_src ? 1 : 0;
      const int k0 = (kt - src * ktiles_src) * kBK;
      tma_load_2d(st, &maps.a[src], bar, k0, row0);
      if constexpr (kGateUp) {  // 128 gate rows, then the same 128 rows of up
        tma_load_3d(sb, &maps.b[0], bar, k0, n0, e);
        tma_load_3d(sb + kTile, &maps.b[1], bar, k0, n0, e);
      } else if constexpr (kBKMajor) {
        tma_load_3d(sb, &maps.b[src], bar, k0, n0, e);
        tma_load_3d(sb + kTile, &maps.b[src], bar, k0, n0 + 128, e);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) tma_load_3d(sb + j * kChunk, &maps.b[src], bar, n0 + 64 * j, k0, e);
      }
    });
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1, tid = threadIdx.x & 127, lane = tid & 31;
  char* staging = smem + S * kWsStage + 1024 + cw * 2 * kOutBox;  // this warpgroup's two boxes
  int boxes = 0;  // boxes this warpgroup has stored: the next one goes to buffer boxes % 2
  int it = 0;
  // Bounded (a block never gets more than every tile): with an endless loop the compiler
  // keeps acc in local memory in the dSwiGLU kernel and serialises its wgmmas.
  const int last = max_tiles * col_tiles;
  for (int n = 0; n < last; ++n) {
    mbar_wait(&full[it % S], (it / S) & 1);  // the tile's first k-tile, or the end
    // Read by lane 0 only, which is the lane that releases the stage: its read is then
    // ordered before the release by program order, which compute-sanitizer's racecheck can
    // follow (a read by every lane, with lane 0 arriving for the warp, it reported as a
    // write-after-read hazard against the producer's next tile_of write).
    const int t = __shfl_sync(0xffffffffu, lane == 0 ? tile_of[it % S] : 0, 0);
    if (t < 0) break;
    const int rt = t / col_tiles, e = args.tile_expert[rt];
    const int row0 = args.tile_row[rt], row_end = args.offsets[e + 1];
    const int n0 = (t % col_tiles) * ws_tile_cols(kEpi);
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);  // (kt 0: already complete, returns at once)
      const uint32_t a = smem_u32(smem + s * kWsStage) + cw * 64 * 128, b = smem_u32(smem + s * kWsStage + kTile);
      pin(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // A: this warpgroup's 64 K-major rows, k16 steps 32 bytes into the swizzled rows.
        // B: 256 K-major rows the same way, or four MN-major [64 k][64 n] boxes 8 KB apart.
        const uint64_t da = sw128_desc(a + kk * 32, 16, 1024);
        const uint64_t db = kBKMajor ? sw128_desc(b + kk * 32, 16, 1024) : sw128_desc(b + kk * 2048, kChunk, 1024);
        wgmma_m64n256k16<0, kBKMajor ? 0 : 1>(acc, da, db);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the MMAs of the k-tile before are done: release its stage
      pin(acc);
      if (kt > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % S]);
    }
    wgmma_wait<0>();
    pin(acc);
    if (lane == 0) mbar_arrive(&empty[(it - 1) % S]);

    // acc[nb * 4 + h * 2 + c]: row 16 (tid / 32) + lane / 4 + 8 h of the warpgroup's 64 rows, column
    // nb * 8 + 2 (lane % 4) + c (gate/up: gate columns nb < 16, up columns nb + 16).
    if constexpr (kEpi == kEpiDSwiglu) {
      store_dswiglu_tile(acc, out, args, staging, row0, row_end, n0, cw);
    } else {
      store_rows_tile<kGateUp>(acc, out, args, staging, boxes, row0, row_end, n0, cw);
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // staging read before exit
#endif
}

// ---- FP8 row-grouped GEMMs (issue 30) ---------------------------------------------------
// rows_kernel's schedule, ring and epilogues with e4m3 operands, both K-major (Hopper's FP8
// MMA takes no transposed operand): the forward's gate/up and down, and the input
// gradient's da (B = each expert's Wd^T, epilogue dSwiGLU) and dx (K = 2I from two sources,
// dgate with Wg^T then dup with Wu^T). A 128-byte swizzled row holds 128 codes instead of 64
// bf16, so a k-tile is 128 deep with the stages' 48 KB unchanged, and a k-tile is exactly
// one 1 x 128 tile of the activations' scales and one 128 x 128 block of the weights'. Each
// k-tile's four k32 MMAs go into a fresh sum that is then multiplied by the row's and the
// block's scales and added to the f32 accumulators: DeepSeek-V3's promotion every 128 of K
// (Hopper's FP8 MMA keeps ~14 bits in its accumulator). A consumer warpgroup's 64 x 256 is
// made as two 64 x 128 halves, so that the fresh sum (64 registers a thread) fits beside the
// 128 accumulators; each half is waited for before it is promoted. H200, bench shape: 617 +
// 336 us against bf16's 773 + 424 (gate/up + down), SMs 52% and L2 39% busy (Nsight
// Compute): latency-bound. Tried and slower: four 64 x 64 quarters into two fresh sums, each
// quarter promoted under the next one's MMAs (746 + 394 us: the narrower MMAs read A from
// shared memory four times a k-tile). Rows past N (a tile's last) read a clamped scale: their
// outputs are never stored.
struct Fp8Scales {
  const float* a[2];  // the rows' scales [K_src / 128][N] per k source (quantize_fp8, rows mode)
  const float* b[2];  // the weights' block scales [E n / 128][ldb]: gate/up: gate, up; else per k source
  int n_rows;         // N
  int ldb;            // round_up(K_src / 128, 4)
  int b_blocks;       // n / 128: the block rows of one expert's weight
};
#if MT_SM90A
// The block scales of a tile's two weight halves at k-tile kk of k source `second` (expert e,
// first column n0): gate/up: gate's and up's block n0 / 128; else blocks n0 / 128 and the next,
// clamped to the expert's last (a half past the weight is zero-filled by TMA). (The sources
// are chosen by selects: a parameter array indexed at run time is copied to local memory.)
template <bool kGateUp>
__device__ __forceinline__ void weight_scale_ptrs(const Fp8Scales& sc, int e, int n0, int kk, bool second,
                                                  const float*& b0, const float*& b1) {
  const int brow0 = e * sc.b_blocks + n0 / 128;
  if constexpr (kGateUp) {
    b0 = sc.b[0] + static_cast<int64_t>(brow0) * sc.ldb + kk;
    b1 = sc.b[1] + static_cast<int64_t>(brow0) * sc.ldb + kk;
  } else {
    const int brow1 = min(brow0 + 1, (e + 1) * sc.b_blocks - 1);
    const float* bs = second ? sc.b[1] : sc.b[0];
    b0 = bs + static_cast<int64_t>(brow0) * sc.ldb + kk;
    b1 = bs + static_cast<int64_t>(brow1) * sc.ldb + kk;
  }
}
#endif  // MT_SM90A

// ktiles_src k-tiles of 128 from each of nsrc k sources (maps.a[src], maps.b[src]; gate/up:
// one source, maps.b[0] gate and maps.b[1] up). Each k-tile's scales are loaded by the
// consumers from global memory one k-tile ahead. Tried on 2026-12-07 and deleted, both
// (docs/fp8.md, session 32): (1) each consumer warp copying its rows' and the block's scales
// into shared memory by cp.async one k-tile ahead (no pending register load at the next
// wgmma.fence): the same time to the microsecond (gate/up 1.01 ms, input gradient 1.11 ms
// on an H100), so the scales' loads are not where this kernel waits; (2) the producer
// staging them with the operands (TMA for the rows', cp.async with a noinc arrival for the
// weights'): it trapped at its UTMALDG of the rows' scales, with a 1-D and with a 2-D map.
// Measured on 2026-12-07 and deleted: the two consumer warpgroups issuing their MMAs in turns
// (named barriers; each promoting under the other's MMAs, the remedy the stall samples
// pointed to), the same time to the microsecond (docs/fp8.md, session 33).
// kARegs (the forward's two launches): A's fragments of a k-tile loaded once into registers
// (ldmatrix) and the MMAs in the RS form, so that shared memory feeds only B. H100, bench
// shape: the forward 0.970 -> 0.947 ms (docs/fp8.md, session 35); the input gradient's
// launches keep A in shared memory (the same time, and the dSwiGLU variant spills more).
// S, kEpilogue: MOETRAIN_FP8_EXPERIMENT=stages3 / noepi (session 35's measurement of where
// the main loop waits: a 3-stage ring; no epilogue, outputs not written).
template <int kEpi, bool kARegs = false, int S = kWsStages, bool kEpilogue = true>
__global__ void __launch_bounds__(kWsThreads, 1)
    fp8_rows_kernel(const __grid_constant__ Maps maps, const __grid_constant__ OutMaps out, const RowsArgs args,
                    const Fp8Scales sc, const ActCodes codes, int ktiles_src, int nsrc, int col_tiles,
                    int max_tiles) {
#if MT_SM90A
  constexpr bool kGateUp = kEpi == kEpiGateUp;
  extern __shared__ char smem_raw[];
  __shared__ int tile_of[S];
  uint64_t *full, *empty;
  char* smem = setup_smem<S, kWsStage>(smem_raw, full, empty);
  const int wg = threadIdx.x >> 7, ktiles = ktiles_src * nsrc;

  if (wg == 0) {  // producer, as rows_kernel's (K-major weights, k-tiles of 128)
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    produce_row_tiles<S, kWsStage>(
        smem, full, empty, tile_of, args, col_tiles, max_tiles, ktiles, ws_tile_cols(kEpi),
        [&](char* st, uint64_t* bar, int kt, int e, int row0, int n0) {
          char* sb = st + kTile;
          const int src = kt >= ktiles_src ? 1 : 0;
          const int kk = kt - src * ktiles_src, k0 = kk * 128;
          tma_load_2d(st, &maps.a[src], bar, k0, row0);
          if constexpr (kGateUp) {  // 128 gate rows, then the same 128 rows of up
            tma_load_3d(sb, &maps.b[0], bar, k0, n0, e);
            tma_load_3d(sb + kTile, &maps.b[1], bar, k0, n0, e);
          } else {
            tma_load_3d(sb, &maps.b[src], bar, k0, n0, e);
            tma_load_3d(sb + kTile, &maps.b[src], bar, k0, n0 + 128, e);
          }
        });
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1, tid = threadIdx.x & 127, lane = tid & 31, w = tid >> 5;
  char* staging = smem + S * kWsStage + 1024 + cw * 2 * kOutBox;
  int boxes = 0;
  int it = 0;
  const int last = max_tiles * col_tiles;
  const int my_row = cw * 64 + 16 * w + (lane >> 2);  // this thread's first row in the tile (the second: + 8)
  for (int n = 0; n < last; ++n) {
    mbar_wait(&full[it % S], (it / S) & 1);
    const int t = __shfl_sync(0xffffffffu, lane == 0 ? tile_of[it % S] : 0, 0);
    if (t < 0) break;
    const int rt = t / col_tiles, e = args.tile_expert[rt];
    const int row0 = args.tile_row[rt], row_end = args.offsets[e + 1];
    const int n0 = (t % col_tiles) * ws_tile_cols(kEpi);
    // This thread's two rows (h = 0, 1; rows past N read a clamped scale: never stored) and
    // the two halves' weight block scales (weight_scale_ptrs).
    const int r_lo = row0 + my_row;
    const int ra0 = min(r_lo, sc.n_rows - 1), ra1 = min(r_lo + 8, sc.n_rows - 1);
    auto load_scales = [&](int kt, float (&v)[4]) {
      const bool second = kt >= ktiles_src;
      const int kk = second ? kt - ktiles_src : kt;
      const float* sa = (second ? sc.a[1] : sc.a[0]) + static_cast<int64_t>(kk) * sc.n_rows;
      v[0] = sa[ra0];
      v[1] = sa[ra1];
      const float *b0, *b1;
      weight_scale_ptrs<kGateUp>(sc, e, n0, kk, second, b0, b1);
      v[2] = *b0;
      v[3] = *b1;
    };
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    float next[4] = {1.f, 1.f, 1.f, 1.f};
    load_scales(0, next);
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % S;
      float cur[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) cur[i] = next[i];
      if (kt + 1 < ktiles) load_scales(kt + 1, next);
      mbar_wait(&full[s], (it / S) & 1);
      const uint32_t a = smem_u32(smem + s * kWsStage) + cw * 64 * 128, b = smem_u32(smem + s * kWsStage + kTile);
      uint32_t af[4][4];
      if constexpr (kARegs) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldmatrix_a_e4m3(af[kk], a, kk);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float part[64];
        if constexpr (kARegs) {
          fp8_fresh_sum_rs(part, af, b + half * kTile);
        } else {
          fp8_fresh_sum(part, a, b + half * kTile);
        }
        const float sbh = cur[2 + half], s0 = cur[0] * sbh, s1 = cur[1] * sbh;
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[half * 64 + i] += part[i] * ((i & 2) ? s1 : s0);  // part[4j + 2h + c]
      }
      if (lane == 0) mbar_arrive(&empty[s]);  // both halves' MMAs are done with the stage
    }
    if constexpr (!kEpilogue) {
      pin(acc);  // every promotion stays (only the epilogue goes)
      if (acc[0] == 12345.f && acc[127] == -12345.f) args.out0[0] = bf16(0.f);
    } else if constexpr (kEpi == kEpiDSwiglu) {
      store_dswiglu_tile(acc, out, args, staging, row0, row_end, n0, cw);
    } else {
      store_rows_tile<kGateUp, kGateUp>(acc, out, args, staging, boxes, row0, row_end, n0, cw, codes);
    }
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// Weight-gradient GEMM, warp-specialised and persistent: the same tiles (128 x 256 of one
// expert's C, each reduced over the expert's rows in order) and results as
// grouped_wgrad_kernel; a block owns a multiprocessor and walks tiles, so that one tile's
// f32 store drains to memory while the next tile's MMAs run. With a block per tile (the
// version before), Nsight showed neither
// DRAM (54%) nor the tensor pipes busy: each block filled its ring, ran ~8 k-tiles, then
// stored 128 KB of f32 with the tensor cores idle.
//   warpgroup 0  the producer: one thread takes tiles from the queues (WgradArgs) and
//                issues the TMA copies of every k-tile into the 4-stage ring, running ahead
//                into the next tile while the consumers store; tile_of[stage] carries the
//                tile with its first k-tile (a tile of an expert without rows, in overwrite
//                mode, comes as a stage with no data; -1 ends the loop);
//   warpgroups 1, 2  the consumers: 64 rows x 256 columns each, then the epilogue: the
//                accumulators go to shared memory 32 columns (8 KB) at a time, two buffers
//                per warpgroup, each box stored (or reduce-added) by a TMA copy that runs
//                while the next box is written and, for the last two, while the next tile's
//                main loop runs. maps.c: box 32 x 64 x 1.
// bench_ops backward_weight (overwrite, as the step calls it), H100: 1.94 ms with a block
// per tile, 1.71 ms here. Measured and dropped: tiles of 128 x 128 with room for a whole
// tile's stores (2.04 ms: narrower MMAs, 33% more operand bytes per FLOP); more staging
// buffers for fewer stages (3 stages + 4 or 5 buffers: 1.77, 1.79 ms; 2 + 8: 2.05 ms): the
// ring's depth matters, the stores' waits do not; claiming each tile one tile ahead, to
// take the queue atomic off the producer's path (1.74 ms, and the row GEMMs lost 0.1 ms).
// Squares (overwrite mode): two slots a tile, one per consumer warpgroup, each summed in
// a fixed order.
constexpr int kWgS = 4, kWgN = 256;
constexpr int kWgStage = kTile + kWgN * 128;  // 48 KB
constexpr int kWgBox = 64 * 32 * 4;           // one consumer's 64 rows x 32 f32 columns
constexpr int kWgBufs = 2;                    // staging buffers per consumer warpgroup
// The ring, one 1024-byte slot for its barriers, then the staging buffers (1024-aligned for
// the 128-byte swizzle), + the alignment slack.
constexpr int kWgSmem = 1024 + kWgS * kWgStage + 1024 + 2 * kWgBufs * kWgBox;

#if MT_SM90A
// The weight-gradient kernels' producers: a stage without data (the end, t = -1, or a tile
// whose zeros are to be stored) for the consumers: waits until ring position `it` is free,
// publishes {t, 0 k-tiles} in tile_of and arrives on its full barrier.
template <int S>
__device__ __forceinline__ void publish_dataless_stage(uint64_t* full, uint64_t* empty, int2* tile_of, int& it,
                                                       int t) {
  const int s = it % S;
  if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);
  tile_of[s] = make_int2(t, 0);
  mbar_arrive(&full[s]);
  ++it;
}
#endif  // MT_SM90A

#if MT_SM90A
// The weight-gradient kernels' epilogue: a consumer warpgroup's 64 rows x 256 f32 columns (acc
// in the m64n256 layout: acc[nb * 4 + h * 2 + c] is row 16 w + lane / 4 + 8 h, column nb * 8 +
// 2 (lane % 4) + c) go to dW [E, M, Nc] (cmap, box 32 x 64 x 1) at rows m0 + 64 cw, columns
// n0.., 32 columns (8 KB) at a time through kBufs staging buffers, each stored (or
// reduce-added, with accumulate) by a TMA copy that runs while the next box is written and,
// for the last ones, while the next tile's main loop runs. `boxes` counts the stores.
template <int kBufs>
__device__ __forceinline__ void store_wgrad_tile(const float (&acc)[128], const CUtensorMap* cmap, char* staging,
                                                 int& boxes, int accumulate, int m0, int n0, int e, int cw) {
  const int tid = threadIdx.x & 127, lane = tid & 31, w = tid >> 5;
#pragma unroll
  for (int j = 0; j < 256 / 32; ++j, ++boxes) {  // box j: columns 32 j .. (nb = 4 j .. 4 j + 3)
    char* buf = staging + (boxes % kBufs) * kWgBox;
    if (tid == 0) {  // buf's last store (kBufs copies ago) has read it
      asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kBufs - 1) : "memory");
    }
    named_barrier(2 + cw, 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = w * 16 + (lane >> 2) + h * 8;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int nb = 4 * j + q, c = q * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(buf + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4) =
            make_float2(acc[nb * 4 + h * 2], acc[nb * 4 + h * 2 + 1]);
      }
    }
    fence_proxy_async();  // generic writes -> copy engine reads
    named_barrier(2 + cw, 128);
    if (tid == 0) {
      if (accumulate) {
        asm volatile(
            "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                reinterpret_cast<uint64_t>(cmap)),
            "r"(smem_u32(buf)), "r"(n0 + 32 * j), "r"(m0 + cw * 64), "r"(e)
            : "memory");
      } else {
        asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                         reinterpret_cast<uint64_t>(cmap)),
                     "r"(smem_u32(buf)), "r"(n0 + 32 * j), "r"(m0 + cw * 64), "r"(e)
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
}
#endif  // MT_SM90A

template <int kProblems>
__global__ void __launch_bounds__(kWsThreads, 1)
    wgrad_ws_kernel(const __grid_constant__ WgradMaps maps, const WgradArgs args, int gx, int gy, int tiles) {
#if MT_SM90A
  constexpr int S = kWgS, kBufs = kWgBufs, kBoxes = kWgN / 64;
  extern __shared__ char smem_raw[];
  uint64_t *full, *empty;
  char* smem = setup_smem<S, kWgStage>(smem_raw, full, empty);
  char* staging = smem + S * kWgStage + 1024;
  __shared__ int2 tile_of[S];  // {tile, its k-tiles}, at the stage of its first k-tile
  __shared__ int valid_of[S];  // rows of the stage's k-tile that belong to the tile's expert
  __shared__ double warp_sq[8];
  const int wg = threadIdx.x >> 7;
  // Tile t: column tile t % gx, row tile (t / gx) % gy, (expert, problem) t / (gx gy).

  if (wg == 0) {  // producer
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    TileQueues queues{args.next, args.sm_half ? args.queue_split : tiles, tiles,
                      args.sm_half ? args.sm_half[sm_id()] : 0};
    int it = 0;  // stages used so far: the ring position
    for (;;) {
      const int t = queues.take();
      // The expert's rows in each micro-batch: [r0[m], r1[m]), k-tiles in that order.
      int r0[kWgradSources], r1[kWgradSources], ktiles = 0;
      if (t >= 0) {
        const int e = t / (gx * gy) / kProblems;
        for (int m = 0; m <= args.n_more; ++m) {
          const int* off = m == 0 ? args.offsets : args.offsets_more[m - 1];
          r0[m] = off[e];
          r1[m] = off[e + 1];
          ktiles += (r1[m] - r0[m] + kBK - 1) / kBK;
        }
      }
      if (t >= 0 && ktiles == 0 && args.accumulate) continue;  // nothing to add to this tile
      if (ktiles == 0) {  // the end (-1), or zeros to store
        publish_dataless_stage<S>(full, empty, tile_of, it, t);
        if (t < 0) break;
        continue;
      }
      const int bz = t / (gx * gy), prob = bz % kProblems;
      const int m0 = ((t / gx) % gy) * kBM, n0 = (t % gx) * kWgN;
      int m = 0, row = r0[0];  // the micro-batch and row of k-tile kt
      for (int kt = 0; kt < ktiles; ++kt, ++it, row += kBK) {
        while (row >= r1[m]) row = r0[++m];  // (a micro-batch without rows has no k-tile)
        const int s = it % S;
        if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);  // its previous k-tile has left it
        char* st = smem + s * kWgStage;
        if (kt == 0) tile_of[s] = make_int2(t, ktiles);  // published by the arrive below
        valid_of[s] = r1[m] - row;
        const CUtensorMap* am = m == 0 ? &maps.m.a[prob] : &maps.xa[m - 1][prob];
        const CUtensorMap* bm = m == 0 ? &maps.m.b[0] : &maps.xb[m - 1];
        mbar_arrive_expect_tx(&full[s], kWgStage);
        tma_load_2d(st, am, &full[s], m0, row);
        tma_load_2d(st + kChunk, am, &full[s], m0 + 64, row);
#pragma unroll
        for (int j = 0; j < kBoxes; ++j) tma_load_2d(st + kTile + j * kChunk, bm, &full[s], n0 + 64 * j, row);
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1, tid = threadIdx.x & 127, ctid = threadIdx.x - 128, lane = tid & 31, w = tid >> 5;
  char* my_staging = staging + cw * kBufs * kWgBox;
  int it = 0, boxes = 0;  // stages consumed; boxes this warpgroup has stored
  for (int n = 0; n < tiles; ++n) {  // bounded, as in rows_kernel
    mbar_wait(&full[it % S], (it / S) & 1);
    // tile_of and valid_of are read by lane 0 only, the lane that releases the stage (as
    // rows_kernel's tile_of).
    const int2 info = lane == 0 ? tile_of[it % S] : int2{0, 0};
    const int t = __shfl_sync(0xffffffffu, info.x, 0), ktiles = __shfl_sync(0xffffffffu, info.y, 0);
    if (t < 0) break;
    const int bz = t / (gx * gy), e = bz / kProblems, prob = bz % kProblems;
    const int m0 = ((t / gx) % gy) * kBM, n0 = (t % gx) * kWgN;
    float acc[kWgN / 2];
#pragma unroll
    for (int i = 0; i < kWgN / 2; ++i) acc[i] = 0.f;
    if (ktiles == 0) {
      if (lane == 0) mbar_arrive(&empty[it % S]);
      ++it;
    }
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);
      char* st = smem + s * kWgStage;
      const int valid = __shfl_sync(0xffffffffu, lane == 0 ? valid_of[s] : 0, 0);
      if (valid < kBK) {
        // The last k-tile (of each micro-batch) runs past the expert's rows into the next
        // expert's: zero those rows of B (whole 128-byte rows, so the swizzle does not
        // matter) before the MMAs.
        char* b = st + kTile;
        for (int i = ctid; i < kBoxes * (kBK - valid) * 8; i += 256) {
          const int chunk = i / ((kBK - valid) * 8), rem = i % ((kBK - valid) * 8);
          *reinterpret_cast<uint4*>(b + chunk * kChunk + (valid + rem / 8) * 128 + (rem % 8) * 16) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();  // generic writes -> tensor core reads
        named_barrier(1, 256);
      }
      const uint32_t a = smem_u32(st), b = smem_u32(st + kTile);
      pin(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // MN-major operands: [64 k][64] boxes, k16 steps are 16 rows of 128 bytes; this
        // warpgroup's 64 rows of A are the box at cw.
        const uint64_t da = sw128_desc(a + cw * kChunk + kk * 2048, kChunk, 1024);
        const uint64_t db = sw128_desc(b + kk * 2048, kChunk, 1024);
        wgmma_m64n256k16<1, 1>(acc, da, db);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the MMAs of the k-tile before are done: release its stage
      pin(acc);
      if (kt > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % S]);
    }
    wgmma_wait<0>();  // (also with no k-tiles: a wait on every path keeps the compiler from adding its own)
    pin(acc);
    if (ktiles > 0 && lane == 0) mbar_arrive(&empty[(it - 1) % S]);

    if (args.squares) {  // the tile's share of the gradient norm (overwrite mode only)
      double sq = 0.0;
#pragma unroll
      for (int i = 0; i < kWgN / 2; ++i) sq += static_cast<double>(acc[i]) * acc[i];
      sq = warp_reduce(sq, SumOp{});
      if (lane == 0) warp_sq[cw * 4 + w] = sq;
      named_barrier(2 + cw, 128);
      if (tid == 0) {
        args.squares[args.squares_base + 2 * static_cast<int64_t>(t) + cw] =
            ((warp_sq[cw * 4] + warp_sq[cw * 4 + 1]) + warp_sq[cw * 4 + 2]) + warp_sq[cw * 4 + 3];
      }
    }
    store_wgrad_tile<kBufs>(acc, &maps.m.c[prob], my_staging, boxes, args.accumulate, m0, n0, e, cw);
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // shared memory read before exit
#endif
}

// ---- the experts' weight gradient in FP8 (issue 30) ---------------------------------------
// dW_e [M, Nc] = (or +=) the sum over expert e's tiles j of A_j B_j^T, A = a_t [M, P] and
// B = b_t [Nc, P] from quantize_fp8_expert_columns: both K-major along the experts' padded
// tokens (zero codes past each expert's rows, so no k-tile needs masking), a scale per row
// of A and per row of B each k-tile. wgrad_ws_kernel's tiles (128 x 256 of one expert's dW,
// reduced over its k-tiles in order), ring and epilogue, with rows_kernel's FP8 main loop:
// each k-tile's two 64 x 128 halves a fresh sum, promoted as acc += part s_a[row] s_b[col]
// (DeepSeek-V3's promotion every 128 of K). A stage brings the k-tile's codes (48 KB) and its
// scales (A's 128 rows, B's 256 columns: plain f32 TMA boxes) on one barrier; the consumers
// read the scales from shared memory. One staging buffer per consumer warpgroup (the
// scales' 6 KB take the second's place). Up to kFp8WgradSources micro-batches (sources) a
// launch: a tile's k loop runs over every source's tiles of its expert in turn, so dW is
// written or added to once for all of them (gradient accumulation).
constexpr int kFp8WgradSources = kFp8WgradMaxSources;
struct Fp8WgradMaps {
  CUtensorMap a[kFp8WgradSources], b[kFp8WgradSources];    // codes [M, P], [Nc, P]: boxes 128 k x 128 rows
  CUtensorMap sa[kFp8WgradSources], sb[kFp8WgradSources];  // scales [T][M], [T][Nc] (plain f32): boxes 128 x 1, 256 x 1
  CUtensorMap c;                                           // dW [E, M, Nc] f32: box 32 x 64 x 1
};
struct Fp8WgradArgs {
  // Per source [E + 1]: expert e's k-tiles are [first_tile[e], first_tile[e + 1]).
  const int* first_tile[kFp8WgradSources];
  int sources;
  int accumulate;  // 0: dW = the sum (an expert without rows gets zeros)
  int* next;       // the tile queue's two counters, zero before the launch
};
constexpr int kF8WgS = 4, kF8WgBufs = 1;
constexpr int kF8WgStage = 3 * kTile;  // A: 128 rows x 128 codes; B: 256 rows x 128 codes
constexpr int kF8WgScaleA = kF8WgS * kF8WgStage + 2 * kF8WgBufs * kWgBox;
constexpr int kF8WgScaleB = kF8WgScaleA + kF8WgS * 128 * 4;
constexpr int kF8WgBar = kF8WgScaleB + kF8WgS * 256 * 4;
constexpr int kF8WgSmem = 1024 + kF8WgBar + 2 * kF8WgS * 8 + kF8WgS * 8;
static_assert(kF8WgSmem <= 232448 - 64, "shared memory of the FP8 weight-gradient kernel");

__global__ void __launch_bounds__(kWsThreads, 1)
    fp8_wgrad_kernel(const __grid_constant__ Fp8WgradMaps maps, const Fp8WgradArgs args, int gx, int gy, int tiles) {
#if MT_SM90A
  constexpr int S = kF8WgS;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* scale_a = reinterpret_cast<float*>(smem + kF8WgScaleA);  // [S][128]
  float* scale_b = reinterpret_cast<float*>(smem + kF8WgScaleB);  // [S][256]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kF8WgBar);
  uint64_t* empty = full + S;
  int2* tile_of = reinterpret_cast<int2*>(empty + S);  // {tile, its k-tiles}, at the stage of its first k-tile
  init_ring_barriers<S>(full, empty);
  const int wg = threadIdx.x >> 7;
  // Tile t: column tile t % gx (256 columns of Nc), row tile (t / gx) % gy (128 rows of M),
  // expert t / (gx gy).

  if (wg == 0) {  // producer
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    TileQueues queues{args.next, tiles, tiles, 0};
    int it = 0;  // stages used so far: the ring position
    for (;;) {
      const int t = queues.take();
      int first[kFp8WgradSources], count[kFp8WgradSources], ktiles = 0;  // each source's tiles of the expert
      if (t >= 0) {
        const int e = t / (gx * gy);
        for (int src = 0; src < args.sources; ++src) {
          first[src] = args.first_tile[src][e];
          count[src] = args.first_tile[src][e + 1] - first[src];
          ktiles += count[src];
        }
      }
      if (t >= 0 && ktiles == 0 && args.accumulate) continue;  // nothing to add to this tile
      if (ktiles == 0) {  // the end (-1), or zeros to store
        publish_dataless_stage<S>(full, empty, tile_of, it, t);
        if (t < 0) break;
        continue;
      }
      const int m0 = ((t / gx) % gy) * 128, n0 = (t % gx) * 256;
      int src = 0, j = 0;  // the source of k-tile kt and its index among that source's tiles
      for (int kt = 0; kt < ktiles; ++kt, ++it, ++j) {
        while (j >= count[src]) {  // (a source without rows of the expert has no k-tile)
          ++src;
          j = 0;
        }
        const int s = it % S, tile = first[src] + j;
        if (it >= S) mbar_wait(&empty[s], ((it / S) - 1) & 1);  // its previous k-tile has left it
        char* st = smem + s * kF8WgStage;
        if (kt == 0) tile_of[s] = make_int2(t, ktiles);  // published by the arrive below
        mbar_arrive_expect_tx(&full[s], kF8WgStage + (128 + 256) * 4);
        tma_load_2d(st, &maps.a[src], &full[s], tile * 128, m0);
        tma_load_2d(st + kTile, &maps.b[src], &full[s], tile * 128, n0);
        tma_load_2d(st + 2 * kTile, &maps.b[src], &full[s], tile * 128, n0 + 128);
        tma_load_2d(scale_a + s * 128, &maps.sa[src], &full[s], m0, tile);
        tma_load_2d(scale_b + s * 256, &maps.sb[src], &full[s], n0, tile);
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1, tid = threadIdx.x & 127, lane = tid & 31, w = tid >> 5;
  const int my_row = cw * 64 + 16 * w + (lane >> 2);  // this thread's first row of the tile (the second: + 8)
  char* staging = smem + S * kF8WgStage + cw * kF8WgBufs * kWgBox;
  int it = 0, boxes = 0;  // stages consumed; boxes this warpgroup has stored
  for (int n = 0; n < tiles; ++n) {  // bounded, as in rows_kernel
    mbar_wait(&full[it % S], (it / S) & 1);
    const int2 info = lane == 0 ? tile_of[it % S] : int2{0, 0};  // read by the releasing lane (rows_kernel)
    const int t = __shfl_sync(0xffffffffu, info.x, 0), ktiles = __shfl_sync(0xffffffffu, info.y, 0);
    if (t < 0) break;
    const int e = t / (gx * gy), m0 = ((t / gx) % gy) * 128, n0 = (t % gx) * 256;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    if (ktiles == 0) {
      if (lane == 0) mbar_arrive(&empty[it % S]);
      ++it;
    }
    for (int kt = 0; kt < ktiles; ++kt, ++it) {
      const int s = it % S;
      mbar_wait(&full[s], (it / S) & 1);
      const float ra0 = scale_a[s * 128 + my_row], ra1 = scale_a[s * 128 + my_row + 8];
      const uint32_t a = smem_u32(smem + s * kF8WgStage) + cw * 64 * 128, b = smem_u32(smem + s * kF8WgStage + kTile);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float part[64];
        fp8_fresh_sum(part, a, b + half * kTile);
        // part[4 nb + 2 h + c]: row my_row + 8 h, column half 128 + 8 nb + 2 (lane % 4) + c
        const float* cs = scale_b + s * 256 + half * 128 + 2 * (lane & 3);
#pragma unroll
        for (int nb = 0; nb < 16; ++nb) {
          const float2 c = *reinterpret_cast<const float2*>(cs + 8 * nb);
          float* o = acc + half * 64 + 4 * nb;
          o[0] += part[4 * nb] * (ra0 * c.x);
          o[1] += part[4 * nb + 1] * (ra0 * c.y);
          o[2] += part[4 * nb + 2] * (ra1 * c.x);
          o[3] += part[4 * nb + 3] * (ra1 * c.y);
        }
      }
      if (lane == 0) mbar_arrive(&empty[s]);  // both halves' MMAs and the scales' reads are done
    }
    store_wgrad_tile<kF8WgBufs>(acc, &maps.c, staging, boxes, args.accumulate, m0, n0, e, cw);
  }
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // shared memory read before exit
#endif
}

}  // namespace hopper

// ---- schedule: counts -> offsets [E+1] and the row-tile list -----------------------------
// Counts are clamped to [0, N] and the offsets to N, so inconsistent counts cannot send a
// block outside the N rows (rows past sum(counts) are then left unwritten).
__global__ void __launch_bounds__(kScheduleThreads)
    swiglu_schedule_kernel(const int64_t* __restrict__ counts, int E, int N, int max_tiles, int* __restrict__ offsets,
                           int* __restrict__ tile_expert, int* __restrict__ tile_row, int* __restrict__ queue,
                           int share0, int share_all) {
  __shared__ long long s_off[kSwigluMaxExperts + 1];
  __shared__ int s_tile[kSwigluMaxExperts + 1];
  __shared__ long long scratch64[33];
  __shared__ int scratch32[33];
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) {
    const long long c = counts[e];
    s_off[e] = c < 0 ? 0 : (c > N ? N : c);
  }
  __syncthreads();
  const long long total = block_exclusive_scan(s_off, E, scratch64);
  if (tid == 0) s_off[E] = total;
  __syncthreads();
  for (int e = tid; e <= E; e += blockDim.x) {
    const long long o = s_off[e] < N ? s_off[e] : N;
    s_off[e] = o;
    offsets[e] = static_cast<int>(o);
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) s_tile[e] = static_cast<int>((s_off[e + 1] - s_off[e] + kBM - 1) / kBM);
  __syncthreads();
  const int ntiles = block_exclusive_scan(s_tile, E, scratch32);
  if (tid == 0) s_tile[E] = ntiles;
  if (tid < kQueueWords) {  // the rows kernels' queues: tiles, split; every launch's counters zeroed
    const int split = share_all > 0 ? static_cast<int>((static_cast<long long>(ntiles) * share0 + share_all / 2) /
                                                       share_all)
                                    : ntiles;
    queue[tid] = tid == 0 ? ntiles : tid == 1 ? split : 0;
  }
  __syncthreads();
  for (int t = tid; t < max_tiles; t += blockDim.x) {
    if (t >= ntiles) {
      tile_expert[t] = -1;
      tile_row[t] = 0;
      continue;
    }
    int lo = 0, hi = E;  // s_tile[lo] <= t < s_tile[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (s_tile[mid] <= t) lo = mid;
      else hi = mid;
    }
    tile_expert[t] = lo;
    tile_row[t] = static_cast<int>(s_off[lo]) + (t - s_tile[lo]) * kBM;
  }
}

// act = silu(gate) * up, 8 elements a thread (n a multiple of 8).
__global__ void swiglu_act_kernel(const bf16* __restrict__ g, const bf16* __restrict__ u, bf16* __restrict__ a,
                                  int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  float gv[8], uv[8], av[8];
  load8(g + i, gv);
  load8(u + i, uv);
#pragma unroll
  for (int q = 0; q < 8; ++q) av[q] = gv[q] * sigmoidf_(gv[q]) * uv[q];
  store8(a + i, av);
}

struct Schedule {
  int* offsets;
  int* tile_expert;
  int* tile_row;
  int* queue;  // kQueueWords: the Hopper rows kernels' queues (two launches' counters)
  int max_tiles;
  const uint8_t* sm_half;
};

// halves: the L2 halves the queues are split for (nullptr or unknown: one queue).
Schedule make_schedule(const int64_t* counts, int64_t N, int E, int32_t* workspace, bool tiles, cudaStream_t stream,
                       const SmHalves* halves = nullptr) {
  Schedule s;
  s.max_tiles = tiles ? static_cast<int>(swiglu_max_tiles(N, E)) : 0;
  s.offsets = workspace;
  s.tile_expert = workspace + (E + 1);
  s.tile_row = s.tile_expert + s.max_tiles;
  s.queue = s.tile_row + s.max_tiles;
  const bool split = halves && halves->known();
  s.sm_half = split ? halves->device_map : nullptr;
  swiglu_schedule_kernel<<<1, kScheduleThreads, 0, stream>>>(
      counts, E, static_cast<int>(N), s.max_tiles, s.offsets, s.tile_expert, s.tile_row, s.queue,
      split ? halves->count[0] : 0, split ? halves->count[0] + halves->count[1] : 0);
  return s;
}

// The queue fields of a rows launch: launch 0 or 1 of the schedule (each its own counters).
// A rows launch's arguments with the schedule's tiles (the rest is set per launch).
RowsArgs rows_args(const Schedule& s) {
  RowsArgs a{};
  a.offsets = s.offsets;
  a.tile_expert = s.tile_expert;
  a.tile_row = s.tile_row;
  return a;
}

void set_queues(RowsArgs& a, const Schedule& s, int launch) {
  a.queue = s.queue;
  a.next = s.queue + 2 + 2 * launch;
  a.sm_half = s.sm_half;
}

template <bool kBKMajor, int kEpi>
void launch_rows(const RowsArgs& args, int n_tiles, int max_tiles, cudaStream_t stream) {
  if (n_tiles == 0 || max_tiles == 0) return;
  auto kernel = grouped_rows_gemm_kernel<kBKMajor, kEpi>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  kernel<<<dim3(n_tiles, max_tiles), kThreads, kSmemBytes, stream>>>(args);
}

// Both weight-gradient kernels: a block per 128 x 128 tile of each expert's C, per problem.
dim3 wgrad_grid(int M, int Nc, int E, int problems) {
  return dim3((Nc + kBN - 1) / kBN, (M + kBM - 1) / kBM, E * problems);
}
int64_t blocks_of(dim3 g) { return static_cast<int64_t>(g.x) * g.y * g.z; }

template <int kProblems>
void launch_wgrad(const WgradArgs& args, int E, cudaStream_t stream) {
  if (args.M == 0 || args.Nc == 0) return;
  auto kernel = grouped_wgrad_kernel<kProblems>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const dim3 grid = wgrad_grid(args.M, args.Nc, E, kProblems);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(args);
}

// ---- Hopper host side: tensor maps and dispatch ------------------------------------------
bool use_hopper() { return hopper_kernels_usable("MOETRAIN_SWIGLU_MMA_SYNC"); }


bool make_map(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
              std::initializer_list<uint32_t> box, bool f32 = false) {
  return make_tensor_map(map, base, dims, box, f32);
}

// The grid of a persistent kernel: one block per multiprocessor, fewer with fewer tiles.
// Any grid is correct (blocks take tiles until none is left), so if the query fails every
// tile gets its own block.
int persistent_grid(int64_t tiles) {
  int dev = 0, num_sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || num_sms <= 0) {
    cudaGetLastError();
    num_sms = INT32_MAX;
  }
  return static_cast<int>(tiles < num_sms ? tiles : num_sms);
}

template <typename Kernel>
void prepare_hopper(Kernel kernel, int smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

// n_cols: output columns of the launch (gate/up: I, each tile takes 128 of gate and of up).
// out: the maps of the bf16 outputs (box 64 x 64), see OutMaps.
template <bool kBKMajor, int kEpi>
void launch_rows_hopper(const hopper::Maps& maps, const hopper::OutMaps& out, const RowsArgs& args, int ktiles_src,
                        int nsrc, int n_cols, int max_tiles, cudaStream_t stream) {
  if (n_cols == 0 || max_tiles == 0) return;
  auto kernel = hopper::rows_kernel<kBKMajor, kEpi>;
  constexpr int smem = hopper::kRowsSmem;
  prepare_hopper(kernel, smem);
  const int col_tiles = (n_cols + hopper::ws_tile_cols(kEpi) - 1) / hopper::ws_tile_cols(kEpi);
  const int grid = persistent_grid(static_cast<int64_t>(col_tiles) * max_tiles);
  kernel<<<grid, hopper::kWsThreads, smem, stream>>>(maps, out, args, ktiles_src, nsrc, col_tiles, max_tiles);
}

// MOETRAIN_FP8_EXPERIMENT, read once (an unknown value is named and ignored): 1 stages3, 2
// noepi, else 0 (launch_fp8_rows_hopper).
int fp8_rows_experiment() {
  static const int experiment = [] {
    const char* x = std::getenv("MOETRAIN_FP8_EXPERIMENT");
    const std::string_view v = x != nullptr ? x : "";
    if (v == "stages3") return 1;
    if (v == "noepi") return 2;
    if (!v.empty() && v != "none") {
      std::fprintf(stderr, "moetrain: MOETRAIN_FP8_EXPERIMENT=%s is none of none, stages3, noepi: ignored\n", x);
    }
    return 0;
  }();
  return experiment;
}

// The FP8 rows kernel over K = 128 ktiles_src from each of nsrc sources (n_cols as
// launch_rows_hopper's).
template <int kEpi, bool kARegs>
void launch_fp8_rows_hopper(const hopper::Maps& maps, const hopper::OutMaps& out, const RowsArgs& args,
                            const hopper::Fp8Scales& scales, const hopper::ActCodes& codes, int ktiles_src, int nsrc,
                            int n_cols, int max_tiles, cudaStream_t stream) {
  if (n_cols == 0 || max_tiles == 0) return;
  auto kernel = hopper::fp8_rows_kernel<kEpi, kARegs>;
  if constexpr (kEpi != kEpiDSwiglu) {
    const int experiment = fp8_rows_experiment();
    if (experiment == 1) kernel = hopper::fp8_rows_kernel<kEpi, kARegs, 3, true>;
    if (experiment == 2) kernel = hopper::fp8_rows_kernel<kEpi, kARegs, hopper::kWsStages, false>;  // timing only
  }
  prepare_hopper(kernel, hopper::kRowsSmem);
  const int col_tiles = (n_cols + hopper::ws_tile_cols(kEpi) - 1) / hopper::ws_tile_cols(kEpi);
  const int grid = persistent_grid(static_cast<int64_t>(col_tiles) * max_tiles);
  kernel<<<grid, hopper::kWsThreads, hopper::kRowsSmem, stream>>>(maps, out, args, scales, codes, ktiles_src, nsrc,
                                                                   col_tiles, max_tiles);
}

static_assert(sizeof(hopper::Fp8WgradMaps) + sizeof(hopper::Fp8WgradArgs) + 3 * sizeof(int) <= 4096,
              "fp8_wgrad_kernel's parameters must fit the 4 KB every driver takes");
static_assert(sizeof(hopper::WgradMaps) + sizeof(WgradArgs) + 3 * sizeof(int) <= 4096,
              "wgrad_ws_kernel's parameters must fit the 4 KB every driver takes");

// The persistent weight-gradient kernel (wgrad_ws_kernel): maps.c with boxes of 32 x 64 x 1.
// Returns its slots in args.squares: two a tile.
template <int kProblems>
int64_t launch_wgrad_ws(const hopper::WgradMaps& maps, WgradArgs args, int E, const Schedule& s, int launch,
                        cudaStream_t stream) {
  if (args.M == 0 || args.Nc == 0) return 0;
  auto kernel = hopper::wgrad_ws_kernel<kProblems>;
  constexpr int smem = hopper::kWgSmem;
  prepare_hopper(kernel, smem);
  const int gx = (args.Nc + hopper::kWgN - 1) / hopper::kWgN, gy = (args.M + kBM - 1) / kBM;
  const int tiles = gx * gy * E * kProblems;
  args.next = s.queue + 2 + 2 * launch;
  const SmHalves* halves = &sm_l2_halves(stream);
  if (halves->known()) {  // each half a run of whole experts, in proportion to its multiprocessors
    args.sm_half = halves->device_map;
    const int64_t all = halves->count[0] + halves->count[1];
    const int64_t z0 = (static_cast<int64_t>(E) * kProblems * halves->count[0] + all / 2) / all;
    args.queue_split = static_cast<int>(z0 / kProblems * kProblems * gx * gy);
  }
  kernel<<<persistent_grid(tiles), hopper::kWsThreads, smem, stream>>>(maps, args, gx, gy, tiles);
  return 2 * static_cast<int64_t>(tiles);
}

const bf16* cb(const void* p) { return static_cast<const bf16*>(p); }
bf16* mb(void* p) { return static_cast<bf16*>(p); }

}  // namespace

int64_t swiglu_max_tiles(int64_t N, int E) { return (N + kBM - 1) / kBM + E; }

int64_t swiglu_workspace_words(int64_t N, int E) { return (E + 1) + 2 * swiglu_max_tiles(N, E) + kQueueWords; }

int64_t swiglu_squares_scratch_doubles(int H, int I, int E) {
  // Hopper: two slots per 128 x 256 tile (one per consumer warpgroup).
  auto wide = [&](int M, int Nc, int problems) {
    return 2 * static_cast<int64_t>((Nc + hopper::kWgN - 1) / hopper::kWgN) * ((M + kBM - 1) / kBM) * E * problems;
  };
  const int64_t tiles128 = blocks_of(wgrad_grid(H, I, E, 1)) + blocks_of(wgrad_grid(I, H, E, 2));
  const int64_t tiles256 = wide(H, I, 1) + wide(I, H, 2);
  const int64_t slots = tiles128 > tiles256 ? tiles128 : tiles256;
  const int64_t n = static_cast<int64_t>(E) * H * I;
  const SquaresSegment segs[3] = {{nullptr, n}, {nullptr, n}, {nullptr, n}};
  const int64_t pass = sum_squares_segments_scratch_doubles(segs, 3);
  return slots > pass ? slots : pass;
}

void launch_swiglu_forward(const void* x, const int64_t* counts, const void* w_gate, const void* w_up,
                           const void* w_down, int64_t N, int H, int I, int E, void* gate, void* up, void* act,
                           void* y, int32_t* workspace, cudaStream_t stream) {
  if (N == 0) return;
  const bool hopper = use_hopper();  // the Hopper kernels split their tiles by L2 half (probed on first use)
  const Schedule s = make_schedule(counts, N, E, workspace, true, stream, hopper ? &sm_l2_halves(stream) : nullptr);
  RowsArgs a = rows_args(s);
  set_queues(a, s, 0);
  // gate | up = x [Wg | Wu]^T, act = silu(gate) * up
  a.a0 = a.a1 = cb(x);
  a.lda = H;
  a.b0 = cb(w_gate);
  a.b1 = cb(w_up);
  a.ldb = H;
  a.b_stride = static_cast<int64_t>(I) * H;
  a.K = a.ksplit = H;
  a.n_extent = I;
  a.out0 = mb(gate);
  a.out1 = mb(up);
  a.out2 = mb(act);
  a.ldo = I;
  const uint64_t n = N, h = H, i = I, e = E;
  hopper::Maps gu{}, dn{};
  hopper::OutMaps gu_out{}, dn_out{};
  const bool hop = hopper && make_map(&gu.a[0], x, {h, n}, {64, 128}) &&
                   make_map(&gu.b[0], w_gate, {h, i, e}, {64, 128, 1}) &&
                   make_map(&gu.b[1], w_up, {h, i, e}, {64, 128, 1}) && make_map(&dn.a[0], act, {i, n}, {64, 128}) &&
                   make_map(&dn.b[0], w_down, {i, h, e}, {64, 128, 1}) &&
                   make_map(&gu_out.o[0], gate, {i, n}, {64, 64}) && make_map(&gu_out.o[1], up, {i, n}, {64, 64}) &&
                   make_map(&gu_out.o[2], act, {i, n}, {64, 64}) && make_map(&dn_out.o[0], y, {h, n}, {64, 64});
  gu.a[1] = gu.a[0];
  dn.a[1] = dn.a[0];
  dn.b[1] = dn.b[0];
  if (hop) launch_rows_hopper<true, kEpiGateUp>(gu, gu_out, a, (H + kBK - 1) / kBK, 1, I, s.max_tiles, stream);
  else launch_rows<true, kEpiGateUp>(a, (I + 63) / 64, s.max_tiles, stream);
  // y = act Wd^T
  set_queues(a, s, 1);
  a.a0 = a.a1 = cb(act);
  a.lda = I;
  a.b0 = a.b1 = cb(w_down);
  a.ldb = I;
  a.b_stride = static_cast<int64_t>(H) * I;
  a.K = a.ksplit = I;
  a.n_extent = H;
  a.out0 = mb(y);
  a.out1 = a.out2 = nullptr;
  a.ldo = H;
  if (hop) launch_rows_hopper<true, kEpiStore>(dn, dn_out, a, (I + kBK - 1) / kBK, 1, H, s.max_tiles, stream);
  else launch_rows<true, kEpiStore>(a, (H + kBN - 1) / kBN, s.max_tiles, stream);
}

namespace {
// The columns of a weight's block scales (ops.h: padded to a multiple of 4) for k columns.
int padded_blocks(int k) { return (k / 128 + 3) / 4 * 4; }
}  // namespace

bool launch_swiglu_forward_fp8(const uint8_t* x_q, const float* x_scale, const int64_t* counts, const uint8_t* wg_q,
                               const float* wg_scale, const uint8_t* wu_q, const float* wu_scale, const uint8_t* wd_q,
                               const float* wd_scale, int64_t N, int H, int I, int E, void* gate, void* up, void* act,
                               uint8_t* act_q, float* act_scale, void* y, int32_t* workspace, cudaStream_t stream) {
  if (!use_hopper()) return false;
  if (N == 0) return true;
  const uint64_t n = N, h = H, i = I, e = E;
  hopper::Maps gu{}, dn{};
  hopper::OutMaps gu_out{}, dn_out{};
  if (!make_tensor_map_bytes(&gu.a[0], x_q, {h, n}, {128, 128}) ||
      !make_tensor_map_bytes(&gu.b[0], wg_q, {h, i, e}, {128, 128, 1}) ||
      !make_tensor_map_bytes(&gu.b[1], wu_q, {h, i, e}, {128, 128, 1}) ||
      !make_tensor_map_bytes(&dn.a[0], act_q, {i, n}, {128, 128}) ||
      !make_tensor_map_bytes(&dn.b[0], wd_q, {i, h, e}, {128, 128, 1}) ||
      !make_map(&gu_out.o[0], gate, {i, n}, {64, 64}) || !make_map(&gu_out.o[1], up, {i, n}, {64, 64}) ||
      !make_map(&gu_out.o[2], act, {i, n}, {64, 64}) || !make_tensor_map_bytes(&gu_out.o[3], act_q, {i, n}, {128, 64}) ||
      !make_map(&dn_out.o[0], y, {h, n}, {64, 64})) {
    return false;
  }
  const Schedule s = make_schedule(counts, N, E, workspace, true, stream, &sm_l2_halves(stream));
  RowsArgs a = rows_args(s);
  // gate | up = x [Wg | Wu]^T, act = silu(gate) * up, with act's codes per 1 x 128 tile
  set_queues(a, s, 0);
  a.n_extent = I;
  a.out0 = mb(gate);
  a.out1 = mb(up);
  a.out2 = mb(act);
  a.ldo = I;
  const hopper::Fp8Scales gs{{x_scale, x_scale}, {wg_scale, wu_scale}, static_cast<int>(N), padded_blocks(H), I / 128};
  const hopper::ActCodes codes{act_q, act_scale, static_cast<int>(N), I};
  launch_fp8_rows_hopper<kEpiGateUp, true>(gu, gu_out, a, gs, codes, H / 128, 1, I, s.max_tiles, stream);
  // y = act Wd^T
  set_queues(a, s, 1);
  a.n_extent = H;
  a.out0 = mb(y);
  a.out1 = a.out2 = nullptr;
  a.ldo = H;
  const hopper::Fp8Scales ds{{act_scale, act_scale}, {wd_scale, wd_scale}, static_cast<int>(N), padded_blocks(I), H / 128};
  launch_fp8_rows_hopper<kEpiStore, true>(dn, dn_out, a, ds, hopper::ActCodes{}, I / 128, 1, H, s.max_tiles, stream);
  return true;
}

bool launch_swiglu_backward_input_fp8(const uint8_t* dy_q, const float* dy_scale, const int64_t* counts,
                                      const void* gate, const void* up, const uint8_t* wgt_q, const float* wgt_scale,
                                      const uint8_t* wut_q, const float* wut_scale, const uint8_t* wdt_q,
                                      const float* wdt_scale, int64_t N, int H, int I, int E, void* dgate, void* dup,
                                      uint8_t* dgate_q, float* dgate_scale, uint8_t* dup_q, float* dup_scale, void* dx,
                                      int32_t* workspace, cudaStream_t stream) {
  if (!use_hopper()) return false;
  if (N == 0) return true;
  const uint64_t n = N, h = H, i = I, e = E;
  hopper::Maps da{}, dxm{};
  hopper::OutMaps da_out{}, dx_out{};
  if (!make_tensor_map_bytes(&da.a[0], dy_q, {h, n}, {128, 128}) ||
      !make_tensor_map_bytes(&da.b[0], wdt_q, {h, i, e}, {128, 128, 1}) ||
      !make_tensor_map_bytes(&dxm.a[0], dgate_q, {i, n}, {128, 128}) ||
      !make_tensor_map_bytes(&dxm.a[1], dup_q, {i, n}, {128, 128}) ||
      !make_tensor_map_bytes(&dxm.b[0], wgt_q, {i, h, e}, {128, 128, 1}) ||
      !make_tensor_map_bytes(&dxm.b[1], wut_q, {i, h, e}, {128, 128, 1}) ||
      !make_map(&da_out.o[0], dgate, {i, n}, {64, 64}) || !make_map(&da_out.o[1], dup, {i, n}, {64, 64}) ||
      !make_map(&dx_out.o[0], dx, {h, n}, {64, 64})) {
    return false;
  }
  const Schedule s = make_schedule(counts, N, E, workspace, true, stream, &sm_l2_halves(stream));
  RowsArgs a = rows_args(s);
  // da = dy Wd (B = Wd^T [E, I, H], K-major), epilogue -> dgate, dup
  set_queues(a, s, 0);
  a.n_extent = I;
  a.out0 = mb(dgate);
  a.out1 = mb(dup);
  a.ldo = I;
  a.g = cb(gate);
  a.u = cb(up);
  da.a[1] = da.a[0];
  da.b[1] = da.b[0];
  const hopper::Fp8Scales das{{dy_scale, dy_scale}, {wdt_scale, wdt_scale}, static_cast<int>(N), padded_blocks(H),
                              I / 128};
  launch_fp8_rows_hopper<kEpiDSwiglu, false>(da, da_out, a, das, hopper::ActCodes{}, H / 128, 1, I, s.max_tiles, stream);
  // dgate, dup per 1 x 128 tile, then dx = [dgate | dup] [Wg ; Wu]: K = 2I, k < I from
  // (dgate, Wg^T), k >= I from (dup, Wu^T)
  launch_quantize_fp8_rows(dgate, 2, N, I, dgate_q, dgate_scale, stream);
  launch_quantize_fp8_rows(dup, 2, N, I, dup_q, dup_scale, stream);
  set_queues(a, s, 1);
  a.n_extent = H;
  a.out0 = mb(dx);
  a.out1 = a.out2 = nullptr;
  a.ldo = H;
  a.g = a.u = nullptr;
  const hopper::Fp8Scales dxs{{dgate_scale, dup_scale}, {wgt_scale, wut_scale}, static_cast<int>(N), padded_blocks(I),
                              H / 128};
  launch_fp8_rows_hopper<kEpiStore, false>(dxm, dx_out, a, dxs, hopper::ActCodes{}, I / 128, 2, H, s.max_tiles, stream);
  return true;
}

bool launch_grouped_wgrad_fp8(const Fp8WgradSource* src, int n, int64_t M, int64_t Nc, int E, float* dw,
                              bool accumulate, int* counters, cudaStream_t stream) {
  if (!use_hopper() || n > hopper::kFp8WgradSources) return false;
  if (M == 0 || Nc == 0 || E == 0 || n == 0) return true;
  const uint64_t m = M, nc = Nc, e = E;
  hopper::Fp8WgradMaps maps{};
  hopper::Fp8WgradArgs args{};
  for (int k = 0; k < n; ++k) {
    const uint64_t p = src[k].P, t = src[k].P / 128;
    if (!make_tensor_map_bytes(&maps.a[k], src[k].a_q, {p, m}, {128, 128}) ||
        !make_tensor_map_bytes(&maps.b[k], src[k].b_q, {p, nc}, {128, 128}) ||
        !make_tensor_map_f32_plain(&maps.sa[k], src[k].a_scale, {m, t}, {128, 1}) ||
        !make_tensor_map_f32_plain(&maps.sb[k], src[k].b_scale, {nc, t}, {256, 1})) {
      return false;
    }
    args.first_tile[k] = src[k].first_tile;
  }
  if (!make_map(&maps.c, dw, {nc, m, e}, {32, 64, 1}, true)) return false;
  const int gx = static_cast<int>((Nc + 255) / 256), gy = static_cast<int>((M + 127) / 128);
  const int tiles = gx * gy * E;
  cudaMemsetAsync(counters, 0, 2 * sizeof(int), stream);
  args.sources = n;
  args.accumulate = accumulate ? 1 : 0;
  args.next = counters;
  auto kernel = hopper::fp8_wgrad_kernel;
  prepare_hopper(kernel, hopper::kF8WgSmem);
  kernel<<<persistent_grid(tiles), hopper::kWsThreads, hopper::kF8WgSmem, stream>>>(maps, args, gx, gy, tiles);
  return true;
}

void launch_swiglu_backward_input(const void* dy, const int64_t* counts, const void* gate, const void* up,
                                  const void* w_gate, const void* w_up, const void* w_down, int64_t N, int H, int I,
                                  int E, void* dgate, void* dup, void* dx, int32_t* workspace, cudaStream_t stream) {
  if (N == 0) return;
  const bool hopper = use_hopper();  // the Hopper kernels split their tiles by L2 half (probed on first use)
  const Schedule s = make_schedule(counts, N, E, workspace, true, stream, hopper ? &sm_l2_halves(stream) : nullptr);
  RowsArgs a = rows_args(s);
  set_queues(a, s, 0);
  // da = dy Wd (Wd[e] is [H, I]: B[k = h][n = i]), epilogue -> dgate, dup
  a.a0 = a.a1 = cb(dy);
  a.lda = H;
  a.b0 = a.b1 = cb(w_down);
  a.ldb = I;
  a.b_stride = static_cast<int64_t>(H) * I;
  a.K = a.ksplit = H;
  a.n_extent = I;
  a.out0 = mb(dgate);
  a.out1 = mb(dup);
  a.ldo = I;
  a.g = cb(gate);
  a.u = cb(up);
  const uint64_t n = N, h = H, i = I, e = E;
  hopper::Maps da{}, dx_maps{};
  hopper::OutMaps da_out{}, dx_out{};
  const bool hop = hopper && make_map(&da.a[0], dy, {h, n}, {64, 128}) &&
                   make_map(&da.b[0], w_down, {i, h, e}, {64, 64, 1}) &&
                   make_map(&dx_maps.a[0], dgate, {i, n}, {64, 128}) && make_map(&dx_maps.a[1], dup, {i, n}, {64, 128}) &&
                   make_map(&dx_maps.b[0], w_gate, {h, i, e}, {64, 64, 1}) &&
                   make_map(&dx_maps.b[1], w_up, {h, i, e}, {64, 64, 1}) &&
                   make_map(&da_out.o[0], dgate, {i, n}, {64, 64}) && make_map(&da_out.o[1], dup, {i, n}, {64, 64}) &&
                   make_map(&dx_out.o[0], dx, {h, n}, {64, 64});
  da.a[1] = da.a[0];
  da.b[1] = da.b[0];
  if (hop) {
    launch_rows_hopper<false, kEpiDSwiglu>(da, da_out, a, (H + kBK - 1) / kBK, 1, I, s.max_tiles, stream);
  } else {
    launch_rows<false, kEpiDSwiglu>(a, (I + kBN - 1) / kBN, s.max_tiles, stream);
  }
  // dx = [dgate | dup] [Wg ; Wu]: K = 2I, k < I from (dgate, Wg), k >= I from (dup, Wu)
  set_queues(a, s, 1);
  a.a0 = cb(dgate);
  a.a1 = cb(dup);
  a.lda = I;
  a.b0 = cb(w_gate);
  a.b1 = cb(w_up);
  a.ldb = H;
  a.b_stride = static_cast<int64_t>(I) * H;
  a.K = 2 * I;
  a.ksplit = I;
  a.n_extent = H;
  a.out0 = mb(dx);
  a.out1 = nullptr;
  a.ldo = H;
  a.g = a.u = nullptr;
  if (hop) {
    launch_rows_hopper<false, kEpiStore>(dx_maps, dx_out, a, (I + kBK - 1) / kBK, 2, H, s.max_tiles, stream);
  } else {
    launch_rows<false, kEpiStore>(a, (H + kBN - 1) / kBN, s.max_tiles, stream);
  }
}

namespace {
// The Hopper weight-gradient pass over n sources (1 <= n <= kWgradSources, each with rows):
// the maps of dW_down's (wd) and of dW_gate/dW_up's (wgu) launches; false when the driver
// refuses one.
bool make_wgrad_maps(const SwigluWgradSource* src, int n, int H, int I, int E, float* dw_gate, float* dw_up,
                     float* dw_down, hopper::WgradMaps& wd, hopper::WgradMaps& wgu) {
  const uint64_t h = H, i = I, e = E;
  wd = {};
  wgu = {};
  for (int k = 0; k < n; ++k) {
    const uint64_t rows = src[k].N;
    CUtensorMap* da = k == 0 ? wd.m.a : wd.xa[k - 1];
    CUtensorMap* db = k == 0 ? &wd.m.b[0] : &wd.xb[k - 1];
    CUtensorMap* ga = k == 0 ? wgu.m.a : wgu.xa[k - 1];
    CUtensorMap* gb = k == 0 ? &wgu.m.b[0] : &wgu.xb[k - 1];
    if (!make_map(&da[0], src[k].dy, {h, rows}, {64, 64}) || !make_map(db, src[k].act, {i, rows}, {64, 64}) ||
        !make_map(&ga[0], src[k].dgate, {i, rows}, {64, 64}) || !make_map(&ga[1], src[k].dup, {i, rows}, {64, 64}) ||
        !make_map(gb, src[k].x, {h, rows}, {64, 64})) {
      return false;
    }
    da[1] = da[0];
  }
  if (!make_map(&wd.m.c[0], dw_down, {i, h, e}, {32, 64, 1}, true) ||
      !make_map(&wgu.m.c[0], dw_gate, {h, i, e}, {32, 64, 1}, true) ||
      !make_map(&wgu.m.c[1], dw_up, {h, i, e}, {32, 64, 1}, true)) {
    return false;
  }
  wd.m.c[1] = wd.m.c[0];
  wd.m.b[1] = wd.m.b[0];
  wgu.m.b[1] = wgu.m.b[0];
  return true;
}

// ... and its launches (s: the first source's schedule, which drives the tile queues):
// dW_down, then dW_gate and dW_up, each tile's k loop over every source's rows of its expert
// in turn; with squares_result, their sum of squares from the epilogue.
void launch_wgrad_hopper(const hopper::WgradMaps& wd, const hopper::WgradMaps& wgu, const SwigluWgradSource* src,
                         int n, const Schedule& s, int H, int I, int E, bool accumulate, double* squares_scratch,
                         double* squares_result, cudaStream_t stream) {
  WgradArgs w{};
  w.offsets = s.offsets;
  w.n_more = n - 1;  // the other sources give only their offsets
  for (int k = 1; k < n; ++k) {
    w.offsets_more[k - 1] = make_schedule(src[k].counts, src[k].N, E, src[k].workspace, false, stream).offsets;
  }
  w.accumulate = accumulate ? 1 : 0;
  w.c_stride = static_cast<int64_t>(H) * I;
  if (squares_result) w.squares = squares_scratch;  // dW_down's slots first, then gate/up's
  w.M = H;  // dWd[e] [H, I] (+)= dy_e^T act_e over every source
  w.Nc = I;
  const int64_t down_slots = launch_wgrad_ws<1>(wd, w, E, s, 0, stream);
  w.squares_base = down_slots;
  w.M = I;  // dWg[e], dWu[e] [I, H] (+)= dgate_e^T x_e, dup_e^T x_e
  w.Nc = H;
  const int64_t gu_slots = launch_wgrad_ws<2>(wgu, w, E, s, 1, stream);
  if (squares_result) launch_sum_doubles(squares_scratch, down_slots + gu_slots, squares_result, stream);
}
}  // namespace

void launch_swiglu_backward_weight(const void* dy, const void* x, const int64_t* counts, const void* gate,
                                   const void* up, const void* dgate, const void* dup, int64_t N, int H, int I,
                                   int E, void* act, bool act_ready, float* dw_gate, float* dw_up, float* dw_down,
                                   bool accumulate, int32_t* workspace, double* squares_scratch,
                                   double* squares_result, cudaStream_t stream) {
  if (accumulate) squares_result = nullptr;  // the final values are not this call's to see
  if (N == 0) {  // every expert has 0 rows: nothing to add, or zeros to write
    if (!accumulate) {
      const size_t bytes = static_cast<size_t>(E) * H * I * sizeof(float);
      cudaMemsetAsync(dw_gate, 0, bytes, stream);
      cudaMemsetAsync(dw_up, 0, bytes, stream);
      cudaMemsetAsync(dw_down, 0, bytes, stream);
      if (squares_result) cudaMemsetAsync(squares_result, 0, sizeof(double), stream);
    }
    return;
  }
  const Schedule s = make_schedule(counts, N, E, workspace, false, stream);
  const int64_t n_act = N * I;
  if (!act_ready) {
    swiglu_act_kernel<<<static_cast<unsigned>((n_act / 8 + 255) / 256), 256, 0, stream>>>(cb(gate), cb(up), mb(act),
                                                                                           n_act);
  }
  const SwigluWgradSource one{dy, x, dgate, dup, act, counts, N, workspace};
  hopper::WgradMaps wd, wgu;
  if (use_hopper() && make_wgrad_maps(&one, 1, H, I, E, dw_gate, dw_up, dw_down, wd, wgu)) {
    launch_wgrad_hopper(wd, wgu, &one, 1, s, H, I, E, accumulate, squares_scratch, squares_result, stream);
    return;
  }
  WgradArgs w{};
  w.offsets = s.offsets;
  w.accumulate = accumulate ? 1 : 0;
  // dWd[e] [H, I] += dy_e^T act_e
  w.a0 = w.a1 = cb(dy);
  w.lda = H;
  w.b = cb(act);
  w.ldb = I;
  w.c0 = w.c1 = dw_down;
  w.c_stride = static_cast<int64_t>(H) * I;
  w.M = H;
  w.Nc = I;
  launch_wgrad<1>(w, E, stream);
  // dWg[e], dWu[e] [I, H] += dgate_e^T x_e, dup_e^T x_e
  w.a0 = cb(dgate);
  w.a1 = cb(dup);
  w.lda = I;
  w.b = cb(x);
  w.ldb = H;
  w.c0 = dw_gate;
  w.c1 = dw_up;
  w.c_stride = static_cast<int64_t>(I) * H;
  w.M = I;
  w.Nc = H;
  launch_wgrad<2>(w, E, stream);
  if (!squares_result) return;
  const int64_t n = static_cast<int64_t>(E) * H * I;
  const SquaresSegment segs[3] = {{dw_gate, n}, {dw_up, n}, {dw_down, n}};
  launch_sum_squares_segments(segs, 3, squares_scratch, stream, squares_result);
}

bool launch_swiglu_backward_weight_group(const SwigluWgradSource* src, int n, int H, int I, int E, float* dw_gate,
                                         float* dw_up, float* dw_down, bool accumulate, double* squares_scratch,
                                         double* squares_result, cudaStream_t stream) {
  if (accumulate) squares_result = nullptr;  // the final values are not this call's to see
  if (!use_hopper() || n < 2 || n > swiglu_wgrad_group_max()) return false;
  for (int k = 0; k < n; ++k) {
    if (src[k].N == 0) return false;
  }
  hopper::WgradMaps wd, wgu;
  if (!make_wgrad_maps(src, n, H, I, E, dw_gate, dw_up, dw_down, wd, wgu)) return false;
  const Schedule s = make_schedule(src[0].counts, src[0].N, E, src[0].workspace, false, stream);
  launch_wgrad_hopper(wd, wgu, src, n, s, H, I, E, accumulate, squares_scratch, squares_result, stream);
  return true;
}

int swiglu_wgrad_group_max() { return kWgradSources; }

}  // namespace moetrain::ops::cuda
