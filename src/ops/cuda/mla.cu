// MLA's keys and values (ops.h): pure data movement, one block per token, a thread per
// output value (T * H * (nope + rope + dv) values of bf16 each way: against the GEMMs around
// them, a few microseconds). The shared key's gradient sums the heads in order in f32, so
// it is reproducible.
#include "ops/cuda/mla_launch.h"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) mla_kv_forward_kernel(const bf16* __restrict__ kv,
                                                                  const bf16* __restrict__ k_rot,
                                                                  bf16* __restrict__ k, bf16* __restrict__ v,
                                                                  int heads, int nope, int rope, int v_dim) {
  const int64_t t = blockIdx.x;
  const int kw = nope + rope, kvw = nope + v_dim;
  const bf16* src = kv + t * heads * kvw;
  for (int i = threadIdx.x; i < heads * kw; i += kThreads) {  // k: per head nope dims, then k_rot
    const int h = i / kw, j = i % kw;
    k[t * heads * kw + i] = j < nope ? src[h * kvw + j] : k_rot[t * rope + (j - nope)];
  }
  for (int i = threadIdx.x; i < heads * v_dim; i += kThreads) {
    const int h = i / v_dim, j = i % v_dim;
    v[t * heads * v_dim + i] = src[h * kvw + nope + j];
  }
}

__global__ void __launch_bounds__(kThreads) mla_kv_backward_kernel(const bf16* __restrict__ dk,
                                                                   const bf16* __restrict__ dv,
                                                                   bf16* __restrict__ dkv, bf16* __restrict__ dk_rot,
                                                                   int heads, int nope, int rope, int v_dim) {
  const int64_t t = blockIdx.x;
  const int kw = nope + rope, kvw = nope + v_dim;
  const bf16* dkt = dk + t * heads * kw;
  for (int i = threadIdx.x; i < heads * kvw; i += kThreads) {
    const int h = i / kvw, j = i % kvw;
    dkv[t * heads * kvw + i] = j < nope ? dkt[h * kw + j] : dv[t * heads * v_dim + h * v_dim + (j - nope)];
  }
  for (int j = threadIdx.x; j < rope; j += kThreads) {
    float sum = 0.f;
    for (int h = 0; h < heads; ++h) sum += __bfloat162float(dkt[h * kw + nope + j]);
    dk_rot[t * rope + j] = __float2bfloat16(sum);
  }
}

}  // namespace

void launch_mla_kv_forward(const bf16* kv, const bf16* k_rot, bf16* k, bf16* v, int64_t T, int heads, int nope,
                           int rope, int v_dim, cudaStream_t s) {
  if (T == 0) return;
  mla_kv_forward_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(kv, k_rot, k, v, heads, nope, rope, v_dim);
}

void launch_mla_kv_backward(const bf16* dk, const bf16* dv, bf16* dkv, bf16* dk_rot, int64_t T, int heads, int nope,
                            int rope, int v_dim, cudaStream_t s) {
  if (T == 0) return;
  mla_kv_backward_kernel<<<static_cast<unsigned>(T), kThreads, 0, s>>>(dk, dv, dkv, dk_rot, heads, nope, rope,
                                                                       v_dim);
}

}  // namespace moetrain::ops::cuda
