// Launchers of the token-permutation kernels (permute.cu); the host wrapper is permute.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moetrain::ops::cuda {

// The largest expert count permutation_by_expert takes (per-block tallies in shared memory).
constexpr int kPermuteMaxExperts = 1024;

// Device scratch (in 4-byte words) that launch_permutation needs for NK pairs, E experts.
int64_t permutation_workspace_words(int64_t NK, int E);
// Counting sort of topk_idx i32 [NK = T*K] by expert, stable in (t, k) order, with no host
// synchronisation: counts i64 [E], slot_row i32 [NK], source_token i32 [NK]. Ids outside
// [0, E) are skipped (not counted, rows not written). workspace: the words above.
void launch_permutation(const int32_t* topk_idx, int64_t NK, int K, int E, int64_t* counts, int32_t* slot_row,
                        int32_t* source_token, int32_t* workspace, cudaStream_t stream);

// Row copies, any element type (row_bytes per row): gather dst[r] = src[index[r]], or
// scatter dst[index[r]] = src[r]; r in [0, rows), index values checked against the other
// side's row count (index_rows) and skipped when outside.
void launch_copy_rows(const void* src, void* dst, const int32_t* index, int64_t rows, int64_t index_rows,
                      int64_t row_bytes, bool scatter, cudaStream_t stream);
// out [L, R]: out[l][r] = x[l][index[r]] for x [L, T]: the columns of a row-major table
// gathered, e.g. per-tile scales stored [tiles, rows] following their rows; a column whose
// index is outside [0, T) is left as it is (as launch_copy_rows leaves a row).
void launch_gather_columns(const float* x, int64_t L, int64_t T, const int32_t* index, int64_t R, float* out,
                           cudaStream_t stream);

// dx[t] = sum_k dxp[slot_row[t*K + k]] over k in order, f32 accumulation, rows outside
// [0, R) skipped (absent); dxp [R, H], dx [T, H], both bf16 (is_bf16) or f32.
void launch_permute_backward(const void* dxp, const int32_t* slot_row, int64_t T, int K, int64_t R, int64_t H,
                             void* dx, bool is_bf16, cudaStream_t stream);
// out[i] = idx[i] - first for ids in [first, first + count), else count; n ids.
void launch_expert_ids_in_range(const int32_t* idx, int64_t n, int32_t first, int32_t count, int32_t* out,
                                cudaStream_t stream);

}  // namespace moetrain::ops::cuda
