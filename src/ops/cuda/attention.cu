// Fused causal grouped-query attention on tensor cores (FlashAttention-2 scheme), bf16 in
// and out, f32 accumulation, with warp-level mma.sync m16n8k16 (bf16) fed by ldmatrix.
//
// On an sm_90 GPU with head_dim = v_head_dim = 128 and seq a multiple of 128,
// attention_hopper.cu's TMA + wgmma kernels replace the forward, dK/dV and dQ kernels below
// (same math and order). DeepSeek-V3's MLA heads (query/key 192, value 128) always run here.
//
// Floor and expectation (H100 SXM, bench shape B=2, S=4096, Hq=32, Hkv=4, D=128, causal;
// FLOPs as FlashAttention counts them: forward 4*B*Hq*S^2*D/2 = 275 GFLOP, backward 2.5x =
// 687 GFLOP): at the 989 TFLOP/s dense bf16 peak (wgmma) the floor is 0.28 ms forward and
// 0.69 ms backward. mma.sync reaches about 2/3 of that peak on Hopper, and a warp that owns
// 16 rows feeds each 512-byte ldmatrix.x4 into only 2 mma (shared memory then caps it near
// 500 TFLOP/s); 32 rows per warp feed 4. The backward also repeats 2 of its 5 products in
// the dQ pass (7/5 of the counted work). Expected with these kernels: forward ~300-380
// TFLOP/s, backward ~180-250 TFLOP/s (counted FLOPs); more needs wgmma (sm_90a).
// Measured (bench_ops BM_Attention*): forward 241 -> 293 TFLOP/s, backward 120 -> 159.
// Nsight Compute on the backward: 8 warps per SM (255 registers), issue-latency bound
// (short-scoreboard waits on ldmatrix, fixed-latency dependencies), shared-memory pipe ~60%,
// tensor pipe ~1/3; the dK/dV pass takes ~60% of the backward.
//
// MLA heads (bench_ops BM_AttentionMla*: B=2, S=4096, Hq=Hkv=16, D=192, Dv=128, causal):
// forward 2*B*H*S^2*(D+Dv)/2 = 172 GFLOP (QK^T over D, PV over Dv), backward 2.5x = 429
// GFLOP; floor at 989 TFLOP/s 0.17 ms forward, 0.43 ms backward. The kernels do 12 + 8
// k-steps of 16 per key tile forward (D = 128: 8 + 8), and in the backward dK/dV 12 + 8 +
// 8 + 12, dQ 12 + 8 + 12 (72 done for 2.5 x 20 = 50 counted, 1.44x; D = 128: 1.40x). The
// per-tile softmax work is the same as at D = 128 while the products grow by 1.25x, so the
// same rates are the expectation where the tiles stay as large: forward ~250-320 TFLOP/s,
// backward ~140-190 (counted). Measured on an H100 (bench_ops, the tiles chosen below):
// forward 269 TFLOP/s (0.64 ms), backward 141 (3.04 ms): the mma.sync kernels' rates at
// D = 128 (287 / 156); the Hopper kernels' 462 / 281 at 128/128 are what wgmma would give.
//
// Notation: S the sequence length, D the query/key head dim (32, 64, 128 or 192), DV the
// value head dim (D, or 128 with D = 192). A warp owns MT m-tiles of 16 rows, so each mma
// result row lives in one quad of 4 lanes (lane/4 = row within 8, lane%4 = column pair).
// Shared-memory tiles are [rows][D + 8] bf16 (V, O, dO: [rows][DV + 8]): the 16-byte pad
// puts the 8 row addresses of each ldmatrix 8x8 matrix on distinct banks (a 400-byte row
// of 192 + 8 is 16 bytes past a multiple of 128, as 272 is). Tiles are copied in
// with cp.async (16-byte chunks; rows past S are zero-filled, so padded keys/values
// contribute exact zeros). Blocks are numbered so that the longest ones start first (the
// causal triangle makes their work uneven), over all heads and batches.
//
// Forward (one block per (query tile of BR = WARPS*MT*16 rows, query head, batch)): key/value
// tiles of BC rows, 0..diagonal, stream through a double buffer (key tiles right of the
// diagonal are never loaded; a warp whose rows all lie left of a tile skips it). Online
// softmax in the exp2 domain: x = scale*log2(e)*s, running max m and sum l per row;
// lse = (m + log2 l) * ln 2.
//
// Backward, no atomics, every output element written by exactly one thread in a fixed
// order (bitwise reproducible):
//   1. delta[b,h,s] = sum_d dO * O (over DV) and lse2 = lse * log2(e) (one warp per row).
//   2. dK/dV: one block per (key tile of WARPS*16 keys, kv head, batch, split); K and V stay
//      in shared memory, and the block loops, in a fixed order, over its query heads of the
//      kv group (all of them, or group/splits) and every query tile at or below the
//      diagonal; Q, dO, lse2 and delta of the next tile are copied in (cp.async) while the
//      current one is computed. Its warps hold S^T = K Q^T and dP^T = V dO^T for their 16
//      keys, so P^T and dS^T = P^T (dP^T - delta) are already A operands for dV += P^T dO
//      and dK += dS^T Q, accumulated in registers.
//   2b. With splits > 1 (too few key-tile blocks to fill the GPU), each split writes f32
//      partial sums and a small kernel adds them in split order.
//   3. dQ: one block per (query tile, query head, batch), recomputing S and dP from the
//      saved lse over the key tiles 0..diagonal: dQ += dS K, accumulated in registers.
// The dQ pass repeats two of the five matrix products (7 instead of 5), the price of a
// deterministic dQ without float atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cuda/attention_launch.h"
#include "ops/cuda/kernels.cuh"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kPad = 8;  // bf16 of padding per shared-memory row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const int32_t* seg;   // null: no segments (the queries' rows)
  const int32_t* kseg;  // the keys' rows: null exactly when seg is
  const bf16* dout;
  const bf16* out;
  const float* lse;
  float* delta;  // [B, Hq, S] rowsum(dO * O)
  float* lse2;   // [B, Hq, S] lse * log2(e)
  bf16* o;
  float* lse_out;
  bf16* dq;
  bf16* dk;
  bf16* dv;
  float* dk_part;  // splits > 1: f32 partial sums [splits][B*S, Hkv*D] (dK without the scale)
  float* dv_part;  // and [splits][B*S, Hkv*Dv]
  float* dq_acc;  // null, or the one-pass Hopper backward's f32 dQ sums (attention_hopper.cu)
  int batch, seq, q_heads, kv_heads, group;
  // The part of each sequence taking part (attention_launch.h): the pointers above already
  // start at its first query / key row; seq stays the rows from one sequence to the next
  // (and lse's, delta's row count). causal: key j seen by query i only when j <= i.
  int q_len, k_len;
  bool causal;
  int splits;  // dK/dV pass: blocks sharing one (key tile, kv head), group / splits heads each
  // Elements per token row: q/dq Hq*D, k/dk Hkv*D, v/dv Hkv*Dv, out/dout Hq*Dv.
  int64_t q_stride, k_stride, v_stride, o_stride;
  float scale, scale_log2;
};

// ---- PTX wrappers ---------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; when !valid nothing is read and the 16 bytes
// are zero-filled (src-size 0).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's most recent commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i
// of lane l receives row l/4, elements 2(l%4), 2(l%4)+1 of matrix i (of its transpose with
// .trans).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c[16x8] += a[16x16] b[16x8], bf16 in, f32 accumulate. Fragments (g = lane/4, t = lane%4):
// a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g); c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return l | (h << 16);
}

// The A fragment (16 rows x 16 k) for k-chunk kc built from two 8-column accumulator
// blocks c[2kc], c[2kc+1] of the same 16 rows (the accumulator layout matches A's).
template <int N>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[N][4], int kc) {
  a[0] = pack_bf16(c[2 * kc][0], c[2 * kc][1]);
  a[1] = pack_bf16(c[2 * kc][2], c[2 * kc][3]);
  a[2] = pack_bf16(c[2 * kc + 1][0], c[2 * kc + 1][1]);
  a[3] = pack_bf16(c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// Per-lane element offsets inside a [rows][LD] tile for the three ldmatrix patterns.
// a_off: the A fragment of the 16x16 block at (0, 0), non-transposed.
// bn_off: B fragments of two 8-wide n blocks from storage [n][k] (rows n, contiguous k):
//   registers {b0, b1} of n block 0, then {b0, b1} of n block 1.
// bt_off: the same from storage [k][n] (rows k, contiguous n), with .trans.
template <int LD>
struct LaneOffsets {
  int a, bn, bt;
  __device__ __forceinline__ explicit LaneOffsets(int lane)
      : a((lane & 15) * LD + (lane >> 4) * 8),
        bn(((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8),
        bt(((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8) {}
};

// 4 bytes global -> shared, asynchronously; zero-filled when !valid.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

// 2^x on the special-function unit (what exp2f becomes, minus its denormal handling).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Copies rows [0, valid_rows) of a ROWS x D tile (row r at src + r*stride) into dst
// [ROWS][D + kPad] with THREADS threads; rows from valid_rows on are zero-filled.
// valid_rows >= 1.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTotal = ROWS * kChunks;
#pragma unroll
  for (int it = 0; it < (kTotal + THREADS - 1) / THREADS; ++it) {
    const int i = it * THREADS + static_cast<int>(threadIdx.x);
    if (kTotal % THREADS == 0 || i < kTotal) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const bool ok = r < valid_rows;
      const bf16* g = ok ? src + r * stride + c : src;
      cp_async16(smem_u32(dst + r * (D + kPad) + c), g, ok);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
}

// The row strides of v (and dv) and of out (and dout): with DV == D they equal k's and q's,
// and reading those lets the D == DV kernels keep one register for each pair (they spilled
// a few registers with both).
template <int D, int DV>
__device__ __forceinline__ int64_t v_stride_of(const Params& p) {
  return DV == D ? p.k_stride : p.v_stride;
}
template <int D, int DV>
__device__ __forceinline__ int64_t o_stride_of(const Params& p) {
  return DV == D ? p.q_stride : p.o_stride;
}

// Maps blockIdx.x to (row tile, head, batch) with the tile index slowest and reversed, so
// the blocks with the most key tiles (the last query tiles) start first on every head.
struct TileOrder {
  int tile, h, b;
  __device__ __forceinline__ TileOrder(int n_tiles, int heads, int batch) {
    const int hb = heads * batch;
    tile = n_tiles - 1 - static_cast<int>(blockIdx.x) / hb;
    const int r = static_cast<int>(blockIdx.x) % hb;
    h = r % heads;
    b = r / heads;
  }
};

// ---- forward --------------------------------------------------------------------------

// Query/key heads of D, value heads of DV; MT m-tiles (16 rows each) per warp, BC keys per
// tile, WARPS warps, MINB blocks per SM.
template <int D, int DV, int MT, int BC, int WARPS, int MINB, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MINB) attention_fwd_kernel(const Params p) {
  constexpr int THREADS = WARPS * 32, BR = WARPS * MT * 16, LD = D + kPad, LDV = DV + kPad;
  constexpr int TK = BC * LD, TV = BC * LDV;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + BR * LD;      // STAGES buffers
  bf16* sV = sK + STAGES * TK;  // STAGES buffers of TV

  const int S = p.seq, Sq = p.q_len, Sk = p.k_len;
  const TileOrder t((Sq + BR - 1) / BR, p.q_heads, p.batch);
  const int h = t.h, b = t.b, g = h / p.group;
  const int q0 = t.tile * BR;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);
  const LaneOffsets<LDV> offv(lane);  // off itself when DV == D

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const int64_t v_stride = v_stride_of<D, DV>(p), o_stride = o_stride_of<D, DV>(p);
  const bf16* gq = p.q + (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
  const bf16* gk = p.k + tok0 * p.k_stride + static_cast<int64_t>(g) * D;
  const bf16* gv = p.v + tok0 * v_stride + static_cast<int64_t>(g) * DV;
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;
  const int32_t* kseg = p.kseg ? p.kseg + tok0 : nullptr;

  const int q_end = min(q0 + BR, Sq);
  const int n_kt = p.causal ? (q_end - 1) / BC + 1 : (Sk + BC - 1) / BC;  // causal: key tiles 0 .. the diagonal

  load_tile<BR, D, THREADS>(sQ, gq, p.q_stride, q_end - q0);
  // Pipeline: key/value tile kt goes to buffer kt % STAGES in commit group kt (Q with tile 0),
  // STAGES - 1 tiles ahead of the one being computed.
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_kt) {
      load_tile<BC, D, THREADS>(sK + st * TK, gk + st * BC * p.k_stride, p.k_stride, min(BC, Sk - st * BC));
      load_tile<BC, DV, THREADS>(sV + st * TV, gv + st * BC * v_stride, v_stride, min(BC, Sk - st * BC));
    }
    cp_async_commit();  // possibly empty: keeps one group per tile
  }

  const int row0 = q0 + warp * MT * 16;  // the warp's first row; row (mt, i) = row0 + 16 mt + 8 i + gr
  int seg_r[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + mt * 16 + i * 8 + gr;
      seg_r[mt][i] = (seg && r < Sq) ? seg[r] : 0;
    }
  }
  const uint32_t q_addr = smem_u32(sQ) + 2 * (warp * MT * 16 * LD + off.a);

  float o[MT][DV / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    zero(o[mt]);
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }

  cp_async_wait_group<STAGES - 2>();
  __syncthreads();

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt % STAGES;
    {  // prefetch tile kt + STAGES - 1 into the buffer freed by iteration kt - 1
      const int kn = kt + STAGES - 1, k1 = kn * BC, nbuf = kn % STAGES;
      if (kn < n_kt) {
        load_tile<BC, D, THREADS>(sK + nbuf * TK, gk + k1 * p.k_stride, p.k_stride, min(BC, Sk - k1));
        load_tile<BC, DV, THREADS>(sV + nbuf * TV, gv + k1 * v_stride, v_stride, min(BC, Sk - k1));
      }
      cp_async_commit();
    }
    const int k0 = kt * BC;
    if (!p.causal || k0 <= row0 + MT * 16 - 1) {  // else every key of the tile is right of the warp's rows
      const uint32_t k_base = smem_u32(sK + buf * TK), v_base = smem_u32(sV + buf * TV);

      // s = Q K^T for the warp's MT*16 rows x BC keys; each K fragment feeds MT m-tiles
      float s[MT][BC / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) zero(s[mt]);
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], q_addr + 2 * mt * 16 * LD + kc * 32);
#pragma unroll
        for (int nb2 = 0; nb2 < BC / 16; ++nb2) {
          uint32_t bf[4];
          ldsm_x4(bf, k_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(s[mt][2 * nb2], qa[mt], bf[0], bf[1]);
            mma_bf16(s[mt][2 * nb2 + 1], qa[mt], bf[2], bf[3]);
          }
        }
      }

      if (seg || (p.causal && k0 + BC - 1 > row0) || k0 + BC > Sk) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int nb = 0; nb < BC / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int j = k0 + nb * 8 + 2 * tq + (e & 1);
              const int r = row0 + mt * 16 + (e >> 1) * 8 + gr;
              const bool ok = (!p.causal || j <= r) && j < Sk && (!seg || kseg[j] == seg_r[mt][e >> 1]);
              if (!ok) s[mt][nb][e] = -INFINITY;
            }
          }
        }
      }

      // online softmax, per m-tile rows gr (i = 0: elements 0, 1) and gr + 8 (i = 1: 2, 3)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = -INFINITY;
#pragma unroll
          for (int nb = 0; nb < BC / 8; ++nb) mx = fmaxf(mx, fmaxf(s[mt][nb][2 * i], s[mt][nb][2 * i + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[mt][i], mx * p.scale_log2);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
          const float alpha = ex2(m[mt][i] - m_use);
          m[mt][i] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int nb = 0; nb < BC / 8; ++nb) {
            s[mt][nb][2 * i] = ex2(fmaf(s[mt][nb][2 * i], p.scale_log2, -m_use));
            s[mt][nb][2 * i + 1] = ex2(fmaf(s[mt][nb][2 * i + 1], p.scale_log2, -m_use));
            sum += s[mt][nb][2 * i] + s[mt][nb][2 * i + 1];
          }
          l[mt][i] = l[mt][i] * alpha + sum;  // this lane's share of the row sum; the quad adds up at the end
#pragma unroll
          for (int db = 0; db < DV / 8; ++db) {
            o[mt][db][2 * i] *= alpha;
            o[mt][db][2 * i + 1] *= alpha;
          }
        }
      }

      // o += P V; each V fragment feeds MT m-tiles
#pragma unroll
      for (int kc = 0; kc < BC / 16; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], s[mt], kc);
#pragma unroll
        for (int db2 = 0; db2 < DV / 16; ++db2) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, v_base + 2 * (kc * 16 * LDV + db2 * 16 + offv.bt));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][2 * db2], a[mt], bf[0], bf[1]);
            mma_bf16(o[mt][2 * db2 + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }

    cp_async_wait_group<STAGES - 2>();  // the next tile has landed ...
    __syncthreads();                    // ... for every thread, and nobody reads this buffer any more
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float lt = l[mt][i];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const int r = row0 + mt * 16 + i * 8 + gr;
      if (r < Sq) {
        // A row that saw no key (a part's documents or places all elsewhere): out 0, lse -inf.
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        bf16* go = p.o + (tok0 + r) * o_stride + static_cast<int64_t>(h) * DV + 2 * tq;
#pragma unroll
        for (int db = 0; db < DV / 8; ++db) {
          *reinterpret_cast<uint32_t*>(go + db * 8) =
              pack_bf16(o[mt][db][2 * i] * inv, o[mt][db][2 * i + 1] * inv);
        }
        if (tq == 0) {
          p.lse_out[(static_cast<int64_t>(b) * p.q_heads + h) * S + r] =
              lt > 0.f ? (m[mt][i] + log2f(lt)) * kLn2 : -INFINITY;
        }
      }
    }
  }
}

// ---- backward 1: delta = rowsum(dO * O), lse2 = lse * log2(e) -----------------------------

constexpr int kDeltaWarps = 8;

// Value heads (dO and O rows) of 128 with 16-byte aligned rows: 16 lanes a row (8 elements
// each), two rows a warp, so that each load moves 16 bytes a lane (4-byte loads took 70 us a
// layer at the bench shape against ~45 for the 134 MB read).
__global__ void __launch_bounds__(kDeltaWarps * 32) attention_bwd_delta128_kernel(const Params p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kDeltaWarps + (threadIdx.x >> 5)) * 2 + ((threadIdx.x >> 4) & 1);
  const int l16 = threadIdx.x & 15;
  const bool live = row < static_cast<int64_t>(p.batch) * p.q_len * p.q_heads;
  float acc = 0.f;
  int64_t t = 0;  // the token's row: sequence b's part row s at b * seq + s
  int h = 0;
  if (live) {
    const int64_t pr = row / p.q_heads;
    t = pr / p.q_len * p.seq + pr % p.q_len;
    h = static_cast<int>(row % p.q_heads);
    float x[8], y[8];
    load8(p.dout + t * p.o_stride + static_cast<int64_t>(h) * 128 + l16 * 8, x);
    load8(p.out + t * p.o_stride + static_cast<int64_t>(h) * 128 + l16 * 8, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(x[i], y[i], acc);
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);  // within each half-warp
  if (live && l16 == 0) {
    const int64_t b = t / p.seq, s = t % p.seq;
    const int64_t i = (b * p.q_heads + h) * p.seq + s;
    p.delta[i] = acc;
    p.lse2[i] = p.lse[i] * kLog2e;
  }
}

// DV: the value heads' size (dO and O rows).
template <int DV>
__global__ void __launch_bounds__(kDeltaWarps * 32) attention_bwd_delta_kernel(const Params p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDeltaWarps + (threadIdx.x >> 5);  // token * Hq + head
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(p.batch) * p.q_len * p.q_heads) return;  // whole warp
  const int64_t pr = row / p.q_heads, t = pr / p.q_len * p.seq + pr % p.q_len;
  const int h = static_cast<int>(row % p.q_heads);
  const bf16* a = p.dout + t * p.o_stride + static_cast<int64_t>(h) * DV;
  const bf16* c = p.out + t * p.o_stride + static_cast<int64_t>(h) * DV;
  float acc = 0.f;
#pragma unroll
  for (int i = 2 * lane; i < DV; i += 64) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a + i));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(c + i));
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t b = t / p.seq, s = t % p.seq;
    const int64_t i = (b * p.q_heads + h) * p.seq + s;
    p.delta[i] = acc;
    p.lse2[i] = p.lse[i] * kLog2e;
  }
}

// ---- backward 2: dK, dV -------------------------------------------------------------------

// Query/key heads of D, value heads of DV; WARPS warps of 16 keys each (BC = WARPS*16 keys
// per block), BQ queries per iteration.
template <int D, int DV, int BQ, int WARPS, int MINB, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MINB) attention_bwd_dkdv_kernel(const Params p) {
  constexpr int THREADS = WARPS * 32, BC = WARPS * 16, LD = D + kPad, LDV = DV + kPad;
  constexpr int TQ = BQ * LD, TO = BQ * LDV;
  // The products over the head dims (S^T over D, dP^T over DV; dK over D, dV over DV) share
  // one loop of max(D, DV) / 16 steps, each product skipping the steps past its own dim (a
  // compile-time test; with DV == D the loops are exactly the single-dim ones).
  constexpr int DMAX = D > DV ? D : DV;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + BC * LD;
  bf16* sQ = sV + BC * LDV;       // STAGES buffers of TQ
  bf16* sdO = sQ + STAGES * TQ;   // STAGES buffers of TO
  float* sLse = reinterpret_cast<float*>(sdO + STAGES * TO);  // STAGES buffers of BQ: lse * log2(e)
  float* sDel = sLse + STAGES * BQ;                           // STAGES buffers of BQ: delta

  const int S = p.seq, Sq = p.q_len, Sk = p.k_len;
  // blockIdx.x = (key tile, batch, kv head, split) with the key tile slowest: low key tiles
  // (the most query tiles) start first.
  const int per_kt = p.batch * p.kv_heads * p.splits;
  const int kt = static_cast<int>(blockIdx.x) / per_kt;
  const int rest = static_cast<int>(blockIdx.x) % per_kt;
  const int part = rest % p.splits, g = (rest / p.splits) % p.kv_heads, b = rest / (p.splits * p.kv_heads);
  const int heads = p.group / p.splits, h_begin = g * p.group + part * heads;
  const int k0 = kt * BC;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);
  const LaneOffsets<LDV> offv(lane);  // off itself when DV == D

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const int64_t v_stride = v_stride_of<D, DV>(p), o_stride = o_stride_of<D, DV>(p);
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;
  const int32_t* kseg = p.kseg ? p.kseg + tok0 : nullptr;
  const int n_qt = (Sq + BQ - 1) / BQ;
  const int qt_begin = p.causal ? k0 / BQ : 0;  // causal: query tiles above it see none of these keys
  const int per_head = n_qt - qt_begin;
  const int n_it = heads * per_head;  // (head, query tile) pairs, head-major

  // Starts the copies of iteration it's Q, dO, lse2 and delta into buffer buf.
  auto issue = [&](int it, int buf) {
    const int h = h_begin + it / per_head;
    const int q0 = (qt_begin + it % per_head) * BQ;
    const int64_t qoff = (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
    const int64_t ooff = (tok0 + q0) * o_stride + static_cast<int64_t>(h) * DV;
    load_tile<BQ, D, THREADS>(sQ + buf * TQ, p.q + qoff, p.q_stride, min(BQ, Sq - q0));
    load_tile<BQ, DV, THREADS>(sdO + buf * TO, p.dout + ooff, o_stride, min(BQ, Sq - q0));
    const int64_t soff = (static_cast<int64_t>(b) * p.q_heads + h) * S + q0;
    for (int i = tid; i < 2 * BQ; i += THREADS) {
      const int c = i % BQ;
      const bool ok = q0 + c < Sq;
      const float* src = i < BQ ? p.lse2 + soff : p.delta + soff;
      float* dst = (i < BQ ? sLse : sDel) + buf * BQ + c;
      cp_async4(smem_u32(dst), ok ? src + c : src, ok);
    }
  };

  const int64_t koff = (tok0 + k0) * p.k_stride + static_cast<int64_t>(g) * D;
  const int64_t voff = (tok0 + k0) * v_stride + static_cast<int64_t>(g) * DV;
  load_tile<BC, D, THREADS>(sK, p.k + koff, p.k_stride, min(BC, Sk - k0));
  load_tile<BC, DV, THREADS>(sV, p.v + voff, v_stride, min(BC, Sk - k0));
  // Pipeline: iteration it's tiles go to buffer it % STAGES in commit group it (K and V
  // with iteration 0), STAGES - 1 iterations ahead of the one being computed.
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_it) issue(st, st);
    cp_async_commit();  // possibly empty: keeps one group per iteration
  }

  const int kw = k0 + warp * 16;          // the warp's first key
  const int j_lo = kw + gr, j_hi = j_lo + 8;  // this lane's two keys
  const int seg_lo = (kseg && j_lo < Sk) ? kseg[j_lo] : 0;
  const int seg_hi = (kseg && j_hi < Sk) ? kseg[j_hi] : 0;
  const uint32_t k_addr = smem_u32(sK) + 2 * (warp * 16 * LD + off.a);
  const uint32_t v_addr = smem_u32(sV) + 2 * (warp * 16 * LDV + offv.a);

  float dk[D / 8][4], dv[DV / 8][4];
  zero(dk);
  zero(dv);

  cp_async_wait_group<STAGES - 2>();
  __syncthreads();

  for (int it = 0; it < n_it; ++it) {
    const int buf = it % STAGES;
    if (it + STAGES - 1 < n_it) issue(it + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    const int q0 = (qt_begin + it % per_head) * BQ;
    if (!p.causal || kw <= q0 + BQ - 1) {  // else every query of the tile is left of the warp's keys: P = 0
      const uint32_t q_base = smem_u32(sQ + buf * TQ), do_base = smem_u32(sdO + buf * TO);
      const float* lse_t = sLse + buf * BQ;
      const float* del_t = sDel + buf * BQ;

      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x BQ queries
      float st[BQ / 8][4], dpt[BQ / 8][4];
      zero(st);
      zero(dpt);
#pragma unroll
      for (int kc = 0; kc < DMAX / 16; ++kc) {
        uint32_t ka[4], va[4];
        if (kc < D / 16) ldsm_x4(ka, k_addr + kc * 32);
        if (kc < DV / 16) ldsm_x4(va, v_addr + kc * 32);
#pragma unroll
        for (int nb2 = 0; nb2 < BQ / 16; ++nb2) {
          uint32_t bf[4];
          if (kc < D / 16) {
            ldsm_x4(bf, q_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
            mma_bf16(st[2 * nb2], ka, bf[0], bf[1]);
            mma_bf16(st[2 * nb2 + 1], ka, bf[2], bf[3]);
          }
          if (kc < DV / 16) {
            ldsm_x4(bf, do_base + 2 * (nb2 * 16 * LDV + kc * 16 + offv.bn));
            mma_bf16(dpt[2 * nb2], va, bf[0], bf[1]);
            mma_bf16(dpt[2 * nb2 + 1], va, bf[2], bf[3]);
          }
        }
      }

      // P^T = exp(scale s - lse) (0 where masked), dS^T = P^T (dP^T - delta)
      const bool need_mask = seg || (p.causal && q0 < kw + 15) || q0 + BQ > Sq;
#pragma unroll
      for (int nb = 0; nb < BQ / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ci = nb * 8 + 2 * tq + (e & 1);  // query column within the tile
          bool ok = true;
          if (need_mask) {
            const int i = q0 + ci, j = e < 2 ? j_lo : j_hi;
            ok = i < Sq && (!p.causal || j <= i) && (!seg || seg[i] == (e < 2 ? seg_lo : seg_hi));
          }
          const float pv = ok ? ex2(fmaf(st[nb][e], p.scale_log2, -lse_t[ci])) : 0.f;
          st[nb][e] = pv;
          dpt[nb][e] = pv * (dpt[nb][e] - del_t[ci]);
        }
      }

      // dV += P^T dO, dK += dS^T Q (k = the tile's queries)
#pragma unroll
      for (int kc = 0; kc < BQ / 16; ++kc) {
        uint32_t pa[4], da[4];
        acc_to_a(pa, st, kc);
        acc_to_a(da, dpt, kc);
#pragma unroll
        for (int db2 = 0; db2 < DMAX / 16; ++db2) {
          uint32_t bf[4];
          if (db2 < DV / 16) {
            ldsm_x4_trans(bf, do_base + 2 * (kc * 16 * LDV + db2 * 16 + offv.bt));
            mma_bf16(dv[2 * db2], pa, bf[0], bf[1]);
            mma_bf16(dv[2 * db2 + 1], pa, bf[2], bf[3]);
          }
          if (db2 < D / 16) {
            ldsm_x4_trans(bf, q_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
            mma_bf16(dk[2 * db2], da, bf[0], bf[1]);
            mma_bf16(dk[2 * db2 + 1], da, bf[2], bf[3]);
          }
        }
      }
    }

    cp_async_wait_group<STAGES - 2>();
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int j = i ? j_hi : j_lo;
    if (j < Sk) {
      const int64_t off_k = (tok0 + j) * p.k_stride + static_cast<int64_t>(g) * D + 2 * tq;
      const int64_t off_v = (tok0 + j) * v_stride + static_cast<int64_t>(g) * DV + 2 * tq;
      if (p.splits == 1) {
#pragma unroll
        for (int db = 0; db < DMAX / 8; ++db) {
          if (db < D / 8) {
            *reinterpret_cast<uint32_t*>(p.dk + off_k + db * 8) =
                pack_bf16(dk[db][2 * i] * p.scale, dk[db][2 * i + 1] * p.scale);
          }
          if (db < DV / 8) {
            *reinterpret_cast<uint32_t*>(p.dv + off_v + db * 8) = pack_bf16(dv[db][2 * i], dv[db][2 * i + 1]);
          }
        }
      } else {
        const int64_t part_k = static_cast<int64_t>(part) * p.batch * S * p.k_stride + off_k;
        const int64_t part_v = static_cast<int64_t>(part) * p.batch * S * v_stride + off_v;
#pragma unroll
        for (int db = 0; db < DMAX / 8; ++db) {
          if (db < D / 8) {
            *reinterpret_cast<float2*>(p.dk_part + part_k + db * 8) = make_float2(dk[db][2 * i], dk[db][2 * i + 1]);
          }
          if (db < DV / 8) {
            *reinterpret_cast<float2*>(p.dv_part + part_v + db * 8) = make_float2(dv[db][2 * i], dv[db][2 * i + 1]);
          }
        }
      }
    }
  }
}

// dK = scale * sum of the partial sums, dV = their sum, over the splits in order (two
// elements per thread, grid-stride; dK has B*S*Hkv*D elements, dV B*S*Hkv*Dv).
__global__ void __launch_bounds__(256) attention_bwd_dkdv_reduce_kernel(const Params p) {
  const int64_t k_part = static_cast<int64_t>(p.batch) * p.seq * p.k_stride;  // strides are even
  const int64_t v_part = static_cast<int64_t>(p.batch) * p.seq * p.v_stride;
  const int64_t nk2 = k_part / 2, nv2 = v_part / 2, n2 = nk2 > nv2 ? nk2 : nv2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n2;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float2 k = make_float2(0.f, 0.f), v = make_float2(0.f, 0.f);
    const bool do_k = i < nk2, do_v = i < nv2;
    for (int s = 0; s < p.splits; ++s) {
      if (do_k) {
        const float2 a = reinterpret_cast<const float2*>(p.dk_part + s * k_part)[i];
        k.x += a.x;
        k.y += a.y;
      }
      if (do_v) {
        const float2 c = reinterpret_cast<const float2*>(p.dv_part + s * v_part)[i];
        v.x += c.x;
        v.y += c.y;
      }
    }
    if (do_k) reinterpret_cast<uint32_t*>(p.dk)[i] = pack_bf16(k.x * p.scale, k.y * p.scale);
    if (do_v) reinterpret_cast<uint32_t*>(p.dv)[i] = pack_bf16(v.x, v.y);
  }
}

// ---- backward 3: dQ -----------------------------------------------------------------------

// The forward's tiling: query/key heads of D, value heads of DV, MT m-tiles per warp, BC
// keys per tile.
template <int D, int DV, int MT, int BC, int WARPS, int MINB, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MINB) attention_bwd_dq_kernel(const Params p) {
  constexpr int THREADS = WARPS * 32, BR = WARPS * MT * 16, LD = D + kPad, LDV = DV + kPad;
  constexpr int TK = BC * LD, TV = BC * LDV;
  constexpr int DMAX = D > DV ? D : DV;  // S over D and dP over DV share one loop (as in dK/dV)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + BR * LD;
  bf16* sK = sdO + BR * LDV;    // STAGES buffers
  bf16* sV = sK + STAGES * TK;  // STAGES buffers of TV

  const int S = p.seq, Sq = p.q_len, Sk = p.k_len;
  const TileOrder t((Sq + BR - 1) / BR, p.q_heads, p.batch);
  const int h = t.h, b = t.b, g = h / p.group;
  const int q0 = t.tile * BR;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);
  const LaneOffsets<LDV> offv(lane);  // off itself when DV == D

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const int64_t v_stride = v_stride_of<D, DV>(p), o_stride = o_stride_of<D, DV>(p);
  const int64_t qoff = (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
  const int64_t ooff = (tok0 + q0) * o_stride + static_cast<int64_t>(h) * DV;
  const bf16* gk = p.k + tok0 * p.k_stride + static_cast<int64_t>(g) * D;
  const bf16* gv = p.v + tok0 * v_stride + static_cast<int64_t>(g) * DV;
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;
  const int32_t* kseg = p.kseg ? p.kseg + tok0 : nullptr;

  const int q_end = min(q0 + BR, Sq);
  const int n_kt = p.causal ? (q_end - 1) / BC + 1 : (Sk + BC - 1) / BC;

  load_tile<BR, D, THREADS>(sQ, p.q + qoff, p.q_stride, q_end - q0);
  load_tile<BR, DV, THREADS>(sdO, p.dout + ooff, o_stride, q_end - q0);
  // Pipeline: key/value tile kt goes to buffer kt % STAGES in commit group kt (Q with tile 0),
  // STAGES - 1 tiles ahead of the one being computed.
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_kt) {
      load_tile<BC, D, THREADS>(sK + st * TK, gk + st * BC * p.k_stride, p.k_stride, min(BC, Sk - st * BC));
      load_tile<BC, DV, THREADS>(sV + st * TV, gv + st * BC * v_stride, v_stride, min(BC, Sk - st * BC));
    }
    cp_async_commit();  // possibly empty: keeps one group per tile
  }

  const int row0 = q0 + warp * MT * 16;
  const int64_t soff = (static_cast<int64_t>(b) * p.q_heads + h) * S;
  float lse2[MT][2], del[MT][2];
  int seg_r[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + mt * 16 + i * 8 + gr;
      lse2[mt][i] = r < Sq ? p.lse2[soff + r] : 0.f;
      del[mt][i] = r < Sq ? p.delta[soff + r] : 0.f;
      seg_r[mt][i] = (seg && r < Sq) ? seg[r] : 0;
    }
  }
  const uint32_t q_addr = smem_u32(sQ) + 2 * (warp * MT * 16 * LD + off.a);
  const uint32_t do_addr = smem_u32(sdO) + 2 * (warp * MT * 16 * LDV + offv.a);

  float dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) zero(dq[mt]);

  cp_async_wait_group<STAGES - 2>();
  __syncthreads();

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt % STAGES;
    {  // prefetch tile kt + STAGES - 1 into the buffer freed by iteration kt - 1
      const int kn = kt + STAGES - 1, k1 = kn * BC, nbuf = kn % STAGES;
      if (kn < n_kt) {
        load_tile<BC, D, THREADS>(sK + nbuf * TK, gk + k1 * p.k_stride, p.k_stride, min(BC, Sk - k1));
        load_tile<BC, DV, THREADS>(sV + nbuf * TV, gv + k1 * v_stride, v_stride, min(BC, Sk - k1));
      }
      cp_async_commit();
    }
    const int k0 = kt * BC;
    if (!p.causal || k0 <= row0 + MT * 16 - 1) {
      const uint32_t k_base = smem_u32(sK + buf * TK), v_base = smem_u32(sV + buf * TV);

      // s = Q K^T, dp = dO V^T for the warp's MT*16 rows x BC keys
      float s[MT][BC / 8][4], dp[MT][BC / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        zero(s[mt]);
        zero(dp[mt]);
      }
#pragma unroll
      for (int kc = 0; kc < DMAX / 16; ++kc) {
        uint32_t qa[MT][4], da[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (kc < D / 16) ldsm_x4(qa[mt], q_addr + 2 * mt * 16 * LD + kc * 32);
          if (kc < DV / 16) ldsm_x4(da[mt], do_addr + 2 * mt * 16 * LDV + kc * 32);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < BC / 16; ++nb2) {
          uint32_t bf[4];
          if (kc < D / 16) {
            ldsm_x4(bf, k_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              mma_bf16(s[mt][2 * nb2], qa[mt], bf[0], bf[1]);
              mma_bf16(s[mt][2 * nb2 + 1], qa[mt], bf[2], bf[3]);
            }
          }
          if (kc < DV / 16) {
            ldsm_x4(bf, v_base + 2 * (nb2 * 16 * LDV + kc * 16 + offv.bn));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              mma_bf16(dp[mt][2 * nb2], da[mt], bf[0], bf[1]);
              mma_bf16(dp[mt][2 * nb2 + 1], da[mt], bf[2], bf[3]);
            }
          }
        }
      }

      // dS = P (dP - delta), P = exp(scale s - lse), 0 where masked (kept in dp)
      const bool need_mask = seg || (p.causal && k0 + BC - 1 > row0) || k0 + BC > Sk;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nb = 0; nb < BC / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = e >> 1;
            bool ok = true;
            if (need_mask) {
              const int j = k0 + nb * 8 + 2 * tq + (e & 1);
              const int r = row0 + mt * 16 + i * 8 + gr;
              ok = (!p.causal || j <= r) && j < Sk && (!seg || kseg[j] == seg_r[mt][i]);
            }
            const float pv = ok ? ex2(fmaf(s[mt][nb][e], p.scale_log2, -lse2[mt][i])) : 0.f;
            dp[mt][nb][e] = pv * (dp[mt][nb][e] - del[mt][i]);
          }
        }
      }

      // dq += dS K; each K fragment feeds MT m-tiles
#pragma unroll
      for (int kc = 0; kc < BC / 16; ++kc) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], dp[mt], kc);
#pragma unroll
        for (int db2 = 0; db2 < D / 16; ++db2) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, k_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(dq[mt][2 * db2], a[mt], bf[0], bf[1]);
            mma_bf16(dq[mt][2 * db2 + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }

    cp_async_wait_group<STAGES - 2>();
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + mt * 16 + i * 8 + gr;
      if (r < Sq) {
        bf16* gq = p.dq + (tok0 + r) * p.q_stride + static_cast<int64_t>(h) * D + 2 * tq;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
          *reinterpret_cast<uint32_t*>(gq + db * 8) =
              pack_bf16(dq[mt][db][2 * i] * p.scale, dq[mt][db][2 * i + 1] * p.scale);
        }
      }
    }
  }
}

// ---- context parallelism's ring: merging a part into the running softmax ------------------

// One warp per (batch, head, row): with l = log(e^la + e^lb), acc = e^(la - l) acc + e^(lb - l)
// part; a row whose part saw nothing (lb = -inf) is left alone. acc's out is f32 (the running
// sum kept unrounded), the part's bf16 or f32.
template <typename P>
__global__ void __launch_bounds__(256) attention_merge_kernel(float* __restrict__ acc_out, float* __restrict__ acc_lse,
                                                              const P* __restrict__ part_out,
                                                              const float* __restrict__ part_lse, int64_t rows,
                                                              int q_heads, int seq, int dv) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);  // (b, h, s) as lse lays it out
  const int lane = threadIdx.x & 31;
  if (i >= rows) return;  // whole warp
  const float lb = part_lse[i];
  if (lb == -INFINITY) return;
  const float la = acc_lse[i];
  const float m = fmaxf(la, lb);
  const float l = m + logf(expf(la - m) + expf(lb - m));
  const float wa = expf(la - l), wb = expf(lb - l);
  const int64_t s = i % seq, bh = i / seq, h = bh % q_heads, b = bh / q_heads;
  const int64_t row = ((b * seq + s) * q_heads + h) * dv;
  for (int d = lane; d < dv; d += 32) acc_out[row + d] = wa * acc_out[row + d] + wb * to_float(part_out[row + d]);
  if (lane == 0) acc_lse[i] = l;
}

__global__ void __launch_bounds__(256) fill_kernel(float* __restrict__ x, int64_t n, float value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x; i < n; i += static_cast<int64_t>(gridDim.x) * 256) {
    x[i] = value;
  }
}

// ---- launchers ------------------------------------------------------------------------

Params make_params(const AttentionDims& d) {
  Params p{};
  p.batch = d.batch;
  p.seq = d.seq;
  p.q_heads = d.q_heads;
  p.kv_heads = d.kv_heads;
  p.group = d.q_heads / d.kv_heads;
  p.q_len = d.queries();
  p.k_len = d.keys();
  p.causal = d.causal;
  p.splits = 1;
  p.q_stride = static_cast<int64_t>(d.q_heads) * d.head_dim;
  p.k_stride = static_cast<int64_t>(d.kv_heads) * d.head_dim;
  p.v_stride = static_cast<int64_t>(d.kv_heads) * d.v_head_dim;
  p.o_stride = static_cast<int64_t>(d.q_heads) * d.v_head_dim;
  p.scale = d.scale;
  p.scale_log2 = static_cast<float>(static_cast<double>(d.scale) * 1.4426950408889634);
  return p;
}

// Launches kernel with `smem` bytes of dynamic shared memory (raising the limit past 48 KB;
// a failure shows up in the caller's check_launch).
template <typename Kernel>
void launch(Kernel kernel, unsigned blocks, int threads, size_t smem, cudaStream_t s, const Params& p) {
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  }
  kernel<<<blocks, threads, smem, s>>>(p);
}

// Shared memory per SM on H100 (228 KB) less 1 KB the runtime reserves per block: MINB
// blocks of `smem` bytes each must fit (checked at compile time for every tiling below).
constexpr bool fits_sm(size_t smem, int minb) { return minb * (smem + 1024) <= 228 * 1024; }

template <int D, int DV, int MT, int BC, int WARPS, int MINB, int STAGES>
void forward_tiled(const Params& p, cudaStream_t s) {
  constexpr int BR = WARPS * MT * 16;
  constexpr size_t smem = (BR * (D + kPad) + STAGES * BC * (D + DV + 2 * kPad)) * sizeof(bf16);
  static_assert(fits_sm(smem, MINB), "forward tiles exceed the shared memory of MINB blocks");
  const unsigned blocks = static_cast<unsigned>((p.q_len + BR - 1) / BR) * p.q_heads * p.batch;
  launch(attention_fwd_kernel<D, DV, MT, BC, WARPS, MINB, STAGES>, blocks, WARPS * 32, smem, s, p);
}

template <int D, int DV, int MT, int BC, int WARPS, int MINB, int STAGES>
void dq_tiled(const Params& p, cudaStream_t s) {
  constexpr int BR = WARPS * MT * 16;
  constexpr size_t smem = (BR + STAGES * BC) * (D + DV + 2 * kPad) * sizeof(bf16);
  static_assert(fits_sm(smem, MINB), "dQ tiles exceed the shared memory of MINB blocks");
  const unsigned blocks = static_cast<unsigned>((p.q_len + BR - 1) / BR) * p.q_heads * p.batch;
  launch(attention_bwd_dq_kernel<D, DV, MT, BC, WARPS, MINB, STAGES>, blocks, WARPS * 32, smem, s, p);
}

template <int D, int DV, int BQ, int WARPS, int MINB, int STAGES>
void dkdv_tiled(const Params& p, cudaStream_t s) {
  constexpr int BC = WARPS * 16;
  constexpr size_t smem =
      (BC + STAGES * BQ) * (D + DV + 2 * kPad) * sizeof(bf16) + 2 * STAGES * BQ * sizeof(float);
  static_assert(fits_sm(smem, MINB), "dK/dV tiles exceed the shared memory of MINB blocks");
  const unsigned blocks = static_cast<unsigned>((p.k_len + BC - 1) / BC) * p.batch * p.kv_heads * p.splits;
  launch(attention_bwd_dkdv_kernel<D, DV, BQ, WARPS, MINB, STAGES>, blocks, WARPS * 32, smem, s, p);
}

// Tile choices (H100, D = 128, measured): the forward and dQ passes double-buffer; 32 rows
// per warp with 32-key tiles beat 16 rows per warp with 64-key tiles (294 vs 270 TFLOP/s
// forward); a third stage or 8-warp blocks gave nothing or lost. The dQ pass keeps 16 rows
// per warp and 64-key tiles (32 rows per warp did not help it). The dK/dV pass keeps the
// 64-key, 4-warp blocks (128 keys in 8 warps spill at 255 registers and lost) with a
// three-stage pipeline; splitting its heads over more blocks (splits 1..8) measured the same.
//
// MLA (D = 192, DV = 128): rows of Q/K take 400 bytes and rows of V/dO 272 in shared memory
// (1.5x and 1x D = 128's 272), and two blocks of 4 warps an SM need <= 113 KB a block. The
// forward and the dK/dV pass keep D = 128's tiling (92 KB and 106 KB a block): ptxas reports
// small spills for them at 255 registers (40 and 92 bytes; the tiles that avoid spilling are
// 16 keys / 16 queries wide), yet they measured faster on an H100 (B=2 S=4096 16 heads:
// forward 269 TFLOP/s against 223 for 16-key tiles, backward 141 against 137). The dQ pass's
// 64-key tiles would need 126 KB a block (one block an SM): it takes 32-key tiles (84 KB,
// 250 registers, no spill, 4 warps, two blocks an SM), which measured best against 48-key
// tiles and 64-key tiles of 8 warps at one block an SM.
constexpr int kDkdvWarps = 4;  // keys per dK/dV block: kDkdvWarps * 16, for every (D, DV)

template <int D, int DV>
void forward(const Params& p, cudaStream_t s) {
  forward_tiled<D, DV, 2, 32, 4, 2, 2>(p, s);
}

void dkdv_reduce(const Params& p, cudaStream_t s) {
  const int64_t n2 = static_cast<int64_t>(p.batch) * p.seq * std::max(p.k_stride, p.v_stride) / 2;
  const int64_t blocks = std::min<int64_t>((n2 + 255) / 256, 65536);
  attention_bwd_dkdv_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p);
}

// true when dQ was left in p.dq_acc (the one-pass Hopper kernel ran).
template <int D, int DV>
bool backward(const Params& p, const AttentionDims& d, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.q_len * p.q_heads;
  if (DV == 128 && p.o_stride % 8 == 0 && aligned16(p.dout) && aligned16(p.out)) {
    attention_bwd_delta128_kernel<<<static_cast<unsigned>((rows + 2 * kDeltaWarps - 1) / (2 * kDeltaWarps)),
                                    kDeltaWarps * 32, 0, s>>>(p);
  } else {
    attention_bwd_delta_kernel<DV>
        <<<static_cast<unsigned>((rows + kDeltaWarps - 1) / kDeltaWarps), kDeltaWarps * 32, 0, s>>>(p);
  }
  if (attention_hopper_applies(d, p.seg) &&
      launch_attention_backward_hopper(p.dout, p.q, p.k, p.v, p.seg, p.kseg, p.delta, p.lse2, p.dk_part, p.dv_part,
                                       p.splits, p.dq_acc, p.dq, p.dk, p.dv, d, s)) {
    if (p.splits > 1) dkdv_reduce(p, s);
    return p.dq_acc != nullptr;
  }

  // MLA's heads on Hopper: both passes with wgmma (no splits: MLA has a kv head per query head).
  if (D == 192 && DV == 128 && p.splits == 1 && attention_hopper_forward_applies(d, p.seg) &&
      launch_attention_backward_hopper_mla(p.dout, p.q, p.k, p.v, p.seg, p.kseg, p.delta, p.lse2, p.dq, p.dk, p.dv, d,
                                           s)) {
    return false;
  }

  dkdv_tiled<D, DV, 32, kDkdvWarps, 2, 3>(p, s);
  if (p.splits > 1) dkdv_reduce(p, s);

  if constexpr (D == 192) {
    dq_tiled<D, DV, 1, 32, 4, 2, 2>(p, s);
  } else {
    dq_tiled<D, DV, 1, 64, 4, 2, 2>(p, s);
  }
  return false;
}

}  // namespace

int attention_dkdv_splits(const AttentionDims& d, int num_sms) {
  if (!d.whole()) return 1;  // a part's dK/dV writes its rows at once (the reduce covers whole sequences)
  const bool hopper = attention_hopper_applies(d, nullptr);
  const int group = d.q_heads / d.kv_heads;
  const int bc = hopper ? attention_backward_hopper_key_tile() : kDkdvWarps * 16;
  const int64_t target = (hopper ? 1 : 3) * static_cast<int64_t>(num_sms);
  const int64_t blocks = static_cast<int64_t>((d.seq + bc - 1) / bc) * d.kv_heads * d.batch;
  int splits = 1;
  while (group % (2 * splits) == 0 && blocks * splits < target) splits *= 2;
  return splits;
}

void launch_attention_forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const int32_t* seg, __nv_bfloat16* out, float* lse, const AttentionDims& d,
                              cudaStream_t s) {
  if (d.batch == 0 || d.queries() == 0 || d.keys() == 0) return;
  Params p = make_params(d);
  const int32_t* kseg = d.k_seg ? d.k_seg : seg;
  p.q = q + d.q_begin * p.q_stride;
  p.k = k + d.k_begin * p.k_stride;
  p.v = v + d.k_begin * p.v_stride;
  p.seg = seg ? seg + d.q_begin : nullptr;
  p.kseg = kseg ? kseg + d.k_begin : nullptr;
  p.o = out + d.q_begin * p.o_stride;
  p.lse_out = lse + d.q_begin;
  if (attention_hopper_forward_applies(d, seg) &&
      launch_attention_forward_hopper(p.q, p.k, p.v, p.seg, p.kseg, p.o, p.lse_out, d, s)) {
    return;
  }
  // The (head_dim, v_head_dim) pairs the host wrapper accepts.
  if (d.v_head_dim == d.head_dim) {
    switch (d.head_dim) {
      case 32: forward<32, 32>(p, s); break;
      case 64: forward<64, 64>(p, s); break;
      case 128: forward<128, 128>(p, s); break;
      default: break;
    }
  } else if (d.head_dim == 192 && d.v_head_dim == 128) {
    forward<192, 128>(p, s);
  }
}

bool launch_attention_backward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const int32_t* seg, const __nv_bfloat16* out,
                               const float* lse, float* workspace, float* dkdv_partial, int split_count,
                               float* dq_acc, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                               const AttentionDims& d, cudaStream_t s) {
  if (d.batch == 0 || d.queries() == 0 || d.keys() == 0) return false;
  Params p = make_params(d);
  const bool whole = d.whole();
  p.dq_acc = whole ? dq_acc : nullptr;
  p.splits = split_count;
  p.dk_part = split_count > 1 ? dkdv_partial : nullptr;
  p.dv_part = split_count > 1 ? dkdv_partial + static_cast<int64_t>(split_count) * d.batch * d.seq * p.k_stride : nullptr;
  const int32_t* kseg = d.k_seg ? d.k_seg : seg;
  const int64_t qb = d.q_begin, kb = d.k_begin;
  p.dout = dout + qb * p.o_stride;
  p.q = q + qb * p.q_stride;
  p.k = k + kb * p.k_stride;
  p.v = v + kb * p.v_stride;
  p.seg = seg ? seg + qb : nullptr;
  p.kseg = kseg ? kseg + kb : nullptr;
  p.out = out + qb * p.o_stride;
  p.lse = lse + qb;
  p.delta = workspace + qb;
  p.lse2 = workspace + static_cast<int64_t>(d.batch) * d.q_heads * d.seq + qb;
  p.dq = dq + qb * p.q_stride;
  p.dk = dk + kb * p.k_stride;
  p.dv = dv + kb * p.v_stride;
  if (d.v_head_dim == d.head_dim) {
    switch (d.head_dim) {
      case 32: return backward<32, 32>(p, d, s);
      case 64: return backward<64, 64>(p, d, s);
      case 128: return backward<128, 128>(p, d, s);
      default: return false;
    }
  }
  if (d.head_dim == 192 && d.v_head_dim == 128) return backward<192, 128>(p, d, s);
  return false;
}

void launch_attention_merge(float* acc_out, float* acc_lse, const __nv_bfloat16* part_out, const float* part_lse,
                            int batch, int q_heads, int seq, int v_head_dim, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(batch) * q_heads * seq;
  if (rows == 0) return;
  attention_merge_kernel<bf16><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, s>>>(acc_out, acc_lse, part_out,
                                                                                    part_lse, rows, q_heads, seq,
                                                                                    v_head_dim);
}

void launch_attention_merge(float* acc_out, float* acc_lse, const float* part_out, const float* part_lse, int batch,
                            int q_heads, int seq, int v_head_dim, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(batch) * q_heads * seq;
  if (rows == 0) return;
  attention_merge_kernel<float><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, s>>>(acc_out, acc_lse, part_out,
                                                                                     part_lse, rows, q_heads, seq,
                                                                                     v_head_dim);
}

void launch_fill(float* x, int64_t n, float value, cudaStream_t s) {
  if (n == 0) return;
  fill_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, s>>>(x, n, value);
}

}  // namespace moetrain::ops::cuda
