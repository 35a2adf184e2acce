// Launchers of the FP8 quantization kernels (fp8.cu; ops.h's quantize_fp8 family). x is bf16
// or f32 (elem_bytes 2 or 4); q bytes of e4m3; scales laid out as ops.h says.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// Rows mode: scale[kb * R + r]. Where C % 8 == 0, x is 16-byte aligned and q 8-byte aligned:
// 16 threads per 1 x 128 tile for bf16, quantize_tiles_kernel (a 256-thread block per
// 128 x 128) for f32; else a tile of 1 x 128 per warp.
void launch_quantize_fp8_rows(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                              cudaStream_t s);
// Blocks mode: a 128 x 128 block per 256-thread block; scale[rb * scale_cols + kb].
void launch_quantize_fp8_blocks(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                int64_t scale_cols, cudaStream_t s);
// x [R, C] -> x^T [C, R] in rows mode: scale[rb * C + c]. Where C % 8 == 0, R % 16 == 0 and
// x, q are 16-byte aligned: a block per 128 rows x 64 columns staged in shared memory for
// bf16, quantize_tiles_kernel for f32; else a block per 128 rows x 32 columns of x.
void launch_quantize_fp8_transposed(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                    cudaStream_t s);
// x [R, C] -> x^T [C, R] in blocks mode: a 256-thread block per 128 x 128 block of x, the
// codes written transposed; scale[cb * scale_cols + rb].
void launch_quantize_fp8_transposed_blocks(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q,
                                           float* scale, int64_t scale_cols, cudaStream_t s);
// Whether x [., C] takes the blocks-mode kernels that read 16 bytes at a time (C % 8 == 0,
// x 16-byte aligned): launch_quantize_fp8_weight's condition, with the shapes' own.
bool fp8_blocks_vec_fits(const void* x, int64_t C);
// A weight's blocks both ways in one pass (ops::quantize_fp8_weight): x [R, C] is E = R / n
// experts' [n, C] (n = R: a plain matrix); q [R, C] with scale[rb * scale_cols + cb], and each
// expert's W^T as rows e C .. of qt [E C, n] with st[(e ceil(C/128) + cb) * st_cols + rb_e].
// Needs fp8_blocks_vec_fits, n % 16 == 0, and n % 128 == 0 where E > 1.
void launch_quantize_fp8_weight(const void* x, int elem_bytes, int64_t R, int64_t C, int64_t n, uint8_t* q,
                                float* scale, int64_t scale_cols, uint8_t* qt, float* st, int64_t st_cols,
                                cudaStream_t s);
// x [R, C] per 1 x 128 tile both ways (ops::quantize_fp8_both_ways): q [R, C] with
// scale[kb * R + r], and x^T's codes qt [C, R] with st[rb * C + c]. Needs
// fp8_blocks_vec_fits and R % 16 == 0.
void launch_quantize_fp8_both_ways(const void* x, int elem_bytes, int64_t R, int64_t C, uint8_t* q, float* scale,
                                   uint8_t* qt, float* st, cudaStream_t s);
// Each expert's W^T per 128 x 128 block from W's blocks: q [E n, k] (scale [E n / 128][ls])
// -> qt [E k, n] (st [E k / 128][lt], its padding left as it is); n, k multiples of 128.
void launch_transpose_fp8_experts(const uint8_t* q, const float* scale, int64_t E, int64_t n, int64_t k, int64_t ls,
                                  int64_t lt, uint8_t* qt, float* st, cudaStream_t s);
// ops::quantize_fp8_expert_columns: first the experts' rows and tiles from counts (E + 1 each,
// clamped to N rows; with tile_row / tile_rows, also each of the T tiles' first row and row
// count), then x [N, C] -> q [C, 128 tiles], scale [tiles][C] (rows mode), each expert's rows
// in its own tiles; tiles = T = fp8_expert_tiles(N, E).
void launch_expert_tiles(const int64_t* counts, int E, int64_t N, int T, int* first_row, int* first_tile,
                         int* tile_row, int* tile_rows, cudaStream_t s);
void launch_quantize_fp8_expert_columns(const void* x, int elem_bytes, int64_t C, int64_t tiles, const int* tile_row,
                                        const int* tile_rows, uint8_t* q, float* scale, cudaStream_t s);
// y = q * scale (bf16 or f32 out), either mode.
void launch_dequantize_fp8(const uint8_t* q, const float* scale, bool blocks, int64_t R, int64_t C, int64_t scale_cols,
                           void* y, bool y_bf16, cudaStream_t s);

// ops::pack_fp8_rows: rows-mode codes q [R, C] and scale[kb * R + r] -> out [R, C + 4 ceil(C/128)].
void launch_pack_fp8_rows(const uint8_t* q, const float* scale, int64_t R, int64_t C, uint8_t* out, cudaStream_t s);
// ops::permute_forward_fp8_values: rows-mode tokens q [T, C], scale[kb * T + t] -> row r of
// oq [R, C] / oscale[kb * R + r] is token source[r]'s, and values [R, C] its codes x scales.
void launch_permute_fp8_values(const uint8_t* q, const float* scale, int64_t T, int64_t C, const int32_t* source,
                               int64_t R, uint8_t* oq, float* oscale, void* values, bool values_bf16, cudaStream_t s);
// ops::unpack_fp8_rows: the inverse, and the values code * scale into `values` (bf16 or f32).
void launch_unpack_fp8_rows(const uint8_t* packed, int64_t R, int64_t C, uint8_t* q, float* scale, void* values,
                            bool values_bf16, cudaStream_t s);

}  // namespace moetrain::ops::cuda
