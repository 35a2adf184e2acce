// Attention backward on Hopper (sm_90a): the dK/dV and dQ passes of attention.cu's
// backward, with TMA copies and warpgroup MMAs (wgmma) instead of cp.async + mma.sync.
// Same math, same order of reduction per output element (deterministic, no atomics), same
// delta / lse2 inputs; taken for head_dim = v_head_dim = 128 and seq a multiple of 128 on
// sm_90, and for MLA's heads (query/key 192, value 128: the forward, and the two-pass
// backward, the kernels templated on the query/key width kQk; Q and K tiles of three boxes,
// dK and dQ accumulated as 128 + 64 columns; the forward's ring has 2 stages there). When the caller allows an order-free result (ops::set_deterministic(false)), one
// pass instead: the dK/dV blocks add dQ into an f32 buffer (dkdv_kernel<true>, below),
// which is the result: the per-head q norm's backward reads it as it is (no conversion pass
// to bf16: 70 us a layer at the bench shape).
//
// Floor and expectation (bench shape B=2, S=4096, Hq=32, Hkv=4, D=128, causal; H100 SXM):
// the backward counts 2.5 x the forward's 4*B*Hq*S^2*D/2 = 275 GFLOP, 687 GFLOP, and does
// 7/5 of that (the dQ pass recomputes S and dP): 962 GFLOP of MMAs, 0.97 ms at 989 TFLOP/s.
// The mma.sync kernels take 4.35 ms (158 counted TFLOP/s). wgmma at ~60% of peak in both
// passes would take ~1.6 ms (~430 counted TFLOP/s): ~2.7 ms a layer, ~11 ms a bench step.
// Measured (H100 SXM, bench_ops BM_AttentionBackward): 2.05 ms, 336 counted TFLOP/s (470
// TFLOP/s of MMAs done); B=1, S=2048 (heads split over 4 blocks): 0.32 ms, 267 (mma.sync:
// 0.62 ms). Forward (same method, 128 x 128 tiles; floor 0.28 ms): 0.94 -> 0.72 ms, 292 ->
// 382 TFLOP/s; with a producer warpgroup, a 3-stage ring and the previous tile's P V under
// this tile's softmax, 0.53 ms, 522 TFLOP/s. What is left in the backward: each warpgroup
// waits for its own MMAs before its elementwise work (S -> P -> dS -> dV, dK are serial
// inside an iteration; only the two warpgroups overlap), and the dQ pass repeats S and dP.
// The same producer warpgroup with the next iteration's S and dP issued right behind this
// one's dV and dK was slower (2.05 -> 2.28 ms): they still wait for each other in order.
//
// dK/dV: one block per (key tile of 128 keys, kv head, batch, split), key tile 0 (the most
// work) first; with splits > 1 (too few blocks to fill the GPU) each block takes group /
// splits of the query heads and writes f32 partial sums that attention.cu's reduce kernel
// adds in split order. Two warpgroups own 64 keys each; K and V (128 x 128) stay in shared memory. The
// block walks the kv group's query heads and every query tile of 64 rows at or below the
// diagonal; Q, dO (64 x 128 each), lse2, delta (and the segment ids) of iteration i + 2 are
// copied by TMA into a 3-stage ring while iteration i computes. Per iteration a warpgroup
// computes S^T = K Q^T and dP^T = V dO^T (m64n64, both operands in shared memory), then
// P^T = exp2(S^T scale log2e - lse2) (masked), dS^T = P^T (dP^T - delta), and accumulates
// dV += P^T dO and dK += dS^T Q with P^T and dS^T as register A operands (the accumulator
// layout of S^T is the A fragment layout) and dO, Q read MN-major from the same tiles.
//
// dQ: one block per (query tile of 128 rows, query head, batch), the last tiles first. Q and
// dO stay in shared memory; key/value tiles of 64 rows 0..diagonal stream through a 3-stage
// ring. S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K (K read MN-major).
//
// Shared-memory tiles are TMA boxes of 64 columns (128 bytes, the 128-byte swizzle), so a
// [rows][128] tile is two boxes: columns 0..63 then 64..127.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/attention_launch.h"
#include "ops/cuda/hopper.cuh"
#include "ops/cuda/tensor_map.h"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 128;
constexpr int kThreads = 256;  // two consumer warpgroups
constexpr int kStages = 3;

// dK/dV pass: 128 keys a block, 64 queries an iteration.
constexpr int kKvKeys = 128, kKvRows = 64;
constexpr int kKvTile = kKvKeys * kD * 2;               // K or V: 32 KB (two [128][64] boxes)
constexpr int kKvQTile = kKvRows * kD * 2;              // Q or dO: 16 KB (two [64][64] boxes)
// With query/key heads of kQk dims (128, or MLA's 192: K 48 KB, Q 24 KB, three boxes each).
template <int kQk>
struct KvTiles {
  static constexpr int kKTile = kKvKeys * kQk * 2;
  static constexpr int kQTile = kKvRows * kQk * 2;
  static constexpr int kStage = kQTile + kKvQTile + 1024;  // Q, dO, + lse2, delta, segment ids (256 B each)
  static constexpr int kSmem = kKTile + kKvTile + kStages * kStage + 1024 + 256;
  static_assert(kSmem <= 232448, "the dK/dV pass's shared memory");
};
constexpr int kKvSmem = KvTiles<kD>::kSmem;
// One-pass backward (dQ too): dS of an iteration, [128 keys][64 queries] bf16.
constexpr int kDsTile = kKvKeys * kKvRows * 2;          // 16 KB

// dQ pass: 128 query rows a block, 64 keys an iteration; query/key heads of kQk dims (128, or
// MLA's 192: then only this pass runs here, after attention.cu's mma.sync dK/dV pass).
constexpr int kQRows = 128, kQKeys = 64;
template <int kQk>
struct DqTiles {
  static constexpr int kQTile = kQRows * kQk * 2;       // Q: 32 KB (48 KB at 192)
  static constexpr int kDoTile = kQRows * kD * 2;       // dO: 32 KB
  static constexpr int kKTile = kQKeys * kQk * 2;       // K: 16 KB (24 KB)
  static constexpr int kVTile = kQKeys * kD * 2;        // V: 16 KB
  static constexpr int kStage = kKTile + kVTile + 1024;  // + segment ids
  static constexpr int kSmem = kQTile + kDoTile + kStages * kStage + 1024 + 256;
  static_assert(kSmem <= 232448, "the dQ pass's shared memory");
};

// Forward: 128 query rows a block, 128 keys an iteration; query/key heads of kQk dims (128,
// or MLA's 192), value heads of kD. MLA's wider Q and K tiles leave room for 2 stages.
constexpr int kFRows = 128, kFKeys = 128;
template <int kQk>
struct FwdTiles {
  static constexpr int kQTile = kFRows * kQk * 2;       // Q: 32 KB (48 KB at 192)
  static constexpr int kKTile = kFKeys * kQk * 2;       // K: 32 KB (48 KB)
  static constexpr int kVTile = kFKeys * kD * 2;        // V: 32 KB
  static constexpr int kStages = kQk == kD ? 3 : 2;
  static constexpr int kStage = kKTile + kVTile;        // K, V (their key segment ids: 512 B apart)
  static constexpr int kSmem = kQTile + kStages * (kStage + 512) + 1024 + 256;
  static_assert(kSmem <= 232448, "the forward's shared memory");  // 232,192 at 128; 215,296 at 192
};

struct Maps {
  CUtensorMap q_rows64, do_rows64, k_rows128, v_rows128;  // dK/dV pass
  CUtensorMap q_rows128, do_rows128, k_rows64, v_rows64;  // dQ pass
  CUtensorMap dq_acc;                                     // one-pass backward: f32, [64 rows][32] boxes
};

struct Args {
  const float* lse2;   // [B, Hq, S] lse * log2(e)
  const float* delta;  // [B, Hq, S]
  const int32_t* seg;   // the queries' rows: [B*S] or null
  const int32_t* kseg;  // the keys' rows: null exactly when seg is
  bf16* o;          // forward: out [B*S, Hq*D]
  float* lse_out;   // forward: lse [B, Hq, S]
  bf16* dq;
  bf16* dk;
  bf16* dv;
  float* dk_part;  // splits > 1: f32 partial sums [splits][B*S, Hkv*D], dK without the scale
  float* dv_part;
  float* dq_acc;   // one-pass backward: f32 [B*S, Hq*D], zeroed, dQ added into it (left there: the result)
  int batch, seq, q_heads, kv_heads, group;
  // The part (attention_launch.h's AttentionDims): the pointers start at its first query /
  // key row; seq stays the rows from one sequence to the next (and lse's row count).
  int q_len, k_len;
  bool causal;
  int splits;  // dK/dV blocks sharing one (key tile, kv head), group / splits query heads each
  int64_t q_stride, kv_stride;
  float scale, scale_log2;
};

#if MT_SM90A
using namespace sm90;

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A [rows][128] tile (tile_bytes in all) as two TMA boxes of 64 columns: columns col.. and
// col + 64.., from row `row` of the map's tensor.
__device__ __forceinline__ void load_tile128(char* dst, int tile_bytes, const CUtensorMap* map, uint64_t* bar, int col,
                                             int row) {
  tma_load_2d(dst, map, bar, col, row);
  tma_load_2d(dst + tile_bytes / 2, map, bar, col + 64, row);
}
// A [rows][kCols] tile as kCols / 64 boxes of 64 columns, one after the other.
template <int kCols>
__device__ __forceinline__ void load_tile(char* dst, int tile_bytes, const CUtensorMap* map, uint64_t* bar, int col,
                                          int row) {
#pragma unroll
  for (int i = 0; i < kCols / 64; ++i) tma_load_2d(dst + i * (tile_bytes / (kCols / 64)), map, bar, col + 64 * i, row);
}

// The four A-operand registers of k chunk kc (16 columns) from an m64nN accumulator.
template <int N>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const float (&c)[N], int kc) {
  a[0] = pack_bf16(c[8 * kc + 0], c[8 * kc + 1]);
  a[1] = pack_bf16(c[8 * kc + 2], c[8 * kc + 3]);
  a[2] = pack_bf16(c[8 * kc + 4], c[8 * kc + 5]);
  a[3] = pack_bf16(c[8 * kc + 6], c[8 * kc + 7]);
}

// c[64 x N] += A[64 x K] B[N x K]^T, N = 64 (c has 32 floats) or 128 (64 floats), K = 128
// or 192; both operands K-major [rows][K] as K / 64 boxes; a_rows / b_rows: rows per box (the
// byte distance between the boxes is rows * 128).
template <int C, int K = kD>
__device__ __forceinline__ void mma_rows_by_rows(float (&c)[C], uint32_t a, int a_rows, uint32_t b, int b_rows) {
  static_assert(C == 32 || C == 64, "m64n64 or m64n128 accumulators");
  static_assert(K % 64 == 0, "whole boxes of 64 columns");
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t half = kk >> 2, off = (kk & 3) * 32;
    const uint64_t da = sw128_desc(a + half * a_rows * 128 + off, 16, 1024);
    const uint64_t db = sw128_desc(b + half * b_rows * 128 + off, 16, 1024);
    if constexpr (C == 32) wgmma_m64n64k16<0, 0>(c, da, db);
    else wgmma_m64n128k16<0, 0>(c, da, db);
  }
}

// The A fragments of P[64 x 64] (registers, an m64n64 accumulator), built before the
// wgmma fence that must separate register writes from the MMAs reading them.
__device__ __forceinline__ void a_fragments(uint32_t (&a)[4][4], const float (&p)[32]) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) a_fragment(a[kc], p, kc);
}

// acc[64 x 128] += P[64 x 64] B[64 x 128], P as A fragments, B the first 64 rows of a
// [rows][128] tile read MN-major (two boxes of b_rows rows).
__device__ __forceinline__ void mma_regs_by_cols(float (&acc)[64], const uint32_t (&a)[4][4], uint32_t b, int b_rows) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) wgmma_m64n128k16_rs<1>(acc, a[kc], sw128_desc(b + kc * 2048, b_rows * 128, 1024));
}

// Register A operands of an MMA still in flight: the compiler must not reuse their registers
// before the wgmma wait that this follows.
__device__ __forceinline__ void keep_live(const uint32_t (&a)[4][4]) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) asm volatile("" ::"r"(a[kc][0]), "r"(a[kc][1]), "r"(a[kc][2]), "r"(a[kc][3]) : "memory");
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) c[i] = 0.f;
  pin(c);
}

template <int kStages>
__device__ __forceinline__ void init_barriers(uint64_t* full, uint64_t* empty, uint64_t* once) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kThreads);  // every consumer thread arrives: see release_and_refill
    }
    mbar_init(once, 1);
    mbar_fence_init();
  }
  __syncthreads();
}

// Every thread has finished with the stage of iteration it; thread 0 then refills the stage
// of iteration it - 1 (by now finished by both warpgroups, or nearly) with it - 1 + kStages.
template <int kStages, typename Issue>
__device__ __forceinline__ void release_and_refill(int it, int n_it, uint64_t* full, uint64_t* empty,
                                                   const Issue& issue) {
  // Every thread arrives for its own reads of the stage (lse2, delta and segment ids are read
  // with plain loads). One arrive per warp after __syncwarp() is also ordered under the PTX
  // memory model, but compute-sanitizer's racecheck cannot follow that chain and reported a
  // write-after-read hazard on every refill; 256 arrives cost nothing measurable (bench_ops
  // BM_AttentionBackward/Forward, H100: within +-1% run to run).
  mbar_arrive(&empty[it % kStages]);
  const int prev = it - 1, next = it - 1 + kStages;
  if (threadIdx.x == 0 && prev >= 0 && next < n_it) {
    const int s = prev % kStages;
    mbar_wait(&empty[s], (prev / kStages) & 1);
    issue(next, s);
  }
}
#endif  // MT_SM90A

// Forward: one block per (query tile of 128 rows, query head, batch), the last tiles first.
// Q stays in shared memory; key/value tiles of 128 rows 0..diagonal stream through a
// 3-stage ring filled by a producer warpgroup (one thread of warpgroup 2), which refills a
// stage as soon as both consumer warpgroups have released it. Each consumer warpgroup owns
// 64 query rows and computes S = Q K^T (m64n128), the online softmax in the exp2 domain
// (running max m and sum l per row, as attention.cu's forward), and O += P V with P as
// register A operands and V read MN-major. The MMAs of key tile j - 1's P V run while tile j's softmax is computed
// (S_j and P_{j-1} V_{j-1} are issued together; S_j is waited for, P V is not): O is
// rescaled and P_j packed only after P V has finished with them.
constexpr int kFThreads = kThreads + 128;  // + the producer's warpgroup (its registers go to the consumers)
template <int kQk>
__global__ void __launch_bounds__(kFThreads, 1) fwd_kernel(const __grid_constant__ Maps maps, const Args a) {
#if MT_SM90A
  using F = FwdTiles<kQk>;
  constexpr int kFQTile = F::kQTile, kFStages = F::kStages, kFStage = F::kStage;
  const int bh = a.batch * a.q_heads, n_qt = a.q_len / kFRows;
  const int qt = n_qt - 1 - static_cast<int>(blockIdx.x / bh);
  const int b = (blockIdx.x % bh) / a.q_heads, h = blockIdx.x % a.q_heads, kvh = h / a.group;
  const int q0 = qt * kFRows;
  const int tok0 = b * a.seq;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* sQ = smem;
  char* stages = smem + kFQTile;                                          // K, V of each stage
  char* seg_ids = stages + kFStages * kFStage;                            // 128 key segment ids a stage
  uint64_t* full = reinterpret_cast<uint64_t*>(seg_ids + kFStages * 512);
  uint64_t* empty = full + kFStages;
  uint64_t* q_bar = empty + kFStages;
  init_barriers<kFStages>(full, empty, q_bar);

  // Causal: key tiles 0 .. the diagonal (every one has keys before both warpgroups' rows).
  const int n_it = a.causal ? q0 / kFKeys + 1 : a.k_len / kFKeys;
  const int tid = threadIdx.x;
  if (tid >= kThreads) {  // the producer warpgroup: one thread issues the copies
    setmaxnreg_dec<24>();
    if (tid != kThreads) return;
    mbar_arrive_expect_tx(q_bar, kFQTile);
    load_tile<kQk>(sQ, kFQTile, &maps.q_rows128, q_bar, h * kQk, tok0 + q0);
    for (int it = 0; it < n_it; ++it) {
      const int s = it % kFStages, kr = it * kFKeys;
      if (it >= kFStages) mbar_wait(&empty[s], ((it / kFStages) - 1) & 1);  // tile it - kFStages has left it
      char* st = stages + s * kFStage;
      mbar_arrive_expect_tx(&full[s], kFStage + (a.seg != nullptr ? 512 : 0));
      load_tile<kQk>(st, F::kKTile, &maps.k_rows128, &full[s], kvh * kQk, tok0 + kr);
      load_tile<kD>(st + F::kKTile, F::kVTile, &maps.v_rows128, &full[s], kvh * kD, tok0 + kr);
      if (a.seg != nullptr) bulk_load(seg_ids + s * 512, a.kseg + tok0 + kr, 512, &full[s]);
    }
    return;
  }
  setmaxnreg_inc<240>();
  const int wg = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  const int qw0 = q0 + wg * 64;  // this warpgroup's first row
  int row[2], seg_q[2] = {0, 0};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row[i] = qw0 + 16 * w + g + 8 * i;
    if (a.seg != nullptr) seg_q[i] = a.seg[tok0 + row[i]];
  }
  float o[64], sc[64], alpha[2];
  uint32_t ap[8][4];  // P of the previous key tile, bf16 A fragments
  zero(o);
  const uint32_t q_addr = smem_u32(sQ) + wg * 64 * 128;
  mbar_wait(q_bar, 0);

  // S_j -> masked, exponentiated in place (P_j, f32), m and l updated, alpha = the factor
  // that takes O and l from the old running max to the new one.
  auto softmax = [&](int it) {
    const int kr = it * kFKeys;
    const int32_t* s_seg = reinterpret_cast<const int32_t*>(seg_ids + (it % kFStages) * 512);
    if (a.seg != nullptr || (a.causal && kr + kFKeys - 1 > qw0)) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 8 * j + 2 * t + c;
#pragma unroll
          for (int i2 = 0; i2 < 2; ++i2) {
            if ((a.causal && kr + col > row[i2]) || (a.seg != nullptr && s_seg[col] != seg_q[i2])) {
              sc[4 * j + 2 * i2 + c] = -INFINITY;
            }
          }
        }
      }
    }
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * i2], sc[4 * j + 2 * i2 + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i2], mx * a.scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
      alpha[i2] = ex2(m[i2] - m_use);
      m[i2] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int i = 4 * j + 2 * i2 + c;
          sc[i] = ex2(fmaf(sc[i], a.scale_log2, -m_use));
          sum += sc[i];
        }
      }
      l[i2] = l[i2] * alpha[i2] + sum;  // this lane's share of the row sum; the quad adds up at the end
    }
  };
  auto issue_s = [&](int it) {  // S_it = Q K_it^T
    zero(sc);
    wgmma_fence();
    mma_rows_by_rows<64, kQk>(sc, q_addr, kFRows, smem_u32(stages + (it % kFStages) * kFStage), kFKeys);
    wgmma_commit();
  };
  auto issue_pv = [&](int it) {  // O += P_it V_it
    const uint32_t v_addr = smem_u32(stages + (it % kFStages) * kFStage + F::kKTile);
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) wgmma_m64n128k16_rs<1>(o, ap[kc], sw128_desc(v_addr + kc * 2048, kFKeys * 128, 1024));
    wgmma_commit();
  };
  auto release = [&](int it) {
    mbar_arrive(&empty[it % kFStages]);  // every thread: as release_and_refill
  };
  auto rescale_and_pack = [&]() {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int i2 = 0; i2 < 2; ++i2) {
        o[4 * j + 2 * i2] *= alpha[i2];
        o[4 * j + 2 * i2 + 1] *= alpha[i2];
      }
    }
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) a_fragment(ap[kc], sc, kc);
  };

  mbar_wait(&full[0], 0);
  issue_s(0);
  wgmma_wait<0>();
  pin(sc);
  softmax(0);
  rescale_and_pack();
  for (int it = 1; it < n_it; ++it) {
    mbar_wait(&full[it % kFStages], (it / kFStages) & 1);
    issue_s(it);
    pin(o);
    issue_pv(it - 1);  // the same fence covers both groups
    wgmma_wait<1>();   // S_it is done (groups complete in order); P V may still run
    pin(sc);
    softmax(it);
    wgmma_wait<0>();
    pin(o);
    release(it - 1);
    rescale_and_pack();
  }
  pin(o);
  wgmma_fence();
  issue_pv(n_it - 1);
  wgmma_wait<0>();
  pin(o);
  release(n_it - 1);

#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    float lt = l[i2];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const float inv = lt > 0.f ? 1.f / lt : 0.f;  // a row that saw no key of the part: out 0, lse -inf
    bf16* out = a.o + static_cast<int64_t>(tok0 + row[i2]) * a.q_stride + static_cast<int64_t>(h) * kD + 2 * t;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(out + 8 * j) = pack_bf16(o[4 * j + 2 * i2] * inv, o[4 * j + 2 * i2 + 1] * inv);
    }
    if (t == 0) {
      a.lse_out[(static_cast<int64_t>(b) * a.q_heads + h) * a.seq + row[i2]] =
          lt > 0.f ? (m[i2] + log2f(lt)) * 0.6931471805599453f : -INFINITY;
    }
  }
#endif
}

// kDq (the one-pass backward, ops::set_deterministic(false)): the block also forms dQ's
// share of its 128 keys for every query tile it visits, dQ_tile[64 x 128] = dS[64 x 128]
// K[128 x 128], and adds it into the f32 dq_acc: no dQ pass recomputing S and dP, but the
// order of the adds into one dQ element varies from run to run (not bitwise reproducible;
// dK and dV still are). Each warpgroup writes its 64 rows of dS^T (bf16, as the dK MMA used
// them) into a [128 keys][64 queries] tile with the 128-byte swizzle; after a barrier
// warpgroup wg multiplies the whole tile (MN-major A) by K's columns 64 wg .. 64 wg + 63
// (box wg of sK, MN-major B), stages its 64 x 64 f32 result in two swizzled boxes and adds
// them into dq_acc with TMA reduce-adds. A second barrier keeps the dS tile until both
// warpgroups' dQ MMAs have read it. Iterations go query tile by query tile from the last,
// the kv group's heads inside, so that the blocks of all key tiles of one (batch, kv head)
// add into the same dQ rows at about the same time.
// Measured at the bench shape (bench_ops, H100): 1.97 ms against 2.30 for the two passes;
// the same kernel without the reduce-adds 1.27 ms, so the 2.1 GB of f32 adds a layer are
// what it waits for. Tried and slower: red.global.add.v2.f32 from the registers (2.10 ms;
// .v4 the same), the heads outside (2.60 ms), each warpgroup adding its own 64 keys'
// 64 x 128 share with no barrier between the warpgroups (twice the adds: 3.01 ms).
constexpr int kDqBox = 64 * 32 * 4;  // 64 rows x 32 f32 columns, 8 KB
constexpr int kKvDqSmem = kKvSmem + kDsTile + 4 * kDqBox;
static_assert(kKvDqSmem <= 232448, "shared memory of the one-pass dK/dV/dQ kernel");

template <bool kDq, int kQk = kD>
__global__ void __launch_bounds__(kThreads, 1) dkdv_kernel(const __grid_constant__ Maps maps, const Args a) {
#if MT_SM90A
  static_assert(!kDq || kQk == kD, "the one-pass dQ is for heads of 128");
  using T = KvTiles<kQk>;
  const int per_tile = a.batch * a.kv_heads * a.splits;
  const int kt = blockIdx.x / per_tile, rest = blockIdx.x % per_tile;
  const int split = rest % a.splits, kvh = (rest / a.splits) % a.kv_heads, b = rest / (a.splits * a.kv_heads);
  const int heads = a.group / a.splits, h_first = kvh * a.group + split * heads;
  const int k0 = kt * kKvKeys;
  const int tok0 = b * a.seq;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* sK = smem;
  char* sV = smem + T::kKTile;
  char* stages = sV + kKvTile;
  char* sDs = stages + kStages * T::kStage;  // kDq: the dS^T tile
  char* sDq = sDs + kDsTile;                // kDq: each warpgroup's two f32 boxes
  uint64_t* full = reinterpret_cast<uint64_t*>(sDs + (kDq ? kDsTile + 4 * kDqBox : 0));
  uint64_t* empty = full + kStages;
  uint64_t* kv_bar = empty + kStages;
  init_barriers<kStages>(full, empty, kv_bar);

  const int qt_first = a.causal ? k0 / kKvRows : 0, n_qt = a.q_len / kKvRows - qt_first;
  const int n_it = heads * n_qt;
  // Iteration it's query head and first query row.
  auto head_of = [&](int it) { return kDq ? h_first + it % heads : h_first + it / n_qt; };
  auto row0_of = [&](int it) {
    return kDq ? (a.q_len / kKvRows - 1 - it / heads) * kKvRows : (qt_first + it % n_qt) * kKvRows;
  };
  auto issue = [&](int it, int s) {
    const int h = head_of(it), q0 = row0_of(it);
    char* st = stages + s * T::kStage;
    char* stats = st + T::kQTile + kKvQTile;
    uint64_t* bar = &full[s];
    const int64_t row = (static_cast<int64_t>(b) * a.q_heads + h) * a.seq + q0;
    mbar_arrive_expect_tx(bar, T::kQTile + kKvQTile + 512 + (a.seg != nullptr ? 256 : 0));
    load_tile<kQk>(st, T::kQTile, &maps.q_rows64, bar, h * kQk, tok0 + q0);
    load_tile128(st + T::kQTile, kKvQTile, &maps.do_rows64, bar, h * kD, tok0 + q0);
    bulk_load(stats, a.lse2 + row, 256, bar);
    bulk_load(stats + 256, a.delta + row, 256, bar);
    if (a.seg != nullptr) bulk_load(stats + 512, a.seg + tok0 + q0, 256, bar);
  };
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  if (tid == 0) {
    mbar_arrive_expect_tx(kv_bar, T::kKTile + kKvTile);
    load_tile<kQk>(sK, T::kKTile, &maps.k_rows128, kv_bar, kvh * kQk, tok0 + k0);
    load_tile128(sV, kKvTile, &maps.v_rows128, kv_bar, kvh * kD, tok0 + k0);
    for (int s = 0; s < kStages && s < n_it; ++s) issue(s, s);
  }
  const int kw0 = k0 + wg * 64;  // this warpgroup's first key
  int key[2], seg_k[2] = {0, 0};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    key[h] = kw0 + 16 * w + g + 8 * h;
    if (a.seg != nullptr) seg_k[h] = a.kseg[tok0 + key[h]];
  }
  float dk[64], dv[64], dk2[kQk == kD ? 1 : 32];  // dk2: dK's columns 128..191 at kQk = 192
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;
#pragma unroll
  for (int i = 0; i < (kQk == kD ? 1 : 32); ++i) dk2[i] = 0.f;
  const uint32_t k_addr = smem_u32(sK) + wg * 64 * 128, v_addr = smem_u32(sV) + wg * 64 * 128;
  mbar_wait(kv_bar, 0);

  for (int it = 0; it < n_it; ++it) {
    const int s = it % kStages;
    mbar_wait(&full[s], (it / kStages) & 1);
    const int q0 = row0_of(it);
    // Else every query of the tile precedes every key here. With kDq the warpgroup computes
    // anyway (the mask zeroes all of P and dS): it would only wait at the barrier below, and
    // a branch around wgmma makes the compiler serialise every wgmma of the kernel.
    const bool active = kDq || !a.causal || q0 + kKvRows - 1 >= kw0;
    // P^T and dS^T as A fragments; with kDq the dV/dK MMAs that read them are still running
    // when the dQ MMAs are issued, so they are kept (keep_live) until the wait.
    uint32_t ap[4][4], ads[4][4];
    if (active) {
      char* st = stages + s * T::kStage;
      const uint32_t q_addr = smem_u32(st), do_addr = smem_u32(st + T::kQTile);
      const float* s_lse2 = reinterpret_cast<const float*>(st + T::kQTile + kKvQTile);
      const float* s_delta = s_lse2 + 64;
      const int32_t* s_seg = reinterpret_cast<const int32_t*>(s_lse2 + 128);
      float sc[32], dp[32];
      zero(sc);
      zero(dp);
      wgmma_fence();
      mma_rows_by_rows<32, kQk>(sc, k_addr, kKvKeys, q_addr, kKvRows);  // S^T = K Q^T
      wgmma_commit();
      mma_rows_by_rows(dp, v_addr, kKvKeys, do_addr, kKvRows);  // dP^T = V dO^T
      wgmma_commit();
      wgmma_wait<1>();
      pin(sc);
      const bool mask = a.seg != nullptr || (a.causal && q0 < kw0 + 63);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 8 * j + 2 * t + c;
          const float l2 = s_lse2[col];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int i = 4 * j + 2 * h + c;
            float p = ex2(sc[i] * a.scale_log2 - l2);
            if (mask && ((a.causal && q0 + col < key[h]) || (a.seg != nullptr && s_seg[col] != seg_k[h]))) p = 0.f;
            sc[i] = p;
          }
        }
      }
      wgmma_wait<0>();
      pin(dp);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float d = s_delta[8 * j + 2 * t + c];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int i = 4 * j + 2 * h + c;
            dp[i] = sc[i] * (dp[i] - d);
          }
        }
      }
      a_fragments(ap, sc);
      a_fragments(ads, dp);
      if constexpr (kDq) {
        // Both warpgroups' dQ MMAs of it - 1 have read the dS tile. Every thread gets here:
        // with kDq `active` is always true (a skipped tile would hang this barrier).
        named_barrier(2, kThreads);
        // dS^T rows 16w + g (+ 8) of this warpgroup's 64; fragment kc holds query columns
        // 16 kc .. 16 kc + 15, i.e. 16-byte chunks 2 kc and 2 kc + 1 of the 128-byte row,
        // which the swizzle moves to chunk ^ (row % 8) = chunk ^ g.
        char* ds = sDs + (wg * 64 + 16 * w + g) * 128 + 4 * t;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) {
          const int c0 = ((2 * kc) ^ g) << 4, c1 = ((2 * kc + 1) ^ g) << 4;
          *reinterpret_cast<uint32_t*>(ds + c0) = ads[kc][0];
          *reinterpret_cast<uint32_t*>(ds + 8 * 128 + c0) = ads[kc][1];
          *reinterpret_cast<uint32_t*>(ds + c1) = ads[kc][2];
          *reinterpret_cast<uint32_t*>(ds + 8 * 128 + c1) = ads[kc][3];
        }
        fence_proxy_async();
      }
      pin(dv);
      pin(dk);
      if constexpr (kQk != kD) pin(dk2);
      wgmma_fence();
      mma_regs_by_cols(dv, ap, do_addr, kKvRows);  // dV += P^T dO
      mma_regs_by_cols(dk, ads, q_addr, kKvRows);  // dK += dS^T Q (Q's first two boxes)
      if constexpr (kQk != kD) {  // ... and its third box, columns 128..191
        const uint32_t q3 = q_addr + 2 * kKvRows * 128;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) wgmma_m64n64k16_rs<1>(dk2, ads[kc], sw128_desc(q3 + kc * 2048, kKvRows * 128, 1024));
      }
      wgmma_commit();
      if constexpr (!kDq) {
        wgmma_wait<0>();
        pin(dv);
        pin(dk);
        if constexpr (kQk != kD) pin(dk2);
      }
    }
    if constexpr (kDq) {
      named_barrier(1, kThreads);  // both warpgroups' dS^T are in the tile
      const uint32_t ds_addr = smem_u32(sDs);
      const uint32_t kb_addr = smem_u32(sK) + wg * (kKvTile / 2);  // box wg: K's columns 64 wg ..
      float dq[32];
      zero(dq);  // not live during S and dP; keep_live below holds the dV/dK MMAs' registers
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < 8; ++kc) {
        wgmma_m64n64k16<1, 1>(dq, sw128_desc(ds_addr + kc * 2048, kKvKeys * 128, 1024),
                              sw128_desc(kb_addr + kc * 2048, kKvKeys * 128, 1024));
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin(dq);
      pin(dv);
      pin(dk);
      keep_live(ap);
      keep_live(ads);
      const int h_q = head_of(it);
      // Box jb holds this warpgroup's columns 32 jb .. 32 jb + 31 (dq[4 nb + 2 h + c] is
      // column 8 nb + 2 t + c, nb = 4 jb ..), rows 16 w + g + 8 h, 128-byte swizzled.
      char* box = sDq + wg * 2 * kDqBox;
      const bool leader = (tid & 127) == 0;
      if (leader) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // last reduce has read it
      named_barrier(3 + wg, 128);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * w + g + 8 * h;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
          const int c = (nb & 3) * 8 + 2 * t;
          *reinterpret_cast<float2*>(box + (nb >> 2) * kDqBox + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4) =
              make_float2(dq[4 * nb + 2 * h] * a.scale, dq[4 * nb + 2 * h + 1] * a.scale);
        }
      }
      fence_proxy_async();
      named_barrier(3 + wg, 128);
      if (leader) {
#pragma unroll
        for (int jb = 0; jb < 2; ++jb) {
          asm volatile(
              "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                  reinterpret_cast<uint64_t>(&maps.dq_acc)),
              "r"(smem_u32(box + jb * kDqBox)), "r"(h_q * kD + wg * 64 + 32 * jb), "r"(tok0 + q0)
              : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
      }
    }
    release_and_refill<kStages>(it, n_it, full, empty, issue);
  }
  if constexpr (kDq) {
    if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // before exit
  }

  if constexpr (kQk != kD) {  // MLA: no splits (its launcher asks none); dK rows of 192, dV rows of 128
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t tok = tok0 + key[h];
      bf16* gk = a.dk + tok * a.kv_heads * kQk + static_cast<int64_t>(kvh) * kQk + 2 * t;
      bf16* gv = a.dv + tok * a.kv_stride + static_cast<int64_t>(kvh) * kD + 2 * t;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(gk + 8 * j) = pack_bf16(dk[4 * j + 2 * h] * a.scale, dk[4 * j + 2 * h + 1] * a.scale);
        *reinterpret_cast<uint32_t*>(gv + 8 * j) = pack_bf16(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<uint32_t*>(gk + 128 + 8 * j) =
            pack_bf16(dk2[4 * j + 2 * h] * a.scale, dk2[4 * j + 2 * h + 1] * a.scale);
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t off = static_cast<int64_t>(tok0 + key[h]) * a.kv_stride + static_cast<int64_t>(kvh) * kD + 2 * t;
      if (a.splits > 1) {  // f32 partials, summed in split order by the reduce kernel
        const int64_t part = static_cast<int64_t>(split) * a.batch * a.seq * a.kv_stride + off;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          *reinterpret_cast<float2*>(a.dk_part + part + 8 * j) = make_float2(dk[4 * j + 2 * h], dk[4 * j + 2 * h + 1]);
          *reinterpret_cast<float2*>(a.dv_part + part + 8 * j) = make_float2(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<uint32_t*>(a.dk + off + 8 * j) =
            pack_bf16(dk[4 * j + 2 * h] * a.scale, dk[4 * j + 2 * h + 1] * a.scale);
        *reinterpret_cast<uint32_t*>(a.dv + off + 8 * j) = pack_bf16(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
      }
    }
  }
#endif
}

template <int kQk>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const __grid_constant__ Maps maps, const Args a) {
#if MT_SM90A
  using T = DqTiles<kQk>;
  constexpr int kQTile = T::kQTile, kQStage = T::kStage;  // a stage: K, V, the keys' segment ids
  const int bh = a.batch * a.q_heads, n_qt = a.q_len / kQRows;
  const int qt = n_qt - 1 - static_cast<int>(blockIdx.x / bh);
  const int b = (blockIdx.x % bh) / a.q_heads, h = blockIdx.x % a.q_heads, kvh = h / a.group;
  const int q0 = qt * kQRows;
  const int tok0 = b * a.seq;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  char* sQ = smem;
  char* sdO = smem + kQTile;
  char* stages = sdO + T::kDoTile;
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kStages * kQStage);
  uint64_t* empty = full + kStages;
  uint64_t* q_bar = empty + kStages;
  init_barriers<kStages>(full, empty, q_bar);

  const int n_it = a.causal ? (q0 + kQRows - 1) / kQKeys + 1 : a.k_len / kQKeys;  // causal: 0 .. the diagonal
  auto issue = [&](int it, int s) {
    const int kr = it * kQKeys;
    char* st = stages + s * kQStage;
    uint64_t* bar = &full[s];
    mbar_arrive_expect_tx(bar, T::kKTile + T::kVTile + (a.seg != nullptr ? 256 : 0));
    load_tile<kQk>(st, T::kKTile, &maps.k_rows64, bar, kvh * kQk, tok0 + kr);
    load_tile128(st + T::kKTile, T::kVTile, &maps.v_rows64, bar, kvh * kD, tok0 + kr);
    if (a.seg != nullptr) bulk_load(st + T::kKTile + T::kVTile, a.kseg + tok0 + kr, 256, bar);
  };
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  if (tid == 0) {
    mbar_arrive_expect_tx(q_bar, kQTile + T::kDoTile);
    load_tile<kQk>(sQ, kQTile, &maps.q_rows128, q_bar, h * kQk, tok0 + q0);
    load_tile128(sdO, T::kDoTile, &maps.do_rows128, q_bar, h * kD, tok0 + q0);
    for (int s = 0; s < kStages && s < n_it; ++s) issue(s, s);
  }
  const int qw0 = q0 + wg * 64;  // this warpgroup's first row
  int row[2], seg_q[2] = {0, 0};
  float lse2[2], delta[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row[i] = qw0 + 16 * w + g + 8 * i;
    const int64_t r = (static_cast<int64_t>(b) * a.q_heads + h) * a.seq + row[i];
    lse2[i] = a.lse2[r];
    delta[i] = a.delta[r];
    if (a.seg != nullptr) seg_q[i] = a.seg[tok0 + row[i]];
  }
  float dq[64], dq2[kQk == kD ? 1 : 32];  // dQ's columns 0..127, and 128..191 at kQk = 192
#pragma unroll
  for (int i = 0; i < 64; ++i) dq[i] = 0.f;
#pragma unroll
  for (int i = 0; i < (kQk == kD ? 1 : 32); ++i) dq2[i] = 0.f;
  const uint32_t q_addr = smem_u32(sQ) + wg * 64 * 128, do_addr = smem_u32(sdO) + wg * 64 * 128;
  mbar_wait(q_bar, 0);

  for (int it = 0; it < n_it; ++it) {
    const int s = it % kStages;
    mbar_wait(&full[s], (it / kStages) & 1);
    const int kr = it * kQKeys;
    if (!a.causal || kr <= qw0 + 63) {  // else every key of the tile follows every row here
      char* st = stages + s * kQStage;
      const uint32_t k_addr = smem_u32(st), v_addr = smem_u32(st + T::kKTile);
      const int32_t* s_seg = reinterpret_cast<const int32_t*>(st + T::kKTile + T::kVTile);
      float sc[32], dp[32];
      zero(sc);
      zero(dp);
      wgmma_fence();
      mma_rows_by_rows<32, kQk>(sc, q_addr, kQRows, k_addr, kQKeys);  // S = Q K^T
      wgmma_commit();
      mma_rows_by_rows(dp, do_addr, kQRows, v_addr, kQKeys);  // dP = dO V^T
      wgmma_commit();
      wgmma_wait<1>();
      pin(sc);
      const bool mask = a.seg != nullptr || (a.causal && kr + 63 > qw0);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 8 * j + 2 * t + c;
#pragma unroll
          for (int i2 = 0; i2 < 2; ++i2) {
            const int i = 4 * j + 2 * i2 + c;
            float p = ex2(sc[i] * a.scale_log2 - lse2[i2]);
            if (mask && ((a.causal && kr + col > row[i2]) || (a.seg != nullptr && s_seg[col] != seg_q[i2]))) p = 0.f;
            sc[i] = p;
          }
        }
      }
      wgmma_wait<0>();
      pin(dp);
#pragma unroll
      for (int i = 0; i < 32; ++i) dp[i] = sc[i] * (dp[i] - delta[(i >> 1) & 1]);
      uint32_t ads[4][4];
      a_fragments(ads, dp);
      pin(dq);
      if constexpr (kQk != kD) pin(dq2);
      wgmma_fence();
      mma_regs_by_cols(dq, ads, k_addr, kQKeys);  // dQ += dS K (K's first two boxes)
      if constexpr (kQk != kD) {  // ... and its third box, columns 128..191
        const uint32_t k3 = k_addr + 2 * kQKeys * 128;
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) wgmma_m64n64k16_rs<1>(dq2, ads[kc], sw128_desc(k3 + kc * 2048, kQKeys * 128, 1024));
      }
      wgmma_commit();
      wgmma_wait<0>();
      pin(dq);
      if constexpr (kQk != kD) pin(dq2);
    }
    release_and_refill<kStages>(it, n_it, full, empty, issue);
  }

#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    bf16* out = a.dq + static_cast<int64_t>(tok0 + row[i2]) * a.q_stride + static_cast<int64_t>(h) * kQk + 2 * t;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(out + 8 * j) =
          pack_bf16(dq[4 * j + 2 * i2] * a.scale, dq[4 * j + 2 * i2 + 1] * a.scale);
    }
    if constexpr (kQk != kD) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<uint32_t*>(out + 128 + 8 * j) =
            pack_bf16(dq2[4 * j + 2 * i2] * a.scale, dq2[4 * j + 2 * i2 + 1] * a.scale);
      }
    }
  }
#endif
}

template <typename Kernel>
void prepare(Kernel kernel, int smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
}

// The shape fields of Args (the launchers add their pointers and, backward, the splits).
Args args_of(const AttentionDims& d) {
  Args a{};
  a.batch = d.batch;
  a.seq = d.seq;
  a.q_heads = d.q_heads;
  a.kv_heads = d.kv_heads;
  a.group = d.q_heads / d.kv_heads;
  a.q_len = d.queries();
  a.k_len = d.keys();
  a.causal = d.causal;
  a.splits = 1;
  a.q_stride = static_cast<int64_t>(d.q_heads) * kD;
  a.kv_stride = static_cast<int64_t>(d.kv_heads) * kD;
  a.scale = d.scale;
  a.scale_log2 = static_cast<float>(static_cast<double>(d.scale) * 1.4426950408889634);
  return a;
}

}  // namespace

bool launch_attention_forward_hopper(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                     const int32_t* seg, const int32_t* kseg, __nv_bfloat16* out, float* lse,
                                     const AttentionDims& d, cudaStream_t s) {
  const uint64_t rows = static_cast<uint64_t>(d.batch) * d.seq;
  const uint64_t q_rows = rows - d.q_begin, k_rows = rows - d.k_begin;  // the pointers start at the part
  const uint64_t qc = static_cast<uint64_t>(d.q_heads) * d.head_dim, kc = static_cast<uint64_t>(d.kv_heads) * d.head_dim;
  const uint64_t vc = static_cast<uint64_t>(d.kv_heads) * kD;
  Maps m{};
  if (!make_tensor_map(&m.q_rows128, q, {qc, q_rows}, {64, 128}) ||
      !make_tensor_map(&m.k_rows128, k, {kc, k_rows}, {64, 128}) ||
      !make_tensor_map(&m.v_rows128, v, {vc, k_rows}, {64, 128})) {
    return false;
  }
  Args a = args_of(d);  // q_stride: the output's row, heads of kD
  a.seg = seg;
  a.kseg = kseg;
  a.o = out;
  a.lse_out = lse;
  const unsigned blocks = static_cast<unsigned>(d.queries() / kFRows) * d.batch * d.q_heads;
  if (d.head_dim == kD) {
    prepare(fwd_kernel<kD>, FwdTiles<kD>::kSmem);
    fwd_kernel<kD><<<blocks, kFThreads, FwdTiles<kD>::kSmem, s>>>(m, a);
  } else {
    prepare(fwd_kernel<192>, FwdTiles<192>::kSmem);
    fwd_kernel<192><<<blocks, kFThreads, FwdTiles<192>::kSmem, s>>>(m, a);
  }
  return true;
}

int attention_backward_hopper_key_tile() { return kKvKeys; }

namespace {
// Whole tiles: the sequences, the part's rows and where they begin in multiples of 128 (the
// segment ids' bulk copies then stay 16-byte aligned).
bool tiles_fit(const AttentionDims& d, const int32_t* seg) {
  return d.seq > 0 && d.seq % 128 == 0 && d.queries() % 128 == 0 && d.keys() % 128 == 0 && d.q_begin % 128 == 0 &&
         d.k_begin % 128 == 0 && reinterpret_cast<uintptr_t>(seg) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(d.k_seg) % 16 == 0;
}
}  // namespace

bool attention_hopper_forward_applies(const AttentionDims& d, const int32_t* seg) {
  return (d.head_dim == kD || d.head_dim == 192) && d.v_head_dim == kD && tiles_fit(d, seg) &&
         hopper_kernels_usable("MOETRAIN_ATTENTION_MMA_SYNC");
}

bool attention_hopper_applies(const AttentionDims& d, const int32_t* seg) {
  // Value heads of another size (MLA's 192 / 128) take the mma.sync kernels.
  return d.head_dim == kD && d.v_head_dim == kD && tiles_fit(d, seg) &&
         hopper_kernels_usable("MOETRAIN_ATTENTION_MMA_SYNC");
}

bool launch_attention_backward_hopper(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                      const __nv_bfloat16* v, const int32_t* seg, const int32_t* kseg,
                                      const float* delta, const float* lse2, float* dk_part, float* dv_part,
                                      int splits, float* dq_acc, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                      __nv_bfloat16* dv, const AttentionDims& d, cudaStream_t s) {
  const uint64_t rows = static_cast<uint64_t>(d.batch) * d.seq;
  const uint64_t q_rows = rows - d.q_begin, k_rows = rows - d.k_begin;  // the pointers start at the part
  const uint64_t qc = static_cast<uint64_t>(d.q_heads) * kD, kc = static_cast<uint64_t>(d.kv_heads) * kD;
  Maps m{};
  if (!make_tensor_map(&m.q_rows64, q, {qc, q_rows}, {64, 64}) ||
      !make_tensor_map(&m.do_rows64, dout, {qc, q_rows}, {64, 64}) ||
      !make_tensor_map(&m.k_rows128, k, {kc, k_rows}, {64, 128}) ||
      !make_tensor_map(&m.v_rows128, v, {kc, k_rows}, {64, 128}) ||
      !make_tensor_map(&m.q_rows128, q, {qc, q_rows}, {64, 128}) ||
      !make_tensor_map(&m.do_rows128, dout, {qc, q_rows}, {64, 128}) ||
      !make_tensor_map(&m.k_rows64, k, {kc, k_rows}, {64, 64}) ||
      !make_tensor_map(&m.v_rows64, v, {kc, k_rows}, {64, 64})) {
    return false;
  }
  Args a = args_of(d);
  a.lse2 = lse2;
  a.delta = delta;
  a.seg = seg;
  a.kseg = kseg;
  a.dq = dq;
  a.dk = dk;
  a.dv = dv;
  a.dk_part = dk_part;
  a.dv_part = dv_part;
  a.splits = splits;
  a.dq_acc = dq_acc;
  const unsigned kv_blocks = static_cast<unsigned>(d.keys() / kKvKeys) * d.batch * d.kv_heads * splits;
  if (dq_acc != nullptr) {
    if (!make_tensor_map(&m.dq_acc, dq_acc, {qc, rows}, {32, 64}, true)) return false;
    const int64_t n = static_cast<int64_t>(rows) * qc;
    cudaMemsetAsync(dq_acc, 0, static_cast<size_t>(n) * sizeof(float), s);
    prepare(dkdv_kernel<true>, kKvDqSmem);
    dkdv_kernel<true><<<kv_blocks, kThreads, kKvDqSmem, s>>>(m, a);
    return true;  // dQ stays in dq_acc, scaled, for the next op
  }
  prepare(dkdv_kernel<false>, kKvSmem);
  dkdv_kernel<false><<<kv_blocks, kThreads, kKvSmem, s>>>(m, a);
  prepare(dq_kernel<kD>, DqTiles<kD>::kSmem);
  dq_kernel<kD><<<static_cast<unsigned>(d.queries() / kQRows) * d.batch * d.q_heads, kThreads, DqTiles<kD>::kSmem, s>>>(
      m, a);
  return true;
}

bool launch_attention_backward_hopper_mla(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                          const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* seg,
                                          const int32_t* kseg, const float* delta, const float* lse2,
                                          __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                          const AttentionDims& d, cudaStream_t s) {
  constexpr int kMla = 192;
  const uint64_t rows = static_cast<uint64_t>(d.batch) * d.seq;
  const uint64_t q_rows = rows - d.q_begin, k_rows = rows - d.k_begin;  // the pointers start at the part
  const uint64_t qc = static_cast<uint64_t>(d.q_heads) * kMla, kc = static_cast<uint64_t>(d.kv_heads) * kMla;
  const uint64_t doc = static_cast<uint64_t>(d.q_heads) * kD, vc = static_cast<uint64_t>(d.kv_heads) * kD;
  Maps m{};
  if (!make_tensor_map(&m.q_rows128, q, {qc, q_rows}, {64, 128}) ||
      !make_tensor_map(&m.do_rows128, dout, {doc, q_rows}, {64, 128}) ||
      !make_tensor_map(&m.k_rows64, k, {kc, k_rows}, {64, 64}) ||
      !make_tensor_map(&m.v_rows64, v, {vc, k_rows}, {64, 64}) ||
      !make_tensor_map(&m.q_rows64, q, {qc, q_rows}, {64, 64}) ||
      !make_tensor_map(&m.do_rows64, dout, {doc, q_rows}, {64, 64}) ||
      !make_tensor_map(&m.k_rows128, k, {kc, k_rows}, {64, 128}) ||
      !make_tensor_map(&m.v_rows128, v, {vc, k_rows}, {64, 128})) {
    return false;
  }
  Args a = args_of(d);  // kv_stride: dV's rows (heads of 128)
  a.lse2 = lse2;
  a.delta = delta;
  a.seg = seg;
  a.kseg = kseg;
  a.dk = dk;
  a.dv = dv;
  prepare(dkdv_kernel<false, kMla>, KvTiles<kMla>::kSmem);
  dkdv_kernel<false, kMla><<<static_cast<unsigned>(d.keys() / kKvKeys) * d.batch * d.kv_heads, kThreads,
                             KvTiles<kMla>::kSmem, s>>>(m, a);
  a.q_stride = static_cast<int64_t>(qc);  // dQ's rows: heads of 192
  a.dq = dq;
  prepare(dq_kernel<kMla>, DqTiles<kMla>::kSmem);
  dq_kernel<kMla><<<static_cast<unsigned>(d.queries() / kQRows) * d.batch * d.q_heads, kThreads, DqTiles<kMla>::kSmem, s>>>(
      m, a);
  return true;
}

}  // namespace moetrain::ops::cuda
