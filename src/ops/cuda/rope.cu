// Rotary position embedding, rotate-half convention, bf16 in and out.
//
// One block (128 threads) per token: its threads first compute cos/sin of the head_dim/2
// angles into shared memory (once per token, shared by all heads), then rotate the
// (i, i + head_dim/2) pairs of every head, 8 pairs a thread with 16-byte loads when
// head_dim/2 is a multiple of 8 and the pointers are aligned, else pair by pair.
//
// The angle follows Hugging Face's rotary embedding in f32: inv_freq = 1 / theta^(2i/hd)
// (f32 pow), angle = float(pos) * inv_freq, cos and sin of it in f32 (full-range sincosf,
// not the fast intrinsic: angles reach tens of thousands of radians). HF then rounds cos
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
                                                        bf16* __restrict__ y, int64_t W, int hd, float theta,
                                                        float sign) {
  extern __shared__ float cs[];  // cos [half], then sign * sin [half]
  const int half = hd / 2;
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    float s, c;
    rope_cos_sin(pos, i, hd, theta, &c, &s);
    cs[i] = c;
    cs[half + i] = sign * s;
  }
  __syncthreads();
  const int64_t heads = W / hd;
  const bf16* xr = x + t * W;
  bf16* yr = y + t * W;
  if constexpr (kVec) {
    const int per_head = half / 8;
    for (int64_t k = threadIdx.x; k < heads * per_head; k += kThreads) {
      const int64_t h = k / per_head;
      const int i = static_cast<int>(k % per_head) * 8;
      const int64_t base = h * hd + i;
      float a[8], b[8], ya[8], yb[8];
      load8(xr + base, a);
      load8(xr + base + half, b);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float c = cs[i + u], s = cs[half + i + u];
        ya[u] = a[u] * c - b[u] * s;
        yb[u] = b[u] * c + a[u] * s;
      }
      store8(yr + base, ya);
      store8(yr + base + half, yb);
    }
  } else {
    for (int64_t k = threadIdx.x; k < heads * half; k += kThreads) {
      const int64_t h = k / half;
      const int i = static_cast<int>(k % half);
      const int64_t base = h * hd + i;
      const float a = __bfloat162float(xr[base]), b = __bfloat162float(xr[base + half]);
      const float c = cs[i], s = cs[half + i];
      yr[base] = __float2bfloat16(a * c - b * s);
      yr[base + half] = __float2bfloat16(b * c + a * s);
    }
  }
}

}  // namespace

void launch_rope(const bf16* x, const int32_t* positions, bf16* y, int64_t T, int64_t W, int64_t head_dim,
                 float theta, float sign, cudaStream_t s) {
  if (T == 0 || W == 0) return;
  const size_t smem = static_cast<size_t>(head_dim) * sizeof(float);
  const bool vec = (head_dim / 2) % 8 == 0 && aligned16(x) && aligned16(y);
  const auto grid = static_cast<unsigned>(T);
  const int hd = static_cast<int>(head_dim);
  if (vec) {
    rope_kernel<true><<<grid, kThreads, smem, s>>>(x, positions, y, W, hd, theta, sign);
  } else {
    rope_kernel<false><<<grid, kThreads, smem, s>>>(x, positions, y, W, hd, theta, sign);
  }
}

}  // namespace moetrain::ops::cuda
