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
// fused (forward and backward of the output head, rows of up to 32768 logits): one block per
// row copies its logits once into shared memory, merges (m, s) in the forward's order, then
// writes the backward's values over the logits:
// the same bits as the two kernels, one read of the row instead of two (the bench head's
// 537 MB of logits: ~0.18 ms a micro-batch on an H100).
// exp is __expf (ex2.approx): its relative error (~1e-7) is far below what bf16 logits
// and the f32 tolerance of the loss can see.
#include "ops/cuda/cross_entropy_launch.h"
#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/moe_device.cuh"
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

// The gradient of 8 logits f starting at index i0 of their row, in place: scale * softmax
// (mul = scale, 0 for an ignored row, NaN for an invalid target), minus scale at the target.
__device__ __forceinline__ void softmax_grad8(float (&f)[8], int64_t i0, int64_t tg, float mul, float l, float scale,
                                              bool ignored) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    float g = mul * __expf(f[k] - l);
    if (i0 + k == tg) g -= scale;
    f[k] = ignored ? 0.f : g;
  }
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

// A row's (max, sum exp) over its V logits x, merged by the block (valid in warp 0):
// 16-byte loads when kVec, element by element otherwise.
template <bool kVec>
__device__ __forceinline__ MaxSum row_max_sum(const bf16* x, int64_t V) {
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
  return block_merge(acc);
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) ce_forward_kernel(const bf16* __restrict__ logits,
                                                              const int32_t* __restrict__ targets,
                                                              float* __restrict__ lse, float* __restrict__ row_loss,
                                                              int64_t V) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  const MaxSum t = row_max_sum<kVec>(x, V);
  if (threadIdx.x == 0) {
    const float l = t.m + logf(t.s);
    lse[row] = l;
    const int32_t tg = targets[row];
    float loss = 0.f;
    if (tg != kIgnore) loss = (tg >= 0 && tg < V) ? l - __bfloat162float(x[tg]) : NAN;
    row_loss[row] = loss;
  }
}

// A vocabulary split across ranks (ops.h's vocab_shard_*): V the shard's columns, v0 the
// first's whole-vocabulary id, v_whole the whole vocabulary (0, V for the whole of it).
template <bool kVec>
__global__ void __launch_bounds__(kThreads) ce_backward_kernel(const bf16* __restrict__ logits,
                                                               const int32_t* __restrict__ targets,
                                                               const float* __restrict__ lse,
                                                               bf16* __restrict__ dlogits, int64_t V, int64_t v0,
                                                               int64_t v_whole, float scale) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  bf16* d = dlogits + row * V;
  const int32_t whole_tg = targets[row];
  const bool ignored = whole_tg == kIgnore;
  const bool bad = !ignored && (whole_tg < 0 || whole_tg >= v_whole);
  const int64_t tg = whole_tg - v0;  // this shard's column of the target (outside [0, V): another shard's)
  const float l = lse[row];
  // zero for ignored rows, NaN for an invalid target, else scale * softmax
  const float mul = ignored ? 0.f : (bad ? NAN : scale);
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < V / 8; v += kThreads) {
      float f[8];
      load8(x + v * 8, f);
      softmax_grad8(f, v * 8, tg, mul, l, scale, ignored);
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


// A shard's statistics (ops.h's vocab_shard_stats): its columns' lse, and the target's logit
// where the shard holds it (0 elsewhere and for ignored rows; NaN for an invalid target). The
// forward kernel's order of merging.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) vocab_stats_kernel(const bf16* __restrict__ logits,
                                                               const int32_t* __restrict__ targets,
                                                               float* __restrict__ lse, float* __restrict__ tlogit,
                                                               int64_t V, int64_t v0, int64_t v_whole) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * V;
  const MaxSum t = row_max_sum<kVec>(x, V);
  if (threadIdx.x == 0) {
    lse[row] = t.m + logf(t.s);
    const int32_t tg = targets[row];
    const int64_t local = static_cast<int64_t>(tg) - v0;
    float x_tg = 0.f;
    if (tg != kIgnore && (tg < 0 || tg >= v_whole)) x_tg = NAN;
    if (tg != kIgnore && local >= 0 && local < V) x_tg = __bfloat162float(x[local]);
    tlogit[row] = x_tg;
  }
}

// One thread a row: lse = log sum_r exp(lse_r) from the largest, the target's logit summed
// over the shards (r in order); row_loss 0 where ignored.
__global__ void __launch_bounds__(256) vocab_loss_kernel(const float* __restrict__ shard_lse,
                                                         const float* __restrict__ shard_tlogit,
                                                         const int32_t* __restrict__ targets, float* __restrict__ lse,
                                                         float* __restrict__ row_loss, int64_t R, int64_t T) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (t >= T) return;
  float m = -INFINITY, x_tg = 0.f;
  for (int64_t r = 0; r < R; ++r) m = fmaxf(m, shard_lse[r * T + t]);
  float s = 0.f;
  for (int64_t r = 0; r < R; ++r) {
    s += expf(shard_lse[r * T + t] - m);
    x_tg += shard_tlogit[r * T + t];
  }
  const float l = m + logf(s);
  lse[t] = l;
  row_loss[t] = targets[t] == kIgnore ? 0.f : l - x_tg;
}

// The row is copied into shared memory (cp.async, 16 bytes a thread at a time, up to 64 KB:
// three blocks a multiprocessor, so that one's copies overlap the others' arithmetic), read
// from there by the forward's merge and again by the gradient, written over the logits.
// (Held in registers instead: one or two blocks a multiprocessor, and slower than the two
// kernels: 666 us for the bench head against 546.)
__global__ void __launch_bounds__(kThreads) ce_fused_kernel(bf16* __restrict__ logits,
                                                            const int32_t* __restrict__ targets,
                                                            float* __restrict__ lse, float* __restrict__ row_loss,
                                                            int64_t V, float scale) {
  extern __shared__ uint4 s_row[];
  const int64_t row = blockIdx.x, nv = V / 8;
  bf16* x = logits + row * V;
  const int32_t tg = targets[row];
  const bool ignored = tg == kIgnore;
  const bool bad = !ignored && (tg < 0 || tg >= V);
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) moe::cp_async_16(&s_row[v], x + v * 8, true);
  moe::cp_async_commit();
  moe::cp_async_wait<0>();
  __syncthreads();
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) {  // the forward's order
    float f[8];
    load8(reinterpret_cast<const bf16*>(&s_row[v]), f);
    absorb(acc, f);
  }
  const float x_tg = threadIdx.x == 0 && !ignored && !bad ? __bfloat162float(x[tg]) : 0.f;
  const MaxSum t = block_merge(acc);
  __shared__ float s_lse;
  if (threadIdx.x == 0) {
    const float l = t.m + logf(t.s);
    lse[row] = l;
    row_loss[row] = ignored ? 0.f : (bad ? NAN : l - x_tg);
    s_lse = l;
  }
  __syncthreads();
  const float l = s_lse;
  const float mul = ignored ? 0.f : (bad ? NAN : scale);
  for (int64_t v = threadIdx.x; v < nv; v += kThreads) {
    float f[8];
    load8(reinterpret_cast<const bf16*>(&s_row[v]), f);
    softmax_grad8(f, v * 8, tg, mul, l, scale, ignored);
    store8(x + v * 8, f);
  }
}

}  // namespace

bool launch_cross_entropy_fused(bf16* logits, const int32_t* targets, float* lse, float* row_loss, float* loss_sum,
                                int64_t T, int64_t V, float scale, cudaStream_t s) {
  if (V % 8 != 0 || V > kCrossEntropyFusedMaxV || !aligned16(logits)) return false;
  if (T > 0) {
    const int smem = static_cast<int>(V * sizeof(bf16));
    cudaFuncSetAttribute(ce_fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    ce_fused_kernel<<<static_cast<unsigned>(T), kThreads, smem, s>>>(logits, targets, lse, row_loss, V, scale);
  }
  launch_sum_fixed_order(row_loss, T, loss_sum, s);
  return true;
}

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
  launch_vocab_shard_backward(logits, targets, lse, dlogits, T, V, 0, V, scale, s);
}

void launch_vocab_shard_backward(const bf16* logits, const int32_t* targets, const float* lse, bf16* dlogits,
                                 int64_t T, int64_t V, int64_t v0, int64_t v_whole, float scale, cudaStream_t s) {
  if (T == 0 || V == 0) return;
  const auto grid = static_cast<unsigned>(T);
  if (V % 8 == 0 && aligned16(logits) && aligned16(dlogits)) {
    ce_backward_kernel<true><<<grid, kThreads, 0, s>>>(logits, targets, lse, dlogits, V, v0, v_whole, scale);
  } else {
    ce_backward_kernel<false><<<grid, kThreads, 0, s>>>(logits, targets, lse, dlogits, V, v0, v_whole, scale);
  }
}

void launch_vocab_shard_stats(const bf16* logits, const int32_t* targets, float* lse, float* target_logit, int64_t T,
                              int64_t V, int64_t v0, int64_t v_whole, cudaStream_t s) {
  if (T == 0) return;
  const auto grid = static_cast<unsigned>(T);
  if (V % 8 == 0 && aligned16(logits)) {
    vocab_stats_kernel<true><<<grid, kThreads, 0, s>>>(logits, targets, lse, target_logit, V, v0, v_whole);
  } else {
    vocab_stats_kernel<false><<<grid, kThreads, 0, s>>>(logits, targets, lse, target_logit, V, v0, v_whole);
  }
}

void launch_vocab_parallel_loss(const float* shard_lse, const float* shard_target_logit, const int32_t* targets,
                                float* lse, float* row_loss, float* loss_sum, int64_t R, int64_t T, cudaStream_t s) {
  if (T > 0) {
    vocab_loss_kernel<<<static_cast<unsigned>((T + 255) / 256), 256, 0, s>>>(shard_lse, shard_target_logit, targets,
                                                                            lse, row_loss, R, T);
  }
  launch_sum_fixed_order(row_loss, T, loss_sum, s);
}

}  // namespace moetrain::ops::cuda
