// RMSNorm kernels, bf16 in and out, f32 inside.
//
// forward / backward_input: a row of D elements is handled by kTPR threads (half a warp
// when D <= 256 (per-head norms), a warp when D <= 1024, four warps when D <= 4096, else
// eight), 256 / kTPR rows per 256-thread block.
// The row sum goes through a warp shuffle tree and, across the row's warps, a fixed-order
// pass over shared memory: deterministic. Rows are read with 16-byte loads when D is a
// multiple of 8 and the pointers are aligned, else element by element; the second pass
// over the row re-reads it from L1/L2.
//
// backward_weight (dw += sum_r dy*x*rstd), deterministic, no atomics:
//   pass 1: grid (column tiles, nrb row chunks), block 32 x 8: thread (c, j) owns one
//           column, or two adjacent ones (bf16x2 loads) when D is even, and adds rows
//           r0+j, r0+j+8, ... of its chunk in order; the 8 row lanes are added in fixed
//           order through shared memory: partial[chunk][c] (f32);
//   pass 2: per column, 32 lanes each add every 32nd partial in chunk order (double), then
//           the lanes in order, into dw.
// nrb depends only on (R, D) (about 2048 blocks in pass 1, chunks of at least 64 rows).
#include "ops/cuda/fp8_device.cuh"
#include "ops/cuda/rmsnorm_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kBlock = 256;

// Sum of v over the kTPR threads of this row (threadIdx.y picks the row); one call a kernel.
template <int kTPR>
__device__ __forceinline__ float row_sum(float v) {
  if constexpr (kTPR <= 32) {  // the row is a whole warp or an aligned part of one
#pragma unroll
    for (int o = kTPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    v = warp_sum(v);
    constexpr int kRPB = kBlock / kTPR, kWarps = kTPR / 32;
    __shared__ float part[kRPB][kWarps];
    if ((threadIdx.x & 31) == 0) part[threadIdx.y][threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) s += part[threadIdx.y][k];
    return s;
  }
}

// y's 8 values f (as stored: rounded to bf16) quantized into their 1 x 128 tile, which the
// kFp8: y also quantized per 1 x 128 tile into q [R, D] and qscale [D / 128, R] (kVec, D a
// multiple of 128).
template <int kTPR, bool kVec, bool kFp8 = false>
__global__ void __launch_bounds__(kBlock) rmsnorm_forward_kernel(const bf16* __restrict__ x,
                                                                 const bf16* __restrict__ w, bf16* __restrict__ y,
                                                                 float* __restrict__ rstd, int64_t R, int64_t D,
                                                                 float eps, uint8_t* __restrict__ q = nullptr,
                                                                 float* __restrict__ qscale = nullptr) {
  constexpr int kRPB = kBlock / kTPR;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRPB + threadIdx.y;
  const bool valid = r < R;
  const bf16* xr = x + (valid ? r : 0) * D;
  float ss = 0.f;
  if (valid) {
    if constexpr (kVec) {
      for (int64_t v = threadIdx.x; v < D / 8; v += kTPR) {
        float f[8];
        load8(xr + v * 8, f);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
      }
    } else {
      for (int64_t i = threadIdx.x; i < D; i += kTPR) {
        const float f = to_float(xr[i]);
        ss += f * f;
      }
    }
  }
  ss = row_sum<kTPR>(ss);
  if (!valid) return;
  const float rs = 1.f / sqrtf(ss / static_cast<float>(D) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  bf16* yr = y + r * D;
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < D / 8; v += kTPR) {
      float f[8], g[8];
      load8(xr + v * 8, f);
      load8(w + v * 8, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * rs * g[k];
      store8(yr + v * 8, f);
      if constexpr (kFp8) fp8::quantize_half_warp_tile(f, q + r * D + v * 8, qscale + (v / 16) * R + r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += kTPR) yr[i] = __float2bfloat16(to_float(xr[i]) * rs * to_float(w[i]));
  }
}

template <int kTPR, bool kVec>
__global__ void __launch_bounds__(kBlock) rmsnorm_backward_input_kernel(const bf16* __restrict__ dy,
                                                                        const bf16* __restrict__ x,
                                                                        const bf16* __restrict__ w,
                                                                        const float* __restrict__ rstd,
                                                                        const bf16* __restrict__ residual,
                                                                        bf16* __restrict__ dx, int64_t R, int64_t D) {
  constexpr int kRPB = kBlock / kTPR;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRPB + threadIdx.y;
  const bool valid = r < R;
  const int64_t off = (valid ? r : 0) * D;
  const bf16 *xr = x + off, *gr = dy + off;
  float dot = 0.f;  // sum_i w dy x
  if (valid) {
    if constexpr (kVec) {
      for (int64_t v = threadIdx.x; v < D / 8; v += kTPR) {
        float a[8], b[8], c[8];
        load8(xr + v * 8, a);
        load8(gr + v * 8, b);
        load8(w + v * 8, c);
#pragma unroll
        for (int k = 0; k < 8; ++k) dot += c[k] * b[k] * a[k];
      }
    } else {
      for (int64_t i = threadIdx.x; i < D; i += kTPR) dot += to_float(w[i]) * to_float(gr[i]) * to_float(xr[i]);
    }
  }
  dot = row_sum<kTPR>(dot);
  if (!valid) return;
  const float s = rstd[r];
  const float c = s * s * dot / static_cast<float>(D);
  bf16* out = dx + off;
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < D / 8; v += kTPR) {
      float a[8], b[8], g[8], e[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      load8(xr + v * 8, a);
      load8(gr + v * 8, b);
      load8(w + v * 8, g);
      if (residual) load8(residual + off + v * 8, e);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = s * (g[k] * b[k] - a[k] * c) + e[k];
      store8(out + v * 8, a);
    }
  } else {
    for (int64_t i = threadIdx.x; i < D; i += kTPR) {
      const float extra = residual ? to_float(residual[off + i]) : 0.f;
      out[i] = __float2bfloat16(s * (to_float(w[i]) * to_float(gr[i]) - to_float(xr[i]) * c) + extra);
    }
  }
}

// With q (the caller has checked that the 16-byte path runs and D is whole tiles), y is
// quantized too.
template <int kTPR, bool kVec>
void launch_rows_forward(const bf16* x, const bf16* w, bf16* y, float* rstd, int64_t R, int64_t D, float eps,
                         uint8_t* q, float* qscale, cudaStream_t s) {
  constexpr int kRPB = kBlock / kTPR;
  const dim3 block(kTPR, kRPB);
  const auto grid = static_cast<unsigned>((R + kRPB - 1) / kRPB);
  if constexpr (kVec) {
    if (q) {
      rmsnorm_forward_kernel<kTPR, true, true><<<grid, block, 0, s>>>(x, w, y, rstd, R, D, eps, q, qscale);
      return;
    }
  }
  rmsnorm_forward_kernel<kTPR, kVec><<<grid, block, 0, s>>>(x, w, y, rstd, R, D, eps);
}

template <int kTPR, bool kVec>
void launch_rows_backward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd, const bf16* residual,
                          bf16* dx, int64_t R, int64_t D, cudaStream_t s) {
  constexpr int kRPB = kBlock / kTPR;
  const dim3 block(kTPR, kRPB);
  const auto grid = static_cast<unsigned>((R + kRPB - 1) / kRPB);
  rmsnorm_backward_input_kernel<kTPR, kVec><<<grid, block, 0, s>>>(dy, x, w, rstd, residual, dx, R, D);
}

// Calls f.template operator()<kTPR, kVec>() with the row width picked for D.
template <typename F>
void with_row_shape(int64_t D, bool vec, F&& f) {
  if (D <= 256) {
    vec ? f.template operator()<16, true>() : f.template operator()<16, false>();
  } else if (D <= 1024) {
    vec ? f.template operator()<32, true>() : f.template operator()<32, false>();
  } else if (D <= 4096) {
    vec ? f.template operator()<128, true>() : f.template operator()<128, false>();
  } else {
    vec ? f.template operator()<256, true>() : f.template operator()<256, false>();
  }
}

// ---- weight gradient ----
constexpr int kColTile = 32, kRowLanes = 8;

struct DwSplit {
  int64_t chunks, rows_per_chunk;
};
DwSplit dw_split(int64_t R, int64_t D) {
  const int64_t col_tiles = (D + kColTile - 1) / kColTile;
  int64_t chunks = (2048 + col_tiles - 1) / col_tiles;
  const int64_t max_chunks = (R + 63) / 64;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks < 1) chunks = 1;
  const int64_t rows_per = (R + chunks - 1) / chunks;
  return {rows_per > 0 ? (R + rows_per - 1) / rows_per : 1, rows_per > 0 ? rows_per : 1};
}

// kCols = 2: each thread owns two adjacent columns (bf16x2 loads; D even, 4-byte aligned).
template <int kCols>
__global__ void __launch_bounds__(kColTile* kRowLanes) rmsnorm_dw_pass1(const bf16* __restrict__ dy,
                                                                       const bf16* __restrict__ x,
                                                                       const float* __restrict__ rstd,
                                                                       float* __restrict__ partial, int64_t R,
                                                                       int64_t D, int64_t rows_per) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x) * kCols;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per;
  const int64_t r1 = r0 + rows_per < R ? r0 + rows_per : R;
  float acc[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) acc[k] = 0.f;
  if (c < D) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const float s = rstd[r];
      if constexpr (kCols == 2) {
        const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dy + r * D + c));
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + r * D + c));
        acc[0] += g.x * v.x * s;
        acc[1] += g.y * v.y * s;
      } else {
        acc[0] += to_float(dy[r * D + c]) * to_float(x[r * D + c]) * s;
      }
    }
  }
  __shared__ float lanes[kRowLanes][kColTile * kCols + 1];
#pragma unroll
  for (int k = 0; k < kCols; ++k) lanes[threadIdx.y][threadIdx.x * kCols + k] = acc[k];
  __syncthreads();
  // Row lane 0 of the block finishes the tile's columns, lanes added in fixed order.
  for (int j = threadIdx.y * kColTile + threadIdx.x; j < kColTile * kCols; j += kColTile * kRowLanes) {
    const int64_t col = static_cast<int64_t>(blockIdx.x) * kColTile * kCols + j;
    if (col < D) {
      float t = 0.f;
#pragma unroll
      for (int k = 0; k < kRowLanes; ++k) t += lanes[k][j];
      partial[blockIdx.y * D + col] = t;
    }
  }
}

// Block (32 columns, kPass2Lanes chunk lanes): lane y adds chunks y, y + kPass2Lanes, ... of
// its column in order, then the lanes are added in fixed order. A thread per column adding
// every chunk took ~50 us for the per-head norms (D = 128: 512 chunks, one block).
constexpr int kPass2Lanes = 32;
// Chunks [first, last) of column c summed as above; the result is meant for row lane 0
// (threadIdx.y == 0). Every thread of the block calls it.
__device__ __forceinline__ double sum_chunks(const float* __restrict__ partial, int64_t D, int64_t c, int64_t first,
                                             int64_t last) {
  double t = 0.0;
  if (c < D) {
    for (int64_t b = first + threadIdx.y; b < last; b += kPass2Lanes) t += static_cast<double>(partial[b * D + c]);
  }
  __shared__ double lanes[kPass2Lanes][kColTile];
  lanes[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  double sum = 0.0;
  if (threadIdx.y == 0) {
#pragma unroll 8
    for (int k = 0; k < kPass2Lanes; ++k) sum += lanes[k][threadIdx.x];
  }
  return sum;
}

__global__ void __launch_bounds__(kColTile* kPass2Lanes) rmsnorm_dw_pass2(const float* __restrict__ partial,
                                                                         float* __restrict__ dw, int64_t D,
                                                                         int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const double sum = sum_chunks(partial, D, c, 0, chunks);
  if (threadIdx.y != 0 || c >= D) return;
  dw[c] = static_cast<float>(static_cast<double>(dw[c]) + sum);
}

// Many chunks (the per-head norms of q: one per 16 rows, 16,384 at the bench shape) are first
// summed in groups of kGroupChunks by rmsnorm_dw_groups, a block per (column tile, group),
// into f32 partials of the groups that rmsnorm_dw_pass2 then adds: with only D / 32 blocks
// for every chunk, pass 2 took 45 us for q's norm.
constexpr int64_t kGroupChunks = 512;
__global__ void __launch_bounds__(kColTile* kPass2Lanes) rmsnorm_dw_groups(const float* __restrict__ partial,
                                                                          float* __restrict__ groups, int64_t D,
                                                                          int64_t chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * kGroupChunks;
  const double sum = sum_chunks(partial, D, c, b0, b0 + kGroupChunks < chunks ? b0 + kGroupChunks : chunks);
  if (threadIdx.y != 0 || c >= D) return;
  groups[blockIdx.y * D + c] = static_cast<float>(sum);
}

// ---- per-head norm + RoPE, head_dim 128 ----
// A row is one head of one token: 16 threads, 8 elements each (thread v holds 8v..8v+7),
// 16 rows a 256-thread block. RoPE pairs element i with i + 64, which thread v ^ 8 holds:
// one shuffle. The angles by rope.cu's rule (rope_cos_sin), once per token and block, so
// the rotation equals rope_forward's applied to the unrounded normalised value. Rows past R
// compute on zeros: every lane reaches every shuffle.
constexpr int kRopeHd = 128, kRopeTPR = 16, kRopeRows = kBlock / kRopeTPR;

// cos and sin of the block's tokens' angles, each formed once for the block: rows r0 ..
// r0 + 15 belong to tokens r0 / heads .. (r0 + 15) / heads, at most 16 of them (one for a
// 32-head q: 64 angles for 16 rows). Every thread of the block calls it.
struct RopeTable {
  float c[kRopeRows][kRopeHd / 2], s[kRopeRows][kRopeHd / 2];
};
__device__ __forceinline__ void fill_rope_table(RopeTable& tab, const int32_t* __restrict__ positions, int64_t r0,
                                                int64_t R, int64_t heads, float theta) {
  constexpr int kHalf = kRopeHd / 2;
  const int64_t t0 = r0 / heads, last = (r0 + kRopeRows < R ? r0 + kRopeRows : R) - 1;
  const int n = static_cast<int>(last / heads - t0 + 1) * kHalf;
  for (int e = threadIdx.y * kRopeTPR + threadIdx.x; e < n; e += kBlock) {
    const int tl = e / kHalf, i = e % kHalf;
    rope_cos_sin(static_cast<float>(positions[t0 + tl]), i, kRopeHd, theta, &tab.c[tl][i], &tab.s[tl][i]);
  }
  __syncthreads();
}

// This thread's 8 angles (elements 8v..8v+7 of row r; element i and i + 64 share one).
__device__ __forceinline__ void row_angles(const RopeTable& tab, int64_t r, int64_t r0, int64_t heads, bool valid,
                                           float c[8], float s[8]) {
  const int tl = valid ? static_cast<int>(r / heads - r0 / heads) : 0;
  const int i0 = 8 * (threadIdx.x & (kRopeTPR / 2 - 1));
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    c[k] = tab.c[tl][i0 + k];
    s[k] = tab.s[tl][i0 + k];
  }
}

__global__ void __launch_bounds__(kBlock) rmsnorm_rope_forward_kernel(const bf16* __restrict__ x,
                                                                      const bf16* __restrict__ w,
                                                                      const int32_t* __restrict__ positions,
                                                                      bf16* __restrict__ y, float* __restrict__ rstd,
                                                                      int64_t R, int64_t heads, float eps,
                                                                      float theta) {
  __shared__ RopeTable tab;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRopeRows, r = r0 + threadIdx.y;
  const bool valid = r < R;
  const int v = threadIdx.x;
  fill_rope_table(tab, positions, r0, R, heads, theta);
  float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, g[8], c[8], sn[8];
  if (valid) load8(x + r * kRopeHd + v * 8, f);
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
  ss = row_sum<kRopeTPR>(ss);
  const float rs = 1.f / sqrtf(ss / static_cast<float>(kRopeHd) + eps);
  load8(w + v * 8, g);
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = f[k] * rs * g[k];
  // (a, b) -> (a cos - b sin, b cos + a sin): the first half takes -partner * sin.
  const float sign = v < kRopeTPR / 2 ? -1.f : 1.f;
  row_angles(tab, r, r0, heads, valid, c, sn);
  float out[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float p = __shfl_xor_sync(0xffffffffu, f[k], kRopeTPR / 2);
    out[k] = f[k] * c[k] + sign * p * sn[k];
  }
  if (!valid) return;
  if (v == 0) rstd[r] = rs;
  store8(y + r * kRopeHd + v * 8, out);
}

// dn = rope_backward(dy) in registers; dx = rstd * (w*dn - x * rstd^2 * mean(w*dn*x)); and
// this block's 16 rows of dn * x * rstd summed per column in row order into partial[block]
// (rmsnorm_dw_pass2 adds the blocks in order: deterministic).
template <typename DY>
__global__ void __launch_bounds__(kBlock) rmsnorm_rope_backward_kernel(
    const DY* __restrict__ dy, const bf16* __restrict__ x, const bf16* __restrict__ w,
    const float* __restrict__ rstd, const int32_t* __restrict__ positions, bf16* __restrict__ dx,
    float* __restrict__ partial, int64_t R, int64_t heads, float theta) {
  __shared__ RopeTable tab;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRopeRows, r = r0 + threadIdx.y;
  const bool valid = r < R;
  const int v = threadIdx.x;
  fill_rope_table(tab, positions, r0, R, heads, theta);
  float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float g[8], c[8], sn[8], dn[8];
  if (valid) {
    load8(x + r * kRopeHd + v * 8, a);
    load8(dy + r * kRopeHd + v * 8, b);
  }
  load8(w + v * 8, g);
  // The inverse rotation: (a, b) -> (a cos + b sin, b cos - a sin).
  const float sign = v < kRopeTPR / 2 ? 1.f : -1.f;
  row_angles(tab, r, r0, heads, valid, c, sn);
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float p = __shfl_xor_sync(0xffffffffu, b[k], kRopeTPR / 2);
    dn[k] = b[k] * c[k] + sign * p * sn[k];
    dot += g[k] * dn[k] * a[k];
  }
  dot = row_sum<kRopeTPR>(dot);
  const float s = valid ? rstd[r] : 0.f;
  const float cc = s * s * dot / static_cast<float>(kRopeHd);
  float out[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = s * (g[k] * dn[k] - a[k] * cc);
  if (valid) store8(dx + r * kRopeHd + v * 8, out);
  __shared__ float rows[kRopeRows][kRopeHd + 1];
#pragma unroll
  for (int k = 0; k < 8; ++k) rows[threadIdx.y][v * 8 + k] = dn[k] * a[k] * s;  // zero past R
  __syncthreads();
  const int col = threadIdx.y * kRopeTPR + threadIdx.x;
  if (col < kRopeHd) {
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < kRopeRows; ++q) t += rows[q][col];
    partial[static_cast<int64_t>(blockIdx.x) * kRopeHd + col] = t;
  }
}

}  // namespace

bool rmsnorm_rope_fusable(const bf16* x, const bf16* w, const bf16* y, int64_t D, int64_t head_dim) {
  return D == kRopeHd && head_dim == kRopeHd && aligned16(x) && aligned16(w) && aligned16(y);
}

int64_t rmsnorm_rope_backward_scratch_floats(int64_t R) {
  const int64_t chunks = (R + kRopeRows - 1) / kRopeRows;
  return (chunks + (chunks + kGroupChunks - 1) / kGroupChunks) * kRopeHd;  // the chunks', then the groups' partials
}

void launch_rmsnorm_rope_forward(const bf16* x, const bf16* w, const int32_t* positions, bf16* y, float* rstd,
                                 int64_t R, int64_t heads, float eps, float theta, cudaStream_t s) {
  if (R == 0) return;
  const auto grid = static_cast<unsigned>((R + kRopeRows - 1) / kRopeRows);
  rmsnorm_rope_forward_kernel<<<grid, dim3(kRopeTPR, kRopeRows), 0, s>>>(x, w, positions, y, rstd, R, heads, eps,
                                                                        theta);
}

template <typename DY>
void rope_backward_passes(const DY* dy, const bf16* x, const bf16* w, const float* rstd,
                                  const int32_t* positions, bf16* dx, float* dw, int64_t R, int64_t heads, float theta,
                                  float* scratch, cudaStream_t s) {
  if (R == 0) return;
  const int64_t blocks = (R + kRopeRows - 1) / kRopeRows;
  rmsnorm_rope_backward_kernel<DY><<<static_cast<unsigned>(blocks), dim3(kRopeTPR, kRopeRows), 0, s>>>(
      dy, x, w, rstd, positions, dx, scratch, R, heads, theta);
  const unsigned col_tiles = kRopeHd / kColTile;
  if (blocks <= kGroupChunks) {
    rmsnorm_dw_pass2<<<col_tiles, dim3(kColTile, kPass2Lanes), 0, s>>>(scratch, dw, kRopeHd, blocks);
    return;
  }
  const int64_t groups = (blocks + kGroupChunks - 1) / kGroupChunks;
  float* group_partial = scratch + blocks * kRopeHd;
  rmsnorm_dw_groups<<<dim3(col_tiles, static_cast<unsigned>(groups)), dim3(kColTile, kPass2Lanes), 0, s>>>(
      scratch, group_partial, kRopeHd, blocks);
  rmsnorm_dw_pass2<<<col_tiles, dim3(kColTile, kPass2Lanes), 0, s>>>(group_partial, dw, kRopeHd, groups);
}

void launch_rmsnorm_rope_backward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                                  const int32_t* positions, bf16* dx, float* dw, int64_t R, int64_t heads, float theta,
                                  float* scratch, cudaStream_t s) {
  rope_backward_passes(dy, x, w, rstd, positions, dx, dw, R, heads, theta, scratch, s);
}
void launch_rmsnorm_rope_backward(const float* dy, const bf16* x, const bf16* w, const float* rstd,
                                  const int32_t* positions, bf16* dx, float* dw, int64_t R, int64_t heads, float theta,
                                  float* scratch, cudaStream_t s) {
  rope_backward_passes(dy, x, w, rstd, positions, dx, dw, R, heads, theta, scratch, s);
}

bool launch_rmsnorm_forward(const bf16* x, const bf16* w, bf16* y, float* rstd, int64_t R, int64_t D, float eps,
                            cudaStream_t s, uint8_t* q, float* qscale) {
  const bool vec = D % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  // The fused quantization: 16-byte rows of whole 1 x 128 tiles, 8-byte code stores.
  if (q && !(vec && D % 128 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0)) {
    q = nullptr;
    qscale = nullptr;
  }
  if (R > 0) {
    with_row_shape(D, vec, [&]<int kTPR, bool kVec>() {
      launch_rows_forward<kTPR, kVec>(x, w, y, rstd, R, D, eps, q, qscale, s);
    });
  }
  return q != nullptr;
}

void launch_rmsnorm_backward_input(const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                                   const bf16* residual, bf16* dx, int64_t R, int64_t D, cudaStream_t s) {
  if (R == 0) return;
  const bool vec = D % 8 == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx) &&
                   (!residual || aligned16(residual));
  with_row_shape(D, vec, [&]<int kTPR, bool kVec>() {
    launch_rows_backward<kTPR, kVec>(dy, x, w, rstd, residual, dx, R, D, s);
  });
}

int64_t rmsnorm_backward_weight_scratch_floats(int64_t R, int64_t D) { return dw_split(R, D).chunks * D; }

void launch_rmsnorm_backward_weight(const bf16* dy, const bf16* x, const float* rstd, float* dw, int64_t R,
                                    int64_t D, float* scratch, cudaStream_t s) {
  if (R == 0 || D == 0) return;
  const DwSplit sp = dw_split(R, D);
  const bool pairs = D % 2 == 0 && reinterpret_cast<uintptr_t>(dy) % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0;
  const int64_t tile = kColTile * (pairs ? 2 : 1);
  const dim3 grid1(static_cast<unsigned>((D + tile - 1) / tile), static_cast<unsigned>(sp.chunks));
  if (pairs) {
    rmsnorm_dw_pass1<2><<<grid1, dim3(kColTile, kRowLanes), 0, s>>>(dy, x, rstd, scratch, R, D, sp.rows_per_chunk);
  } else {
    rmsnorm_dw_pass1<1><<<grid1, dim3(kColTile, kRowLanes), 0, s>>>(dy, x, rstd, scratch, R, D, sp.rows_per_chunk);
  }
  rmsnorm_dw_pass2<<<static_cast<unsigned>((D + kColTile - 1) / kColTile), dim3(kColTile, kPass2Lanes), 0, s>>>(
      scratch, dw, D, sp.chunks);
}

}  // namespace moetrain::ops::cuda
