// Softmax cross-entropy kernels over a large vocabulary (V up to ~152k), bf16 logits.
//
// forward: one block of 512 threads per row, one pass over the row (online softmax):
// each thread keeps a running (max m, sum s of exp(x - m)) over its vectors v = tid,
// tid + 512, ... (8 logits a 16-byte load; element by element when V % 8 != 0 or the
// pointer is unaligned), rescaling s when the max grows; the block merges the threads'
// (m, s) pairs by a warp butterfly and a fixed pass over the warps. lse = m + log(s).
// Thread 0 reads the target logit and writes lse and the row's loss to scratch; a second
// kernel (one block, launch_sum_fixed_order) adds the row losses in a fixed order. Every
// order is fixed by the shape: bitwise reproducible, no atomics.
// backward: one block per row writes scale * (exp(x - lse) - onehot) in bf16.
// exp is __expf (ex2.approx): its relative error (~1e-7) is far below what bf16 logits
// and the f32 tolerance of the loss can see.
#include "ops/cuda/cross_entropy_launch.h"
#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 512;
constexpr int32_t kIgnore = -100;

struct MaxSum {
  float m, s;
};

// Merge two partial softmax sums: (m, s) with s = sum exp(x - m).
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // both empty (or all -inf)
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

// Adds n values to a running (m, s).
template <int N>
__device__ __forceinline__ void absorb(MaxSum& acc, const float (&f)[N]) {
  float lm = f[0];
#pragma unroll
  for (int k = 1; k < N; ++k) lm = fmaxf(lm, f[k]);
  if (lm > acc.m) {
    acc.s *= __expf(acc.m - lm);  // 0 when acc.m = -inf
    acc.m = lm;
  }
  if (acc.m == -INFINITY) return;  // every value so far is -inf: nothing to add
#pragma unroll
  for (int k = 0; k < N; ++k) acc.s += __expf(f[k] - acc.m);
}

__device__ __forceinline__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum part[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = merge(v, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  MaxSum t{-INFINITY, 0.f};
  if (warp == 0) {
    if (lane < kThreads / 32) t = part[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, t.m, o), __shfl_xor_sync(0xffffffffu, t.s, o)};
      t = merge(t, other);
    }
  }
  return t;  // valid in warp 0
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) ce_forward_kernel(const bf16* __restrict__ logits,
                                                              const int32_t* __restrict__ targets,
                                                              float* __restrict__ lse, float* __restrict__ row_loss,
                                                              int64_t V) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  MaxSum acc{-INFINITY, 0.f};
  if constexpr (kVec) {
#pragma unroll 2
    for (int64_t v = threadIdx.x; v < V / 8; v += kThreads) {
      float f[8];
      load8(x + v * 8, f);
      absorb(acc, f);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float f[1] = {__bfloat162float(x[i])};
      absorb(acc, f);
    }
  }
  const MaxSum t = block_merge(acc);
  if (threadIdx.x == 0) {
    const float l = t.m + logf(t.s);
    lse[row] = l;
    const int32_t tg = targets[row];
    float loss = 0.f;
    if (tg != kIgnore) loss = (tg >= 0 && tg < V) ? l - __bfloat162float(x[tg]) : NAN;
    row_loss[row] = loss;
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) ce_backward_kernel(const bf16* __restrict__ logits,
                                                               const int32_t* __restrict__ targets,
                                                               const float* __restrict__ lse,
                                                               bf16* __restrict__ dlogits, int64_t V, float scale) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  bf16* d = dlogits + row * V;
  const int32_t tg = targets[row];
  const bool ignored = tg == kIgnore;
  const bool bad = !ignored && (tg < 0 || tg >= V);
  const float l = lse[row];
  // zero for ignored rows, NaN for an invalid target, else scale * softmax
  const float mul = ignored ? 0.f : (bad ? NAN : scale);
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < V / 8; v += kThreads) {
      float f[8];
      load8(x + v * 8, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float g = mul * __expf(f[k] - l);
        if (v * 8 + k == tg) g -= scale;
        f[k] = ignored ? 0.f : g;
      }
      store8(d + v * 8, f);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      float g = mul * __expf(__bfloat162float(x[i]) - l);
      if (i == tg) g -= scale;
      d[i] = __float2bfloat16(ignored ? 0.f : g);
    }
  }
}

}  // namespace

void launch_cross_entropy_forward(const bf16* logits, const int32_t* targets, float* lse, float* row_loss,
                                  float* loss_sum, int64_t T, int64_t V, cudaStream_t s) {
  if (T > 0) {
    const auto grid = static_cast<unsigned>(T);
    if (V % 8 == 0 && aligned16(logits)) {
      ce_forward_kernel<true><<<grid, kThreads, 0, s>>>(logits, targets, lse, row_loss, V);
    } else {
      ce_forward_kernel<false><<<grid, kThreads, 0, s>>>(logits, targets, lse, row_loss, V);
    }
  }
  launch_sum_fixed_order(row_loss, T, loss_sum, s);
}

void launch_cross_entropy_backward(const bf16* logits, const int32_t* targets, const float* lse, bf16* dlogits,
                                   int64_t T, int64_t V, float scale, cudaStream_t s) {
  if (T == 0 || V == 0) return;
  const auto grid = static_cast<unsigned>(T);
  if (V % 8 == 0 && aligned16(logits) && aligned16(dlogits)) {
    ce_backward_kernel<true><<<grid, kThreads, 0, s>>>(logits, targets, lse, dlogits, V, scale);
  } else {
    ce_backward_kernel<false><<<grid, kThreads, 0, s>>>(logits, targets, lse, dlogits, V, scale);
  }
}

}  // namespace moetrain::ops::cuda
