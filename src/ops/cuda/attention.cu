// Fused causal grouped-query attention on tensor cores (FlashAttention-2 scheme), bf16 in
// and out, f32 accumulation, with warp-level mma.sync m16n8k16 (bf16) fed by ldmatrix.
//
// Notation: S the sequence length, D the head dim (32, 64 or 128), a "tile" 64 rows.
// Every block has 4 warps; a warp owns 16 rows of its block's 64-row tile, so each mma
// result row lives in one quad of 4 lanes (lane/4 = row within 8, lane%4 = column pair).
// Shared-memory tiles are [64][D + 8] bf16: the 16-byte pad puts the 8 row addresses of
// each ldmatrix 8x8 matrix on distinct banks. Tiles are copied in with cp.async (16-byte
// chunks; rows past S are zero-filled, so padded keys/values contribute exact zeros).
//
// Forward (one block per (query tile, query head, batch)): Q fragments stay in registers;
// key/value tiles 0..diagonal stream through a double buffer (the causal early exit: key
// tiles right of the diagonal are never loaded). Online softmax in the exp2 domain:
// x = scale*log2(e)*s, running max m and sum l per row; lse = (m + log2 l) * ln 2.
//
// Backward, no atomics, every output element written by exactly one thread in a fixed
// order (bitwise reproducible):
//   1. delta[b,h,s] = sum_d dO * O  (one warp per row).
//   2. dK/dV: one block per (key tile, kv head, batch, split); K and V stay in shared
//      memory, and the block loops, in a fixed order, over its query heads of the kv group
//      (all of them, or group/splits) and every query tile at or below the diagonal. Its
//      warps hold S^T = K Q^T and dP^T = V dO^T for their 16 keys, so P^T and
//      dS^T = P^T (dP^T - delta) are already A operands for dV += P^T dO and dK += dS^T Q,
//      accumulated in registers. The query tile is 32 rows for D = 128 (64 spills).
//   2b. With splits > 1 (too few key-tile blocks to fill the GPU, e.g. B=1, S=2048, Hkv=4),
//      each split writes f32 partial sums and a small kernel adds them in split order.
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

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kTile = 64;     // rows of a query or key tile
constexpr int kThreads = 128;  // 4 warps, 16 tile rows each
constexpr int kPad = 8;        // bf16 of padding per shared-memory row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const int32_t* seg;  // null: no segments
  const bf16* dout;
  const bf16* out;
  const float* lse;
  float* delta;
  bf16* o;
  float* lse_out;
  bf16* dq;
  bf16* dk;
  bf16* dv;
  float* dk_part;  // splits > 1: f32 partial sums [splits][B*S, Hkv*D] (dK without the scale)
  float* dv_part;
  int batch, seq, q_heads, kv_heads, group;
  int splits;  // dK/dV pass: blocks sharing one (key tile, kv head), group / splits heads each
  int64_t q_stride, kv_stride;  // elements per token row: Hq*D and Hkv*D
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
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

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

// Copies rows [0, valid_rows) of a ROWS x D tile (row r at src + r*stride) into dst
// [ROWS][D + kPad]; rows from valid_rows on are zero-filled. valid_rows >= 1.
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int valid_rows) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static_assert((ROWS * kChunks) % kThreads == 0, "tile chunks must split evenly over the block");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / kThreads; ++it) {
    const int i = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool ok = r < valid_rows;
    const bf16* g = ok ? src + r * stride + c : src;
    cp_async16(smem_u32(dst + r * (D + kPad) + c), g, ok);
  }
}

// ---- forward --------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(const Params p) {
  constexpr int LD = D + kPad, TE = kTile * LD;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + TE;      // two buffers
  bf16* sV = sK + 2 * TE;  // two buffers

  const int S = p.seq;
  const int n_qt = (S + kTile - 1) / kTile;
  const int qt = n_qt - 1 - static_cast<int>(blockIdx.x);  // longest rows first
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.group;
  const int q0 = qt * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const bf16* gq = p.q + (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
  const bf16* gk = p.k + tok0 * p.kv_stride + static_cast<int64_t>(g) * D;
  const bf16* gv = p.v + tok0 * p.kv_stride + static_cast<int64_t>(g) * D;
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;

  const int q_end = min(q0 + kTile, S);
  const int n_kt = (q_end - 1) / kTile + 1;  // key tiles 0 .. the diagonal

  load_tile<kTile, D>(sQ, gq, p.q_stride, q_end - q0);
  load_tile<kTile, D>(sK, gk, p.kv_stride, min(kTile, S));
  load_tile<kTile, D>(sV, gv, p.kv_stride, min(kTile, S));
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  uint32_t qf[D / 16][4];
  const uint32_t q_addr = smem_u32(sQ) + 2 * (warp * 16 * LD + off.a);
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) ldsm_x4(qf[kc], q_addr + kc * 32);

  const int r_lo = q0 + warp * 16 + gr, r_hi = r_lo + 8;
  const int seg_lo = (seg && r_lo < S) ? seg[r_lo] : 0;
  const int seg_hi = (seg && r_hi < S) ? seg[r_hi] : 0;

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {  // prefetch the next key/value tile into the other buffer
      const int k1 = (kt + 1) * kTile;
      load_tile<kTile, D>(sK + (buf ^ 1) * TE, gk + k1 * p.kv_stride, p.kv_stride, min(kTile, S - k1));
      load_tile<kTile, D>(sV + (buf ^ 1) * TE, gv + k1 * p.kv_stride, p.kv_stride, min(kTile, S - k1));
      cp_async_commit();
    }
    const uint32_t k_base = smem_u32(sK + buf * TE), v_base = smem_u32(sV + buf * TE);

    // s = Q K^T for the warp's 16 rows x 64 keys
    float s[kTile / 8][4];
#pragma unroll
    for (int i = 0; i < kTile / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int nb2 = 0; nb2 < kTile / 16; ++nb2) {
        uint32_t bf[4];
        ldsm_x4(bf, k_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
        mma_bf16(s[2 * nb2], qf[kc], bf[0], bf[1]);
        mma_bf16(s[2 * nb2 + 1], qf[kc], bf[2], bf[3]);
      }
    }

    const int k0 = kt * kTile;
    if (seg || k0 + kTile - 1 > q0 + warp * 16 || k0 + kTile > S) {
#pragma unroll
      for (int nb = 0; nb < kTile / 8; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = k0 + nb * 8 + 2 * tq + (e & 1);
          const int r = e < 2 ? r_lo : r_hi;
          const bool ok = j <= r && j < S && (!seg || seg[j] == (e < 2 ? seg_lo : seg_hi));
          if (!ok) s[nb][e] = -INFINITY;
        }
      }
    }

    // online softmax, rows r_lo (i = 0: elements 0, 1) and r_hi (i = 1: elements 2, 3)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int nb = 0; nb < kTile / 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb][2 * i], s[nb][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx * p.scale_log2);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
      const float alpha = exp2f(m[i] - m_use);
      m[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int nb = 0; nb < kTile / 8; ++nb) {
        s[nb][2 * i] = exp2f(fmaf(s[nb][2 * i], p.scale_log2, -m_use));
        s[nb][2 * i + 1] = exp2f(fmaf(s[nb][2 * i + 1], p.scale_log2, -m_use));
        sum += s[nb][2 * i] + s[nb][2 * i + 1];
      }
      l[i] = l[i] * alpha + sum;  // this lane's share of the row sum; the quad adds up at the end
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        o[db][2 * i] *= alpha;
        o[db][2 * i + 1] *= alpha;
      }
    }

    // o += P V
#pragma unroll
    for (int kc = 0; kc < kTile / 16; ++kc) {
      uint32_t a[4];
      acc_to_a(a, s, kc);
#pragma unroll
      for (int db2 = 0; db2 < D / 16; ++db2) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, v_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
        mma_bf16(o[2 * db2], a, bf[0], bf[1]);
        mma_bf16(o[2 * db2 + 1], a, bf[2], bf[3]);
      }
    }

    cp_async_wait_all();  // the next tile has landed ...
    __syncthreads();      // ... for every thread, and nobody reads this buffer any more
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float lt = l[i];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int r = i ? r_hi : r_lo;
    if (r < S) {
      const float inv = 1.f / lt;
      bf16* go = p.o + (tok0 + r) * p.q_stride + static_cast<int64_t>(h) * D + 2 * tq;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        *reinterpret_cast<uint32_t*>(go + db * 8) = pack_bf16(o[db][2 * i] * inv, o[db][2 * i + 1] * inv);
      }
      if (tq == 0) p.lse_out[(static_cast<int64_t>(b) * p.q_heads + h) * S + r] = (m[i] + log2f(lt)) * kLn2;
    }
  }
}

// ---- backward 1: delta = rowsum(dO * O) ---------------------------------------------------

constexpr int kDeltaWarps = 8;

template <int D>
__global__ void __launch_bounds__(kDeltaWarps * 32) attention_bwd_delta_kernel(const Params p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kDeltaWarps + (threadIdx.x >> 5);  // token * Hq + head
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(p.batch) * p.seq * p.q_heads) return;  // whole warp
  const int64_t t = row / p.q_heads;
  const int h = static_cast<int>(row % p.q_heads);
  const bf16* a = p.dout + t * p.q_stride + static_cast<int64_t>(h) * D;
  const bf16* c = p.out + t * p.q_stride + static_cast<int64_t>(h) * D;
  float acc = 0.f;
#pragma unroll
  for (int i = 2 * lane; i < D; i += 64) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a + i));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(c + i));
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t b = t / p.seq, s = t % p.seq;
    p.delta[(b * p.q_heads + h) * p.seq + s] = acc;
  }
}

// ---- backward 2: dK, dV -------------------------------------------------------------------

template <int D, int BQ>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(const Params p) {
  constexpr int LD = D + kPad, TK = kTile * LD, TQ = BQ * LD;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + TK;
  bf16* sQ = sV + TK;        // two buffers
  bf16* sdO = sQ + 2 * TQ;   // two buffers
  float* sLse = reinterpret_cast<float*>(sdO + 2 * TQ);  // two buffers of BQ: lse * log2(e)
  float* sDel = sLse + 2 * BQ;                           // two buffers of BQ: delta

  const int S = p.seq;
  const int kt = blockIdx.x, b = blockIdx.z;  // low kt (most query tiles) first
  const int g = blockIdx.y / p.splits, part = blockIdx.y % p.splits;
  const int heads = p.group / p.splits, h_begin = g * p.group + part * heads;
  const int k0 = kt * kTile;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;
  const int n_qt = (S + BQ - 1) / BQ;
  const int qt_begin = k0 / BQ;  // query tiles above it see none of these keys
  const int per_head = n_qt - qt_begin;
  const int n_it = heads * per_head;  // (head, query tile) pairs, head-major

  // Starts the copies of iteration it's Q, dO, lse and delta into buffer buf.
  auto issue = [&](int it, int buf) {
    const int h = h_begin + it / per_head;
    const int q0 = (qt_begin + it % per_head) * BQ;
    const int64_t qoff = (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
    load_tile<BQ, D>(sQ + buf * TQ, p.q + qoff, p.q_stride, min(BQ, S - q0));
    load_tile<BQ, D>(sdO + buf * TQ, p.dout + qoff, p.q_stride, min(BQ, S - q0));
    const int64_t soff = (static_cast<int64_t>(b) * p.q_heads + h) * S;
    for (int i = tid; i < BQ; i += kThreads) {
      const bool ok = q0 + i < S;
      sLse[buf * BQ + i] = ok ? p.lse[soff + q0 + i] * kLog2e : 0.f;
      sDel[buf * BQ + i] = ok ? p.delta[soff + q0 + i] : 0.f;
    }
  };

  const int64_t kvoff = (tok0 + k0) * p.kv_stride + static_cast<int64_t>(g) * D;
  load_tile<kTile, D>(sK, p.k + kvoff, p.kv_stride, min(kTile, S - k0));
  load_tile<kTile, D>(sV, p.v + kvoff, p.kv_stride, min(kTile, S - k0));
  issue(0, 0);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int j_lo = k0 + warp * 16 + gr, j_hi = j_lo + 8;  // this lane's two keys
  const int seg_lo = (seg && j_lo < S) ? seg[j_lo] : 0;
  const int seg_hi = (seg && j_hi < S) ? seg[j_hi] : 0;
  const uint32_t k_addr = smem_u32(sK) + 2 * (warp * 16 * LD + off.a);
  const uint32_t v_addr = smem_u32(sV) + 2 * (warp * 16 * LD + off.a);

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }

  for (int it = 0; it < n_it; ++it) {
    const int buf = it & 1;
    if (it + 1 < n_it) {
      issue(it + 1, buf ^ 1);
      cp_async_commit();
    }
    const int q0 = (qt_begin + it % per_head) * BQ;
    const uint32_t q_base = smem_u32(sQ + buf * TQ), do_base = smem_u32(sdO + buf * TQ);
    const float* lse_t = sLse + buf * BQ;
    const float* del_t = sDel + buf * BQ;

    // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x BQ queries
    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int i = 0; i < BQ / 8; ++i) {
      st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
      dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, k_addr + kc * 32);
      ldsm_x4(va, v_addr + kc * 32);
#pragma unroll
      for (int nb2 = 0; nb2 < BQ / 16; ++nb2) {
        uint32_t bf[4];
        ldsm_x4(bf, q_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
        mma_bf16(st[2 * nb2], ka, bf[0], bf[1]);
        mma_bf16(st[2 * nb2 + 1], ka, bf[2], bf[3]);
        ldsm_x4(bf, do_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
        mma_bf16(dpt[2 * nb2], va, bf[0], bf[1]);
        mma_bf16(dpt[2 * nb2 + 1], va, bf[2], bf[3]);
      }
    }

    // P^T = exp(scale s - lse) (0 where masked), dS^T = P^T (dP^T - delta)
    const bool need_mask = seg || q0 < k0 + kTile - 1 || q0 + BQ > S;
#pragma unroll
    for (int nb = 0; nb < BQ / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ci = nb * 8 + 2 * tq + (e & 1);  // query column within the tile
        bool ok = true;
        if (need_mask) {
          const int i = q0 + ci, j = e < 2 ? j_lo : j_hi;
          ok = i < S && j <= i && (!seg || seg[i] == (e < 2 ? seg_lo : seg_hi));
        }
        const float pv = ok ? exp2f(fmaf(st[nb][e], p.scale_log2, -lse_t[ci])) : 0.f;
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
      for (int db2 = 0; db2 < D / 16; ++db2) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, do_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
        mma_bf16(dv[2 * db2], pa, bf[0], bf[1]);
        mma_bf16(dv[2 * db2 + 1], pa, bf[2], bf[3]);
        ldsm_x4_trans(bf, q_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
        mma_bf16(dk[2 * db2], da, bf[0], bf[1]);
        mma_bf16(dk[2 * db2 + 1], da, bf[2], bf[3]);
      }
    }

    cp_async_wait_all();
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int j = i ? j_hi : j_lo;
    if (j < S) {
      const int64_t off_j = (tok0 + j) * p.kv_stride + static_cast<int64_t>(g) * D + 2 * tq;
      if (p.splits == 1) {
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
          *reinterpret_cast<uint32_t*>(p.dk + off_j + db * 8) =
              pack_bf16(dk[db][2 * i] * p.scale, dk[db][2 * i + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(p.dv + off_j + db * 8) = pack_bf16(dv[db][2 * i], dv[db][2 * i + 1]);
        }
      } else {
        const int64_t part_off = static_cast<int64_t>(part) * p.batch * S * p.kv_stride + off_j;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
          *reinterpret_cast<float2*>(p.dk_part + part_off + db * 8) = make_float2(dk[db][2 * i], dk[db][2 * i + 1]);
          *reinterpret_cast<float2*>(p.dv_part + part_off + db * 8) = make_float2(dv[db][2 * i], dv[db][2 * i + 1]);
        }
      }
    }
  }
}

// dK = scale * sum of the partial sums, dV = their sum, over the splits in order (two
// elements per thread, grid-stride).
__global__ void __launch_bounds__(256) attention_bwd_dkdv_reduce_kernel(const Params p) {
  const int64_t n2 = static_cast<int64_t>(p.batch) * p.seq * p.kv_stride / 2;  // kv_stride is even
  const int64_t part_stride = static_cast<int64_t>(p.batch) * p.seq * p.kv_stride;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n2;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float2 k = make_float2(0.f, 0.f), v = make_float2(0.f, 0.f);
    for (int s = 0; s < p.splits; ++s) {
      const float2 a = reinterpret_cast<const float2*>(p.dk_part + s * part_stride)[i];
      const float2 c = reinterpret_cast<const float2*>(p.dv_part + s * part_stride)[i];
      k.x += a.x;
      k.y += a.y;
      v.x += c.x;
      v.y += c.y;
    }
    reinterpret_cast<uint32_t*>(p.dk)[i] = pack_bf16(k.x * p.scale, k.y * p.scale);
    reinterpret_cast<uint32_t*>(p.dv)[i] = pack_bf16(v.x, v.y);
  }
}

// ---- backward 3: dQ -----------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const Params p) {
  constexpr int LD = D + kPad, TE = kTile * LD;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + TE;
  bf16* sK = sdO + TE;     // two buffers
  bf16* sV = sK + 2 * TE;  // two buffers

  const int S = p.seq;
  const int n_qt = (S + kTile - 1) / kTile;
  const int qt = n_qt - 1 - static_cast<int>(blockIdx.x);  // longest rows first
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.group;
  const int q0 = qt * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tq = lane & 3;
  const LaneOffsets<LD> off(lane);

  const int64_t tok0 = static_cast<int64_t>(b) * S;
  const int64_t qoff = (tok0 + q0) * p.q_stride + static_cast<int64_t>(h) * D;
  const bf16* gk = p.k + tok0 * p.kv_stride + static_cast<int64_t>(g) * D;
  const bf16* gv = p.v + tok0 * p.kv_stride + static_cast<int64_t>(g) * D;
  const int32_t* seg = p.seg ? p.seg + tok0 : nullptr;

  const int q_end = min(q0 + kTile, S);
  const int n_kt = (q_end - 1) / kTile + 1;

  load_tile<kTile, D>(sQ, p.q + qoff, p.q_stride, q_end - q0);
  load_tile<kTile, D>(sdO, p.dout + qoff, p.q_stride, q_end - q0);
  load_tile<kTile, D>(sK, gk, p.kv_stride, min(kTile, S));
  load_tile<kTile, D>(sV, gv, p.kv_stride, min(kTile, S));
  cp_async_commit();

  const int r_lo = q0 + warp * 16 + gr, r_hi = r_lo + 8;
  const int64_t soff = (static_cast<int64_t>(b) * p.q_heads + h) * S;
  const float lse2[2] = {r_lo < S ? p.lse[soff + r_lo] * kLog2e : 0.f, r_hi < S ? p.lse[soff + r_hi] * kLog2e : 0.f};
  const float del[2] = {r_lo < S ? p.delta[soff + r_lo] : 0.f, r_hi < S ? p.delta[soff + r_hi] : 0.f};
  const int seg_lo = (seg && r_lo < S) ? seg[r_lo] : 0;
  const int seg_hi = (seg && r_hi < S) ? seg[r_hi] : 0;
  const uint32_t q_addr = smem_u32(sQ) + 2 * (warp * 16 * LD + off.a);
  const uint32_t do_addr = smem_u32(sdO) + 2 * (warp * 16 * LD + off.a);

  cp_async_wait_all();
  __syncthreads();

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

  for (int kt = 0; kt < n_kt; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < n_kt) {
      const int k1 = (kt + 1) * kTile;
      load_tile<kTile, D>(sK + (buf ^ 1) * TE, gk + k1 * p.kv_stride, p.kv_stride, min(kTile, S - k1));
      load_tile<kTile, D>(sV + (buf ^ 1) * TE, gv + k1 * p.kv_stride, p.kv_stride, min(kTile, S - k1));
      cp_async_commit();
    }
    const uint32_t k_base = smem_u32(sK + buf * TE), v_base = smem_u32(sV + buf * TE);

    // s = Q K^T, dp = dO V^T for the warp's 16 rows x 64 keys
    float s[kTile / 8][4], dp[kTile / 8][4];
#pragma unroll
    for (int i = 0; i < kTile / 8; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      uint32_t qa[4], da[4];
      ldsm_x4(qa, q_addr + kc * 32);
      ldsm_x4(da, do_addr + kc * 32);
#pragma unroll
      for (int nb2 = 0; nb2 < kTile / 16; ++nb2) {
        uint32_t bf[4];
        ldsm_x4(bf, k_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
        mma_bf16(s[2 * nb2], qa, bf[0], bf[1]);
        mma_bf16(s[2 * nb2 + 1], qa, bf[2], bf[3]);
        ldsm_x4(bf, v_base + 2 * (nb2 * 16 * LD + kc * 16 + off.bn));
        mma_bf16(dp[2 * nb2], da, bf[0], bf[1]);
        mma_bf16(dp[2 * nb2 + 1], da, bf[2], bf[3]);
      }
    }

    // dS = P (dP - delta), P = exp(scale s - lse), 0 where masked (kept in dp)
    const int k0 = kt * kTile;
    const bool need_mask = seg || k0 + kTile - 1 > q0 + warp * 16 || k0 + kTile > S;
#pragma unroll
    for (int nb = 0; nb < kTile / 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1;
        bool ok = true;
        if (need_mask) {
          const int j = k0 + nb * 8 + 2 * tq + (e & 1);
          const int r = i ? r_hi : r_lo;
          ok = j <= r && j < S && (!seg || seg[j] == (i ? seg_hi : seg_lo));
        }
        const float pv = ok ? exp2f(fmaf(s[nb][e], p.scale_log2, -lse2[i])) : 0.f;
        dp[nb][e] = pv * (dp[nb][e] - del[i]);
      }
    }

    // dq += dS K
#pragma unroll
    for (int kc = 0; kc < kTile / 16; ++kc) {
      uint32_t a[4];
      acc_to_a(a, dp, kc);
#pragma unroll
      for (int db2 = 0; db2 < D / 16; ++db2) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, k_base + 2 * (kc * 16 * LD + db2 * 16 + off.bt));
        mma_bf16(dq[2 * db2], a, bf[0], bf[1]);
        mma_bf16(dq[2 * db2 + 1], a, bf[2], bf[3]);
      }
    }

    cp_async_wait_all();
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = i ? r_hi : r_lo;
    if (r < S) {
      bf16* gq = p.dq + (tok0 + r) * p.q_stride + static_cast<int64_t>(h) * D + 2 * tq;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        *reinterpret_cast<uint32_t*>(gq + db * 8) = pack_bf16(dq[db][2 * i] * p.scale, dq[db][2 * i + 1] * p.scale);
      }
    }
  }
}

// ---- launchers ------------------------------------------------------------------------

// The dK/dV kernel's query tile per head dim (fewer rows keep D = 128 within registers).
template <int D>
constexpr int kDkdvBlockQ = D == 128 ? 32 : 64;

Params make_params(const AttentionDims& d) {
  Params p{};
  p.batch = d.batch;
  p.seq = d.seq;
  p.q_heads = d.q_heads;
  p.kv_heads = d.kv_heads;
  p.group = d.q_heads / d.kv_heads;
  p.splits = 1;
  p.q_stride = static_cast<int64_t>(d.q_heads) * d.head_dim;
  p.kv_stride = static_cast<int64_t>(d.kv_heads) * d.head_dim;
  p.scale = d.scale;
  p.scale_log2 = static_cast<float>(static_cast<double>(d.scale) * 1.4426950408889634);
  return p;
}

// Launches kernel with `smem` bytes of dynamic shared memory (raising the limit past 48 KB;
// a failure shows up in the caller's check_launch).
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t s, const Params& p) {
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  }
  kernel<<<grid, threads, smem, s>>>(p);
}

template <int D>
void forward(const Params& p, cudaStream_t s) {
  constexpr size_t smem = 5 * kTile * (D + kPad) * sizeof(bf16);
  const dim3 grid((p.seq + kTile - 1) / kTile, p.q_heads, p.batch);
  launch(attention_fwd_kernel<D>, grid, kThreads, smem, s, p);
}

template <int D>
void backward(const Params& p, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.seq * p.q_heads;
  attention_bwd_delta_kernel<D>
      <<<static_cast<unsigned>((rows + kDeltaWarps - 1) / kDeltaWarps), kDeltaWarps * 32, 0, s>>>(p);

  constexpr int BQ = kDkdvBlockQ<D>;
  constexpr size_t smem_kv = (2 * kTile + 4 * BQ) * (D + kPad) * sizeof(bf16) + 4 * BQ * sizeof(float);
  const dim3 grid_kv((p.seq + kTile - 1) / kTile, p.kv_heads * p.splits, p.batch);
  launch(attention_bwd_dkdv_kernel<D, BQ>, grid_kv, kThreads, smem_kv, s, p);
  if (p.splits > 1) {
    const int64_t n2 = static_cast<int64_t>(p.batch) * p.seq * p.kv_stride / 2;
    const int64_t blocks = std::min<int64_t>((n2 + 255) / 256, 65536);
    attention_bwd_dkdv_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p);
  }

  constexpr size_t smem_q = 6 * kTile * (D + kPad) * sizeof(bf16);
  const dim3 grid_q((p.seq + kTile - 1) / kTile, p.q_heads, p.batch);
  launch(attention_bwd_dq_kernel<D>, grid_q, kThreads, smem_q, s, p);
}

}  // namespace

int attention_dkdv_splits(const AttentionDims& d, int num_sms) {
  const int group = d.q_heads / d.kv_heads;
  const int64_t blocks = static_cast<int64_t>((d.seq + kTile - 1) / kTile) * d.kv_heads * d.batch;
  int splits = 1;
  while (group % (2 * splits) == 0 && blocks * splits < 4 * static_cast<int64_t>(num_sms)) splits *= 2;
  return splits;
}

void launch_attention_forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const int32_t* seg, __nv_bfloat16* out, float* lse, const AttentionDims& d,
                              cudaStream_t s) {
  if (d.batch == 0 || d.seq == 0) return;
  Params p = make_params(d);
  p.q = q;
  p.k = k;
  p.v = v;
  p.seg = seg;
  p.o = out;
  p.lse_out = lse;
  switch (d.head_dim) {
    case 32: forward<32>(p, s); break;
    case 64: forward<64>(p, s); break;
    case 128: forward<128>(p, s); break;
    default: break;  // the host wrapper rejects other head dims
  }
}

void launch_attention_backward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const int32_t* seg, const __nv_bfloat16* out,
                               const float* lse, float* delta, float* dkdv_partial, int split_count,
                               __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const AttentionDims& d,
                               cudaStream_t s) {
  if (d.batch == 0 || d.seq == 0) return;
  Params p = make_params(d);
  p.splits = split_count;
  p.dk_part = split_count > 1 ? dkdv_partial : nullptr;
  p.dv_part = split_count > 1 ? dkdv_partial + static_cast<int64_t>(split_count) * d.batch * d.seq * d.kv_heads * d.head_dim : nullptr;
  p.dout = dout;
  p.q = q;
  p.k = k;
  p.v = v;
  p.seg = seg;
  p.out = out;
  p.lse = lse;
  p.delta = delta;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  switch (d.head_dim) {
    case 32: backward<32>(p, s); break;
    case 64: backward<64>(p, s); break;
    case 128: backward<128>(p, s); break;
    default: break;
  }
}

}  // namespace moetrain::ops::cuda
