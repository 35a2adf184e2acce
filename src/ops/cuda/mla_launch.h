// Launchers of the MLA key/value kernels (mla.cu; ops.h's mla_kv_forward / _backward), bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// k [T, H*(nope+rope)], v [T, H*dv] from kv [T, H*(nope+dv)] and k_rot [T, rope].
void launch_mla_kv_forward(const __nv_bfloat16* kv, const __nv_bfloat16* k_rot, __nv_bfloat16* k,
                           __nv_bfloat16* v, int64_t T, int heads, int nope, int rope, int v_dim, cudaStream_t s);
// dkv [T, H*(nope+dv)] from dk and dv; dk_rot [T, rope] = sum over heads of dk's rotary dims.
void launch_mla_kv_backward(const __nv_bfloat16* dk, const __nv_bfloat16* dv, __nv_bfloat16* dkv,
                            __nv_bfloat16* dk_rot, int64_t T, int heads, int nope, int rope, int v_dim,
                            cudaStream_t s);

}  // namespace moetrain::ops::cuda
