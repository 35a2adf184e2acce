// Launchers of the embedding kernels (embedding.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// y[t] = w[ids[t] - first] for rows of H elements (bf16 or f32 rows: elem_bytes 2 or 4), w
// holding rows [first, first + V) of a vocabulary of `whole`: a row whose id is another
// shard's is zero, one whose id lies outside [0, whole) is filled with NaN (there is no host
// check: that would wait for the device), so the loss shows it.
void launch_embedding_forward(const int32_t* ids, const void* w, void* y, int64_t T, int64_t V, int64_t H,
                              int elem_bytes, int64_t first, int64_t whole, cudaStream_t s);

// out[t] = ids[t + k] where t + k stays in t's row of `seq` (and in its segment, when
// seg is not null), `fill` elsewhere; n = batch * seq.
void launch_shift_tokens(const int32_t* ids, const int32_t* seg, int32_t* out, int64_t n, int64_t seq, int64_t k,
                         int32_t fill, cudaStream_t s);

// Bytes of device scratch launch_embedding_backward needs for T tokens and V rows.
size_t embedding_backward_workspace_bytes(int64_t T, int64_t V);
// dw[ids[t] - first] += dy[t] (dw f32 [V, H]: rows [first, first + V) of the vocabulary; dy
// bf16 or f32 [T, H]), deterministic: the tokens are sorted stably by id (CUB radix sort),
// then one block per distinct id and column chunk adds its tokens' rows in token order.
// Ids outside [first, first + V) are skipped. Returns the CUB status.
cudaError_t launch_embedding_backward(const int32_t* ids, const __nv_bfloat16* dy, float* dw, int64_t T, int64_t V,
                                      int64_t H, int64_t first, void* workspace, size_t workspace_bytes,
                                      cudaStream_t s);
cudaError_t launch_embedding_backward(const int32_t* ids, const float* dy, float* dw, int64_t T, int64_t V,
                                      int64_t H, int64_t first, void* workspace, size_t workspace_bytes,
                                      cudaStream_t s);

}  // namespace moetrain::ops::cuda
