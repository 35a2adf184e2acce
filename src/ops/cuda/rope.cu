// Rotary position embedding (ops.h's RopeSpec), bf16 in and out.
//
// One block (128 threads) per token: its threads first compute cos/sin of the head_dim/2
// angles into shared memory (once per token, shared by all heads), then rotate the pairs of
// every head: for whole rotate-half heads whose head_dim/2 is a multiple of 8 (Qwen3), 8
// pairs a thread with 16-byte loads; otherwise (interleaved pairs, heads wider than their
// rotary dims: DeepSeek-V3's MLA) value by value, copying the non-rotary dims through.
//
// The angle follows Hugging Face's rotary embedding in f32: inv_freq = 1 / theta^(2i/hd)
// (f32 pow) or the given frequencies rounded to f32 (YaRN's, computed by the config);
// angle = float(pos) * inv_freq, cos and sin of it in f32 (full-range sincosf, not the fast
// intrinsic: angles reach tens of thousands of radians). HF then rounds cos
// and sin to the activation dtype and rotates in bf16; here they stay f32 and the rotation
// is in f32, rounded once, as the CPU reference does (in double).
#include "ops/cuda/rope_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 128;

template <bool kVec>
__global__ void __launch_bounds__(kThreads) rope_kernel(const bf16* __restrict__ x,
                                                        const int32_t* __restrict__ positions,
                                                        bf16* __restrict__ y, int64_t W, RopeArgs a, float sign) {
  extern __shared__ float cs[];  // scale * cos [half], then scale * sign * sin [half]
  const int hd = a.head_dim, half = hd / 2, stride = a.stride, pass = stride - hd;
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    float s, c;
    if (a.given_freqs) {
      sincosf(pos * a.inv_freq[i], &s, &c);
    } else {
      rope_cos_sin(pos, i, hd, a.theta, &c, &s);
    }
    cs[i] = a.scale * c;
    cs[half + i] = a.scale * sign * s;
  }
  __syncthreads();
  const int64_t heads = W / stride;
  const bf16* xr = x + t * W;
  bf16* yr = y + t * W;
  if constexpr (kVec) {  // whole rotate-half heads (stride == hd), 8 pairs a thread
    const int per_head = half / 8;
    for (int64_t k = threadIdx.x; k < heads * per_head; k += kThreads) {
      const int64_t h = k / per_head;
      const int i = static_cast<int>(k % per_head) * 8;
      const int64_t base = h * hd + i;
      float va[8], vb[8], ya[8], yb[8];
      load8(xr + base, va);
      load8(xr + base + half, vb);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float c = cs[i + u], s = cs[half + i + u];
        ya[u] = va[u] * c - vb[u] * s;
        yb[u] = vb[u] * c + va[u] * s;
      }
      store8(yr + base, ya);
      store8(yr + base + half, yb);
    }
  } else {  // per value: the copied dims, then one pair per index
    const int per_head = pass + half;
    const int step = a.interleaved ? 2 : 1, other = a.interleaved ? 1 : half;
    for (int64_t k = threadIdx.x; k < heads * per_head; k += kThreads) {
      const int64_t h0 = (k / per_head) * stride;
      const int j = static_cast<int>(k % per_head);
      if (j < pass) {
        yr[h0 + j] = xr[h0 + j];
        continue;
      }
      const int i = j - pass;
      const int64_t ia = h0 + pass + i * step, ib = ia + other;
      const float va = __bfloat162float(xr[ia]), vb = __bfloat162float(xr[ib]);
      const float c = cs[i], s = cs[half + i];
      yr[ia] = __float2bfloat16(va * c - vb * s);
      yr[ib] = __float2bfloat16(vb * c + va * s);
    }
  }
}

}  // namespace

void launch_rope(const bf16* x, const int32_t* positions, bf16* y, int64_t T, int64_t W, const RopeArgs& a,
                 float sign, cudaStream_t s) {
  if (T == 0 || W == 0) return;
  const size_t smem = static_cast<size_t>(a.head_dim) * sizeof(float);
  const bool vec = !a.interleaved && a.stride == a.head_dim && (a.head_dim / 2) % 8 == 0 && aligned16(x) &&
                   aligned16(y);
  const auto grid = static_cast<unsigned>(T);
  if (vec) {
    rope_kernel<true><<<grid, kThreads, smem, s>>>(x, positions, y, W, a, sign);
  } else {
    rope_kernel<false><<<grid, kThreads, smem, s>>>(x, positions, y, W, a, sign);
  }
}

}  // namespace moetrain::ops::cuda
