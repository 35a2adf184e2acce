// FP8 (e4m3) block quantization kernels (ops.h): the same bits as the CPU reference
// (ops/cpu/fp8.cpp): the tile's amax, scale = amax / 448 (IEEE division; 1 for a zero tile),
// q = cvt.rn.satfinite.e4m3(x / scale).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "ops/cuda/fp8_device.cuh"
#include "ops/cuda/fp8_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

constexpr int kBlock = 128;

__device__ __forceinline__ float load(const void* x, int elem_bytes, int64_t i) {
  return elem_bytes == 2 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]) : static_cast<const float*>(x)[i];
}
using fp8::tile_scale;
using fp8::to_e4m3;

// One warp per (row, 128-column tile): 4 elements a lane, coalesced.
__global__ void quantize_rows_kernel(const void* __restrict__ x, int elem_bytes, int64_t R, int64_t C,
                                     uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= R * L) return;
  const int64_t r = warp / L, kb = warp % L, c0 = kb * kBlock;
  float v[4], amax = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = c0 + lane + 32 * j;
    v[j] = c < C ? load(x, elem_bytes, r * C + c) : 0.f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = tile_scale(amax);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = c0 + lane + 32 * j;
    if (c < C) q[r * C + c] = to_e4m3(v[j] / s);
  }
  if (lane == 0) scale[kb * R + r] = s;
}

// Rows mode for bf16 rows whose length is a multiple of 8: 16 threads per 1 x 128 tile, each
// loading 8 elements (16 bytes) and storing 8 codes at once (the scalar kernel above reads
// 256 bytes a warp: too little in flight to approach HBM's rate). Same arithmetic, same bits.
// Faster than quantize_tiles_kernel in rows mode (H100, 8192 x 2048: 30.5 against 38.3 us):
// a tile needs no more than its 16 threads, so blocks retire sooner and no thread holds 64.
__global__ void quantize_rows_bf16x8_kernel(const __nv_bfloat16* __restrict__ x, int64_t R, int64_t C,
                                            uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  const int64_t tile = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const bool live = tile < R * L;
  const int64_t r = live ? tile / L : 0, kb = live ? tile % L : 0;
  const int64_t c = kb * kBlock + 8 * (threadIdx.x & 15);
  const bool has = live && c < C;  // C % 8 == 0: a thread's 8 are all in or all out
  float v[8] = {};
  if (has) load8(x + r * C + c, v);
  const float amax = fp8::half_warp_amax(v);  // a tile is an aligned half-warp, all of it here
  if (has) fp8::store_half_warp_codes(v, tile_scale(amax), q + r * C + c, scale + kb * R + r);
}

// One 256-thread block per 128 x 128 block of x; kTransposed: the codes go to x^T [C, R] and
// the scale to block (cb, rb) of x^T's grid.
template <bool kTransposed>
__global__ void quantize_blocks_kernel(const void* __restrict__ x, int elem_bytes, int64_t R, int64_t C,
                                       uint8_t* __restrict__ q, float* __restrict__ scale, int64_t scale_cols) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  const int64_t rb = blockIdx.x / L, kb = blockIdx.x % L;
  const int64_t r0 = rb * kBlock, c0 = kb * kBlock;
  const int tid = threadIdx.x;
  const int col = tid & 127, half = tid >> 7;  // each thread: column col, rows half, half + 2, ...
  float amax = 0.f;
  for (int i = half; i < kBlock; i += 2) {
    const int64_t r = r0 + i, c = c0 + col;
    if (r < R && c < C) amax = fmaxf(amax, fabsf(load(x, elem_bytes, r * C + c)));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[8];
  if ((tid & 31) == 0) warp_max[tid >> 5] = amax;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) m = fmaxf(m, warp_max[w]);
  const float s = tile_scale(m);
  for (int i = half; i < kBlock; i += 2) {
    const int64_t r = r0 + i, c = c0 + col;
    if (r < R && c < C) q[kTransposed ? c * R + r : r * C + c] = to_e4m3(load(x, elem_bytes, r * C + c) / s);
  }
  if (tid == 0) scale[kTransposed ? kb * scale_cols + rb : rb * scale_cols + kb] = s;
}

// The one-pass kernels' loads: rows r0 .. r0 + 7 of x [R, C] at columns c .. c + 7 (16 bytes a
// row for bf16, all eight issued before any is used), zeros past R or where the columns are
// past C (cols_in false).
template <typename T>
__device__ __forceinline__ void load_rows8(const T* __restrict__ x, int64_t R, int64_t C, int64_t r0, int64_t c,
                                           bool cols_in, float (&v)[8][8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (cols_in && r0 + j < R) {
      load8(x + (r0 + j) * C + c, v[j]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[j][i] = 0.f;
    }
  }
}

// A thread's column codes stored 16 bytes at a time: col_codes[i] holds column c + i's codes
// of the thread's 8 rows, and lanes t < 16 of a warp hold rows 8 g .. + 7 (g even) while
// lanes t + 16 hold the next 8. A shuffle swaps half the words between the two, so that the
// low lane holds columns c .. c + 3 and the high lane columns c + 4 .. c + 7, each as its 16
// rows' codes (the low lane's first); store(i, word) writes column c + i's. Every lane of
// the warp must call it.
template <typename Store>
__device__ __forceinline__ void store_column_pairs(const uint2 (&col_codes)[8], bool low, Store store) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint2 mine = low ? col_codes[i] : col_codes[i + 4], give = low ? col_codes[i + 4] : col_codes[i];
    uint2 got;
    got.x = __shfl_xor_sync(0xffffffffu, give.x, 16);
    got.y = __shfl_xor_sync(0xffffffffu, give.y, 16);
    store(low ? i : i + 4, low ? make_uint4(mine.x, mine.y, got.x, got.y) : make_uint4(got.x, got.y, mine.x, mine.y));
  }
}

// Blocks mode at HBM's rate (the weights' quantization, once a training step: 2.4 G expert
// weights in the bench model, which quantize_blocks_kernel above took 11 ms and the
// transpose of its codes 4.6 ms more to go through). A 256-thread block per 128 x 128 block of
// x [R, C] (C % 8 == 0, x 16-byte aligned), read once into registers: thread t holds
// columns 8 (t % 16) .. + 7 of rows 8 (t / 16) .. + 7, loaded 16 bytes at a time (bf16; two
// loads for f32), so a warp reads two whole 256-byte rows an instruction. kDirect: the codes
// of each row's 8 columns stored as 8 bytes (a warp: two whole 128-byte rows of codes).
// kTransposed: the block also (or only) written transposed, as the block (cb, rb) of each
// expert's W^T: x is E experts' [n, C] stacked (E = R / n; n = R for a plain matrix), and
// W_e^T [C, n] is row e C + c of qt; the 8 codes of a column in a thread's 8 rows make one
// 8-byte word, paired by a shuffle with the word of the next 8 rows (lane t ^ 16) into
// 16-byte stores (n % 16 == 0; a block never spans two experts: n % 128 == 0 where E > 1).
// Scales: scale[rb * scale_cols + cb], st[(e Lc + cb) * st_cols + rb_e]. Same arithmetic as
// quantize_blocks_kernel, same bits.
template <typename T, bool kDirect, bool kTransposed>
__global__ void __launch_bounds__(256)
    quantize_blocks_vec_kernel(const T* __restrict__ x, int64_t R, int64_t C, int64_t n, uint8_t* __restrict__ q,
                               float* __restrict__ scale, int64_t scale_cols, uint8_t* __restrict__ qt,
                               float* __restrict__ st, int64_t st_cols) {
  const int64_t Lc = (C + kBlock - 1) / kBlock;
  const int64_t rb = blockIdx.x / Lc, cb = blockIdx.x % Lc;
  const int64_t r0 = rb * kBlock + 8 * (threadIdx.x >> 4), c = cb * kBlock + 8 * (threadIdx.x & 15);
  const bool cols_in = c < C;  // C % 8 == 0: a thread's 8 columns are all in or all out
  float v[8][8];
  load_rows8(x, R, C, r0, c, cols_in, v);
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[8];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < 8; ++w) m = fmaxf(m, warp_max[w]);
  const float s = tile_scale(m);
  uint2 row_codes[8], col_codes[8];  // [j]: row r0 + j's 8 columns; [i]: column c + i's 8 rows
#pragma unroll
  for (int k = 0; k < 8; ++k) row_codes[k] = col_codes[k] = make_uint2(0, 0);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t b = to_e4m3(v[j][i] / s);
      (i < 4 ? row_codes[j].x : row_codes[j].y) |= b << (8 * (i & 3));
      (j < 4 ? col_codes[i].x : col_codes[i].y) |= b << (8 * (j & 3));
    }
  }
  if constexpr (kDirect) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (cols_in && r0 + j < R) *reinterpret_cast<uint2*>(q + (r0 + j) * C + c) = row_codes[j];
    }
    if (threadIdx.x == 0) scale[rb * scale_cols + cb] = s;
  }
  if constexpr (kTransposed) {
    const bool low = (threadIdx.x & 16) == 0;
    const int64_t e = (rb * kBlock) / n, rb_e = rb - e * (n / kBlock);
    const int64_t row_in_e = r0 - e * n - (low ? 0 : 8);  // the 16 rows' first, within expert e
    store_column_pairs(col_codes, low, [&](int i, const uint4& word) {
      if (cols_in && row_in_e < n && e * n + row_in_e < R) {
        *reinterpret_cast<uint4*>(qt + (e * C + c + i) * n + row_in_e) = word;
      }
    });
    if (threadIdx.x == 0) st[(e * Lc + cb) * st_cols + rb_e] = s;
  }
}

// x [R, C] per 1 x 128 tile along the features (kRows: q [R, C], scale[kb * R + r]), along
// the tokens (kTokens: x^T's codes qt [C, R], st[rb * C + c]), or both in one pass
// (ops::quantize_fp8_both_ways: an output gradient, which the input gradient reads along the
// features and the weight gradient along the tokens, read once instead of twice).
// quantize_blocks_vec_kernel's block and layout (a 256-thread block per 128 x 128 of x,
// thread t holding columns c = 8 (t % 16) .. + 7 of rows 8 (t / 16) .. + 7, eight 16-byte
// loads in flight a thread; C % 8 == 0, x 16-byte aligned, and R % 16 == 0 for kTokens); a
// row's amax meets over the 16 lanes of a half-warp, a column's over the lane pair t, t ^ 16
// and then the 8 warps in shared memory; a row's codes go as one 8-byte store, a column's as
// 16-byte stores (store_column_pairs). With both, each element is quantized twice (its row's
// scale and its column's), so the quotients take ScaleDivisor's three instructions rather
// than a division's subroutine (the same bits; one path for the three kernels).
template <typename T, bool kRows, bool kTokens>
__global__ void __launch_bounds__(256)
    quantize_tiles_kernel(const T* __restrict__ x, int64_t R, int64_t C, uint8_t* __restrict__ q,
                          float* __restrict__ scale, uint8_t* __restrict__ qt, float* __restrict__ st) {
  const int64_t Lc = (C + kBlock - 1) / kBlock;
  const int64_t rb = blockIdx.x / Lc, kb = blockIdx.x % Lc;
  const int tid = threadIdx.x, cc = tid & 15, lane = tid & 31, warp = tid >> 5;
  const int64_t r0 = rb * kBlock + 8 * (tid >> 4), c = kb * kBlock + 8 * cc;
  const bool cols_in = c < C;  // C % 8 == 0: a thread's 8 columns are all in or all out
  float v[8][8];
  load_rows8(x, R, C, r0, c, cols_in, v);
  if constexpr (kRows) {  // row r0 + j's 8 codes at once
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const fp8::ScaleDivisor d(tile_scale(amax));
      uint2 word = make_uint2(0, 0);
#pragma unroll
      for (int i = 0; i < 8; ++i) (i < 4 ? word.x : word.y) |= static_cast<uint32_t>(d.code(v[j][i])) << (8 * (i & 3));
      if (cols_in && r0 + j < R) {
        *reinterpret_cast<uint2*>(q + (r0 + j) * C + c) = word;
        if (cc == 0) scale[kb * R + r0 + j] = d.s;
      }
    }
  }
  if constexpr (kTokens) {  // column c + i's 8 codes of this thread's rows as one word
    float col_max[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      col_max[i] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) col_max[i] = fmaxf(col_max[i], fabsf(v[j][i]));
    }
    __shared__ float warp_col_max[8][kBlock];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      col_max[i] = fmaxf(col_max[i], __shfl_xor_sync(0xffffffffu, col_max[i], 16));
      if (lane < 16) warp_col_max[warp][8 * cc + i] = col_max[i];
    }
    __syncthreads();
    uint2 col_codes[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float m = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) m = fmaxf(m, warp_col_max[w][8 * cc + i]);
      const fp8::ScaleDivisor d(tile_scale(m));
      col_codes[i] = make_uint2(0, 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        (j < 4 ? col_codes[i].x : col_codes[i].y) |= static_cast<uint32_t>(d.code(v[j][i])) << (8 * (j & 3));
      }
      if (cols_in && tid < 16) st[rb * C + c + i] = d.s;
    }
    const bool low = lane < 16;
    const int64_t row16 = r0 - (low ? 0 : 8);  // the 16 rows' first
    store_column_pairs(col_codes, low, [&](int i, const uint4& word) {
      if (cols_in && row16 < R) *reinterpret_cast<uint4*>(qt + (c + i) * R + row16) = word;
    });
  }
}

// x [R, C] -> q^T [C, R]: a block per 128 rows x 32 columns, staged in shared memory; column
// c's 128 rows are one tile of x^T's row c. Thread t: column t / 8, rows 16 (t % 8) .. + 15.
__global__ void quantize_transposed_kernel(const void* __restrict__ x, int elem_bytes, int64_t R, int64_t C,
                                           uint8_t* __restrict__ q, float* __restrict__ scale) {
  __shared__ float tile[kBlock][33];
  const int64_t n_cb = (C + 31) / 32;
  const int64_t rb = blockIdx.x / n_cb, cb = blockIdx.x % n_cb;
  const int64_t r0 = rb * kBlock, c0 = cb * 32;
  const int tid = threadIdx.x;
  for (int i = tid; i < kBlock * 32; i += blockDim.x) {  // coalesced along x's rows
    const int rr = i / 32, cc = i % 32;
    const int64_t r = r0 + rr, c = c0 + cc;
    tile[rr][cc] = r < R && c < C ? load(x, elem_bytes, r * C + c) : 0.f;
  }
  __syncthreads();
  const int cc = tid / 8, part = tid % 8;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(tile[16 * part + i][cc]));
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = tile_scale(amax);
  const int64_t c = c0 + cc;
  if (c >= C) return;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int64_t r = r0 + 16 * part + i;
    if (r < R) q[c * R + r] = to_e4m3(tile[16 * part + i][cc] / s);
  }
  if (part == 0) scale[rb * C + c] = s;
}

// The column pass of the quantizers that stage 128 rows x 64 columns as floats in shared
// memory: thread tid takes column tid % 64 and rows 32 (tid / 64) .. + 31, the four parts'
// amax meet in part_max, and each column's scale comes back to its four threads (every thread
// of the block calls it: it holds a __syncthreads); column_codes packs 16 rows of a column
// from rr as one 16-byte word of codes.
constexpr int kStagedCols = 64;
using StagedTile = float[kBlock][kStagedCols + 1];
__device__ __forceinline__ float staged_column_scale(const StagedTile& tile, float (&part_max)[4][kStagedCols],
                                                     int tid) {
  const int cc = tid % kStagedCols, part = tid / kStagedCols;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(tile[32 * part + i][cc]));
  part_max[part][cc] = amax;
  __syncthreads();
  return tile_scale(fmaxf(fmaxf(part_max[0][cc], part_max[1][cc]), fmaxf(part_max[2][cc], part_max[3][cc])));
}
// Stages `rows` (<= 128) bf16 rows of x [., C] from row r0, columns c0 .. c0 + 63 (C % 8 == 0:
// an 8-column chunk is all in or all out), 16 bytes a load, zeros past them.
__device__ __forceinline__ void stage_rows_bf16x8(StagedTile& tile, const __nv_bfloat16* __restrict__ x, int64_t r0,
                                                  int64_t rows, int64_t C, int64_t c0, int tid) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // 128 rows x 8 chunks of 8: a warp reads 4 rows' 128 bytes
    const int i = tid + 256 * k, rr = i / 8, cc = 8 * (i % 8);
    const int64_t c = c0 + cc;
    float v[8];
    if (rr < rows && c < C) {
      load8(x + (r0 + rr) * C + c, v);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) tile[rr][cc + j] = v[j];
  }
}
__device__ __forceinline__ uint4 column_codes(const StagedTile& tile, int rr, int cc, float s) {
  uint4 out;
  uint8_t* b = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
  for (int j = 0; j < 16; ++j) b[j] = to_e4m3(tile[rr + j][cc] / s);
  return out;
}
// The column pass's outputs once the tile is staged (every thread of the block calls it):
// column c = c0 + tid % 64's scale and this thread's 32 codes of it (rows 32 (tid / 64) ..),
// as two 16-byte words at codes_at(c, rr) for the rows below `rows` (a multiple of 16), the
// scale at scale_at(c) by the column's first part; nothing for a column past C.
template <typename CodesAt, typename ScaleAt>
__device__ __forceinline__ void store_staged_columns(const StagedTile& tile, float (&part_max)[4][kStagedCols],
                                                     int tid, int64_t c0, int64_t C, int64_t rows, CodesAt codes_at,
                                                     ScaleAt scale_at) {
  const int cc = tid % kStagedCols, part = tid / kStagedCols;
  const float s = staged_column_scale(tile, part_max, tid);
  const int64_t c = c0 + cc;
  if (c >= C) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = 32 * part + 16 * h;
    if (rr >= rows) break;
    *reinterpret_cast<uint4*>(codes_at(c, rr)) = column_codes(tile, rr, cc, s);
  }
  if (part == 0) *scale_at(c) = s;
}

// The transposed quantizer for bf16 x with C % 8 == 0 and R % 16 == 0 (16-byte loads and
// stores): a block per 128 rows x 64 columns, loaded 8 elements a thread into shared memory;
// thread t takes column t % 64 (a warp: 32 consecutive columns, no bank conflicts) and rows
// 32 (t / 64) .. + 31, so four threads in four warps share a column's tile (their amax meets
// in shared memory) and each stores its 32 codes as two 16-byte words. Same arithmetic, same
// bits; faster than quantize_tiles_kernel along the tokens (H100, 8192 x 2048: 37.4 against
// 48.8 us).
__global__ void __launch_bounds__(256) quantize_transposed_bf16x8_kernel(const __nv_bfloat16* __restrict__ x,
                                                                        int64_t R, int64_t C,
                                                                        uint8_t* __restrict__ q,
                                                                        float* __restrict__ scale) {
  constexpr int kCols = kStagedCols;
  __shared__ StagedTile tile;
  __shared__ float part_max[4][kCols];
  const int64_t n_cb = (C + kCols - 1) / kCols;
  const int64_t rb = blockIdx.x / n_cb, cb = blockIdx.x % n_cb;
  const int64_t r0 = rb * kBlock, c0 = cb * kCols;
  const int tid = threadIdx.x;
  stage_rows_bf16x8(tile, x, r0, R - r0, C, c0, tid);
  __syncthreads();
  store_staged_columns(  // R % 16 == 0: 16 rows are all in or all out
      tile, part_max, tid, c0, C, R - r0, [&](int64_t c, int rr) { return q + c * R + r0 + rr; },
      [&](int64_t c) { return scale + rb * C + c; });
}

// Each expert's W^T blocks from W's: a 256-thread block per 128 x 128 block (rb, cb) of expert
// e's [n, k], its codes read 16 bytes a thread into shared memory and written as the block
// (cb, rb) of [k, n] 16 bytes a thread (a column of 16 codes gathered from 16 rows); thread 0
// moves the scale. n, k multiples of 128.
__global__ void __launch_bounds__(256) transpose_blocks_kernel(const uint8_t* __restrict__ q,
                                                              const float* __restrict__ scale, int64_t n, int64_t k,
                                                              int64_t ls, int64_t lt, uint8_t* __restrict__ qt,
                                                              float* __restrict__ st) {
  __shared__ __align__(16) uint8_t tile[kBlock][kBlock + 16];  // rows 16-byte aligned for the uint4 stores
  const int64_t nb = n / kBlock, kb = k / kBlock;
  const int64_t e = blockIdx.z, rb = blockIdx.y, cb = blockIdx.x;
  const uint8_t* src = q + (e * n + rb * kBlock) * k + cb * kBlock;
  uint8_t* dst = qt + (e * k + cb * kBlock) * n + rb * kBlock;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // 128 rows x 8 chunks of 16 bytes
    const int c = tid + 256 * i, r = c / 8, j = c % 8;
    *reinterpret_cast<uint4*>(&tile[r][16 * j]) = *reinterpret_cast<const uint4*>(src + r * k + 16 * j);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // output row oc (input column) x chunk j of 16 input rows
    const int c = tid + 256 * i, oc = c / 8, j = c % 8;
    uint4 v;
    uint8_t* b = reinterpret_cast<uint8_t*>(&v);
#pragma unroll
    for (int t = 0; t < 16; ++t) b[t] = tile[16 * j + t][oc];
    *reinterpret_cast<uint4*>(dst + oc * n + 16 * j) = v;
  }
  if (tid == 0) st[(e * kb + cb) * lt + rb] = scale[(e * nb + rb) * ls + cb];
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  __nv_fp8_e4m3 v;
  v.__x = code;
  return static_cast<float>(v);
}
__device__ __forceinline__ void store_value(float* y, int64_t i, float v) { y[i] = v; }
__device__ __forceinline__ void store_value(__nv_bfloat16* y, int64_t i, float v) { y[i] = __float2bfloat16_rn(v); }

// y = code * scale: one f32 product, rounded once where y is bf16 (the CPU's order).
template <typename Out>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, bool blocks,
                                  int64_t R, int64_t C, int64_t scale_cols, Out* __restrict__ y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= R * C) return;
  const int64_t r = i / C, kb = (i % C) / kBlock;
  const float s = blocks ? scale[(r / kBlock) * scale_cols + kb] : scale[kb * R + r];
  store_value(y, i, e4m3_value(q[i]) * s);
}

// An N-byte word, and N bytes (N a power of two) copied in aligned words of up to 16.
template <int N> struct Word;
template <> struct Word<16> { using T = uint4; };
template <> struct Word<8> { using T = uint2; };
template <> struct Word<4> { using T = uint32_t; };
template <> struct Word<2> { using T = uint16_t; };
template <> struct Word<1> { using T = uint8_t; };
template <int N>
__device__ __forceinline__ void copy_words(void* dst, const void* src) {
  using T = typename Word<(N < 16 ? N : 16)>::T;
#pragma unroll
  for (int k = 0; k < N / static_cast<int>(sizeof(T)); ++k) static_cast<T*>(dst)[k] = static_cast<const T*>(src)[k];
}
// A scale's four little-endian bytes at `p` (4-byte aligned where kAligned).
template <bool kAligned>
__device__ __forceinline__ float load_scale(const uint8_t* p) {
  if constexpr (kAligned) return *reinterpret_cast<const float*>(p);
  return __uint_as_float(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
}
template <bool kAligned>
__device__ __forceinline__ void store_scale(uint8_t* p, float s) {
  if constexpr (kAligned) {
    *reinterpret_cast<float*>(p) = s;
  } else {
    const uint32_t bits = __float_as_uint(s);
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(bits >> (8 * b));
  }
}

// The packed rows' form (ops::pack_fp8_rows): row r is W = C + 4 L bytes, its C codes then
// its L scales. One grid-stride pass over two kinds of item: a row's codes in pieces of kVec
// bytes (16, 8 or 4 where every row, piece and scale slot is then aligned to it: see
// piece_bytes; else 1), then each (tile, row) scale, taken in the scales' own order
// so that their side of the copy is coalesced. Unpacking also writes the rows' values, code
// x scale (as dequantize_kernel: one f32 product, then rounded once to bf16).
template <int kVec>
__global__ void pack_rows_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t R, int64_t C,
                                 int64_t L, uint8_t* __restrict__ out) {
  const int64_t W = C + 4 * L, pieces = C / kVec, codes = R * pieces, total = codes + L * R;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < codes) {
      const int64_t r = i / pieces, c0 = (i % pieces) * kVec;
      copy_words<kVec>(out + r * W + c0, q + r * C + c0);
    } else {
      const int64_t j = i - codes, l = j / R, r = j % R;
      store_scale<(kVec >= 4)>(out + r * W + C + 4 * l, scale[j]);
    }
  }
}

// A piece of kVec codes of a row (at `src`) copied to `q`, and their values, code x s (the
// piece's tile's scale), to `values`.
template <int kVec, typename Out>
__device__ __forceinline__ void copy_piece_and_values(const uint8_t* src, float s, uint8_t* q, Out* values) {
  alignas(16) uint8_t b[kVec];
  copy_words<kVec>(b, src);
  copy_words<kVec>(q, b);
  alignas(16) Out v[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) store_value(v, k, e4m3_value(b[k]) * s);
  copy_words<kVec * static_cast<int>(sizeof(Out))>(values, v);
}

template <int kVec, typename Out>
__global__ void unpack_rows_kernel(const uint8_t* __restrict__ packed, int64_t R, int64_t C, int64_t L,
                                   uint8_t* __restrict__ q, float* __restrict__ scale, Out* __restrict__ values) {
  const int64_t W = C + 4 * L, pieces = C / kVec, codes = R * pieces, total = codes + L * R;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < codes) {
      const int64_t r = i / pieces, c0 = (i % pieces) * kVec;
      const uint8_t* row = packed + r * W;
      // A piece never crosses a tile (128 is a multiple of kVec).
      const float s = load_scale<(kVec >= 4)>(row + C + 4 * (c0 / kBlock));
      copy_piece_and_values<kVec>(row + c0, s, q + r * C + c0, values + r * C + c0);
    } else {
      const int64_t j = i - codes, l = j / R, r = j % R;
      scale[j] = load_scale<(kVec >= 4)>(packed + r * W + C + 4 * l);
    }
  }
}

// ops::permute_forward_fp8_values: row r is token source[r]'s codes, scales and values (as
// unpack_rows_kernel's, from the tokens' codes [T, C] and scales [L, T] instead of packed rows).
template <int kVec, typename Out>
__global__ void permute_values_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t T,
                                      int64_t C, int64_t L, const int32_t* __restrict__ source, int64_t R,
                                      uint8_t* __restrict__ oq, float* __restrict__ oscale, Out* __restrict__ values) {
  const int64_t pieces = C / kVec, codes = R * pieces, total = codes + L * R;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < codes) {
      const int64_t r = i / pieces, c0 = (i % pieces) * kVec, src = source[r];
      copy_piece_and_values<kVec>(q + src * C + c0, scale[(c0 / kBlock) * T + src], oq + r * C + c0,
                                  values + r * C + c0);
    } else {
      const int64_t j = i - codes, l = j / R, r = j % R;
      oscale[j] = scale[l * T + source[r]];
    }
  }
}

// Enough blocks to fill the GPU a few times over; the kernels stride over the rest.
unsigned stride_blocks(int64_t items) { return static_cast<unsigned>(std::min<int64_t>((items + 255) / 256, 8192)); }

// The widest piece (16, 8, 4 bytes, else 1) that divides `row_bytes` (and the packed rows'
// 4 L bytes of scales, where given), so that every row, piece and scale slot is aligned to it,
// given 16-byte aligned base pointers.
int piece_bytes(int64_t row_bytes, int64_t scale_bytes, bool bases_aligned) {
  if (!bases_aligned) return 1;
  for (int v : {16, 8, 4}) {
    if (row_bytes % v == 0 && scale_bytes % v == 0) return v;
  }
  return 1;
}

// Calls f.template operator()<kVec>() for kVec = v.
template <typename F>
void with_piece(int v, F&& f) {
  if (v == 16) f.template operator()<16>();
  else if (v == 8) f.template operator()<8>();
  else if (v == 4) f.template operator()<4>();
  else f.template operator()<1>();
}

}  // namespace

void launch_pack_fp8_rows(const uint8_t* q, const float* scale, int64_t R, int64_t C, uint8_t* out, cudaStream_t s) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  if (R == 0 || C == 0) return;  // nothing to move (and no block to launch)
  with_piece(piece_bytes(C, 4 * L, aligned16(q) && aligned16(out)), [&]<int kVec>() {
    pack_rows_kernel<kVec><<<stride_blocks(R * (C / kVec + L)), 256, 0, s>>>(q, scale, R, C, L, out);
  });
}

void launch_unpack_fp8_rows(const uint8_t* packed, int64_t R, int64_t C, uint8_t* q, float* scale, void* values,
                            bool values_bf16, cudaStream_t s) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  if (R == 0 || C == 0) return;
  const int v = piece_bytes(C, 4 * L, aligned16(packed) && aligned16(q) && aligned16(values));
  auto run = [&](auto* y) {
    with_piece(v, [&]<int kVec>() {
      unpack_rows_kernel<kVec><<<stride_blocks(R * (C / kVec + L)), 256, 0, s>>>(packed, R, C, L, q, scale, y);
    });
  };
  if (values_bf16) run(static_cast<__nv_bfloat16*>(values));
  else run(static_cast<float*>(values));
}

void launch_permute_fp8_values(const uint8_t* q, const float* scale, int64_t T, int64_t C, const int32_t* source,
                               int64_t R, uint8_t* oq, float* oscale, void* values, bool values_bf16, cudaStream_t s) {
  const int64_t L = (C + kBlock - 1) / kBlock;
  if (R == 0 || C == 0) return;
  const int v = piece_bytes(C, 0, aligned16(q) && aligned16(oq) && aligned16(values));
  auto run = [&](auto* y) {
    with_piece(v, [&]<int kVec>() {
      permute_values_kernel<kVec><<<stride_blocks(R * (C / kVec + L)), 256, 0, s>>>(q, scale, T, C, L, source, R, oq,
                                                                                   oscale, y);
    });
  };
  if (values_bf16) run(static_cast<__nv_bfloat16*>(values));
  else run(static_cast<float*>(values));
}

namespace {
// quantize_tiles_kernel for x of elem_bytes (2: bf16, 4: f32).
template <bool kRows, bool kTokens>
void launch_tiles(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale, uint8_t* qt,
                  float* st, cudaStream_t s) {
  if (R == 0 || C == 0) return;
  const auto blocks = static_cast<unsigned>(((R + kBlock - 1) / kBlock) * ((C + kBlock - 1) / kBlock));
  if (elem_bytes == 2) {
    quantize_tiles_kernel<__nv_bfloat16, kRows, kTokens>
        <<<blocks, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(x), R, C, q, scale, qt, st);
  } else {
    quantize_tiles_kernel<float, kRows, kTokens>
        <<<blocks, 256, 0, s>>>(static_cast<const float*>(x), R, C, q, scale, qt, st);
  }
}
}  // namespace

void launch_quantize_fp8_rows(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                              cudaStream_t s) {
  const int64_t warps = R * ((C + kBlock - 1) / kBlock);
  if (warps == 0) return;
  if (C % 8 == 0 && aligned16(x) && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    if (elem_bytes == 2) {
      quantize_rows_bf16x8_kernel<<<static_cast<unsigned>((warps + 15) / 16), 256, 0, s>>>(
          static_cast<const __nv_bfloat16*>(x), R, C, q, scale);  // one tile per 16 threads
    } else {
      launch_tiles<true, false>(x, elem_bytes, R, C, q, scale, nullptr, nullptr, s);
    }
    return;
  }
  quantize_rows_kernel<<<static_cast<unsigned>((warps + 7) / 8), 256, 0, s>>>(x, elem_bytes, R, C, q, scale);
}

namespace {
// quantize_blocks_vec_kernel for x of elem_bytes (2: bf16, 4: f32).
template <bool kDirect, bool kTransposed>
void launch_blocks_vec(const void* x, int elem_bytes, int64_t R, int64_t C, int64_t n, uint8_t* q, float* scale,
                       int64_t scale_cols, uint8_t* qt, float* st, int64_t st_cols, cudaStream_t s) {
  const auto blocks = static_cast<unsigned>(((R + kBlock - 1) / kBlock) * ((C + kBlock - 1) / kBlock));
  if (elem_bytes == 2) {
    quantize_blocks_vec_kernel<__nv_bfloat16, kDirect, kTransposed><<<blocks, 256, 0, s>>>(
        static_cast<const __nv_bfloat16*>(x), R, C, n, q, scale, scale_cols, qt, st, st_cols);
  } else {
    quantize_blocks_vec_kernel<float, kDirect, kTransposed>
        <<<blocks, 256, 0, s>>>(static_cast<const float*>(x), R, C, n, q, scale, scale_cols, qt, st, st_cols);
  }
}
}  // namespace

bool fp8_blocks_vec_fits(const void* x, int64_t C) { return C % 8 == 0 && aligned16(x); }

void launch_quantize_fp8_blocks(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                int64_t scale_cols, cudaStream_t s) {
  const int64_t blocks = ((R + kBlock - 1) / kBlock) * ((C + kBlock - 1) / kBlock);
  if (blocks == 0) return;
  if (fp8_blocks_vec_fits(x, C) && aligned16(q)) {
    launch_blocks_vec<true, false>(x, elem_bytes, R, C, R, q, scale, scale_cols, nullptr, nullptr, 0, s);
    return;
  }
  quantize_blocks_kernel<false><<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, elem_bytes, R, C, q, scale,
                                                                             scale_cols);
}

void launch_quantize_fp8_transposed_blocks(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q,
                                           float* scale, int64_t scale_cols, cudaStream_t s) {
  const int64_t blocks = ((R + kBlock - 1) / kBlock) * ((C + kBlock - 1) / kBlock);
  if (blocks == 0) return;
  if (fp8_blocks_vec_fits(x, C) && R % 16 == 0 && aligned16(q)) {
    launch_blocks_vec<false, true>(x, elem_bytes, R, C, R, nullptr, nullptr, 0, q, scale, scale_cols, s);
    return;
  }
  quantize_blocks_kernel<true><<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, elem_bytes, R, C, q, scale,
                                                                            scale_cols);
}

void launch_quantize_fp8_both_ways(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                   uint8_t* qt, float* st, cudaStream_t s) {
  launch_tiles<true, true>(x, elem_bytes, R, C, q, scale, qt, st, s);
}

void launch_quantize_fp8_weight(const void* x, int elem_bytes, int64_t R, int64_t C, int64_t n, uint8_t* q,
                                float* scale, int64_t scale_cols, uint8_t* qt, float* st, int64_t st_cols,
                                cudaStream_t s) {
  if (R == 0 || C == 0) return;
  launch_blocks_vec<true, true>(x, elem_bytes, R, C, n, q, scale, scale_cols, qt, st, st_cols, s);
}

// ---- quantize_fp8_expert_columns ------------------------------------------------------
namespace {

// counts [E] -> first_row [E + 1] and first_tile [E + 1] (expert e: rows [first_row[e],
// first_row[e + 1]), tiles [first_tile[e], first_tile[e + 1])), the counts clamped as the
// grouped GEMMs' schedule clamps them (negative: 0; rows past N dropped). One thread: E is
// at most a few hundred.
// With tile_row / tile_rows (T each): tile t's first row and its rows (0 past the last
// expert's tiles), so that a quantizer block reads its tile in two loads rather than by a
// binary search of dependent loads over first_tile.
__global__ void expert_tiles_kernel(const int64_t* __restrict__ counts, int E, int64_t N, int T,
                                    int* __restrict__ first_row, int* __restrict__ first_tile,
                                    int* __restrict__ tile_row, int* __restrict__ tile_rows) {
  if (blockIdx.x != 0) return;
  if (threadIdx.x == 0) {
    int64_t row = 0, tile = 0;
    first_row[0] = first_tile[0] = 0;
    for (int e = 0; e < E; ++e) {
      const int64_t c = counts[e] < 0 ? 0 : counts[e];
      const int64_t end = row + c < N ? row + c : N;
      tile += (end - row + kBlock - 1) / kBlock;
      row = end;
      first_row[e + 1] = static_cast<int>(row);
      first_tile[e + 1] = static_cast<int>(tile);
    }
  }
  if (tile_row == nullptr) return;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    for (int t = first_tile[e], r = first_row[e]; t < first_tile[e + 1]; ++t, r += kBlock) {
      tile_row[t] = r;
      tile_rows[t] = min(kBlock, first_row[e + 1] - r);
    }
  }
  for (int t = first_tile[E] + threadIdx.x; t < T; t += blockDim.x) tile_row[t] = tile_rows[t] = 0;
}

// A block per (tile t of 128 expert columns, 64 columns of x): the tile's rows (those of its
// expert: at most 128) staged in shared memory as floats, zeros past them; thread t takes
// column t % 64 and rows 32 (t / 64) .. + 31, the four parts' amax meet in shared memory,
// and each thread stores its 32 codes as two 16-byte words (P is a multiple of 128). A tile
// past the last expert's is all zeros: codes 0, scale 1.
// kVec8: bf16 x with C % 8 == 0, 16-byte aligned: 8 elements a load (stage_rows_bf16x8).
template <bool kVec8>
__global__ void __launch_bounds__(256) quantize_expert_columns_kernel(const void* __restrict__ x, int elem_bytes,
                                                                     int64_t C, int64_t P,
                                                                     const int* __restrict__ tile_row,
                                                                     const int* __restrict__ tile_rows,
                                                                     uint8_t* __restrict__ q, float* __restrict__ scale) {
  constexpr int kCols = kStagedCols;
  __shared__ StagedTile tile;
  __shared__ float part_max[4][kCols];
  const int t = blockIdx.x, tid = threadIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int64_t r0 = tile_row[t];
  const int rows = tile_rows[t];
  if constexpr (kVec8) {
    stage_rows_bf16x8(tile, static_cast<const __nv_bfloat16*>(x), r0, rows, C, c0, tid);
  } else {
    for (int i = tid; i < kBlock * kCols; i += 256) {  // a warp reads half a row's 64 columns
      const int rr = i / kCols, cc = i % kCols;
      const int64_t c = c0 + cc;
      tile[rr][cc] = rr < rows && c < C ? load(x, elem_bytes, (r0 + rr) * C + c) : 0.f;
    }
  }
  __syncthreads();
  store_staged_columns(  // every row of the tile: zeros past the expert's
      tile, part_max, tid, c0, C, kBlock,
      [&](int64_t c, int rr) { return q + c * P + static_cast<int64_t>(t) * kBlock + rr; },
      [&](int64_t c) { return scale + static_cast<int64_t>(t) * C + c; });
}

}  // namespace

void launch_expert_tiles(const int64_t* counts, int E, int64_t N, int T, int* first_row, int* first_tile,
                         int* tile_row, int* tile_rows, cudaStream_t s) {
  expert_tiles_kernel<<<1, 256, 0, s>>>(counts, E, N, T, first_row, first_tile, tile_row, tile_rows);
}

void launch_quantize_fp8_expert_columns(const void* x, int elem_bytes, int64_t C, int64_t tiles, const int* tile_row,
                                        const int* tile_rows, uint8_t* q, float* scale, cudaStream_t s) {
  if (tiles == 0 || C == 0) return;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>((C + 63) / 64));
  if (elem_bytes == 2 && C % 8 == 0 && aligned16(x)) {
    quantize_expert_columns_kernel<true><<<grid, 256, 0, s>>>(x, elem_bytes, C, tiles * kBlock, tile_row, tile_rows, q,
                                                              scale);
  } else {
    quantize_expert_columns_kernel<false><<<grid, 256, 0, s>>>(x, elem_bytes, C, tiles * kBlock, tile_row, tile_rows,
                                                               q, scale);
  }
}

void launch_quantize_fp8_transposed(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                    cudaStream_t s) {
  if (R == 0 || C == 0) return;
  if (C % 8 == 0 && R % 16 == 0 && aligned16(x) && aligned16(q)) {
    if (elem_bytes == 2) {
      const int64_t blocks = ((R + kBlock - 1) / kBlock) * ((C + kStagedCols - 1) / kStagedCols);
      quantize_transposed_bf16x8_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(
          static_cast<const __nv_bfloat16*>(x), R, C, q, scale);
    } else {
      launch_tiles<false, true>(x, elem_bytes, R, C, nullptr, nullptr, q, scale, s);
    }
    return;
  }
  const int64_t blocks = ((R + kBlock - 1) / kBlock) * ((C + 31) / 32);
  quantize_transposed_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(x, elem_bytes, R, C, q, scale);
}

void launch_transpose_fp8_experts(const uint8_t* q, const float* scale, int64_t E, int64_t n, int64_t k, int64_t ls,
                                  int64_t lt, uint8_t* qt, float* st, cudaStream_t s) {
  if (E == 0 || n == 0 || k == 0) return;
  const dim3 grid(static_cast<unsigned>(k / kBlock), static_cast<unsigned>(n / kBlock), static_cast<unsigned>(E));
  transpose_blocks_kernel<<<grid, 256, 0, s>>>(q, scale, n, k, ls, lt, qt, st);
}

void launch_dequantize_fp8(const uint8_t* q, const float* scale, bool blocks, int64_t R, int64_t C, int64_t scale_cols,
                           void* y, bool y_bf16, cudaStream_t s) {
  const int64_t n = R * C;
  if (n == 0) return;
  const unsigned grid = static_cast<unsigned>((n + 255) / 256);
  if (y_bf16) {
    dequantize_kernel<<<grid, 256, 0, s>>>(q, scale, blocks, R, C, scale_cols, static_cast<__nv_bfloat16*>(y));
  } else {
    dequantize_kernel<<<grid, 256, 0, s>>>(q, scale, blocks, R, C, scale_cols, static_cast<float*>(y));
  }
}

}  // namespace moetrain::ops::cuda
