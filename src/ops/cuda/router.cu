// Router kernels: one warp per token; lane l holds experts l, l+32, ... in registers
// (VPT = ceil(E/32) of them, a compile-time count so the arrays stay in registers).
//
// Forward: softmax in f32 (max-subtracted), then K rounds of a warp arg-max over the
// experts not yet taken, ordered by (score descending, expert id ascending), the score being
// the prob plus the selection bias when one is given: the CPU's order, ties to the lower id.
// Lane j%32 writes pick j with its prob, and with norm_topk_prob divides its own picks by
// their sum afterwards.
// Backward: dp = dprobs (or 0) plus the top-k weight gradients (through the
// renormalisation's quotient rule when on), then dlogits = p * (dp - <p, dp>).
#include <climits>
#include <type_traits>

#include "ops/cuda/kernels.cuh"
#include "ops/cuda/router_launch.h"

namespace moetrain::ops::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// K rounds of a warp arg-max over the choice scores sc (lane l holds experts l, l+32, ...),
// ordered by (score descending, expert id ascending): lane j%32 writes pick j's id to
// idx_row[j] and its value v to weight_row[j]. Returns the sum of the picked values (on
// every lane). Padding lanes hold -inf and are never picked.
template <int VPT>
__device__ __forceinline__ float warp_pick_top_k(const float (&sc)[VPT], const float (&v)[VPT], int lane, int K,
                                                 int32_t* idx_row, float* weight_row) {
  unsigned taken = 0;
  float sum = 0.f;
  for (int j = 0; j < K; ++j) {
    float bs = -INFINITY, bv = 0.f;  // the best score and its value
    int be = INT_MAX;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {  // ids ascend with i: strict > keeps the lower id on ties
      if (!((taken >> i) & 1u) && sc[i] > bs) {
        bs = sc[i];
        bv = v[i];
        be = lane + 32 * i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float os = __shfl_xor_sync(0xffffffffu, bs, o);
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (os > bs || (os == bs && oe < be)) {
        bs = os;
        bv = ov;
        be = oe;
      }
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (lane + 32 * i == be) taken |= 1u << i;
    }
    if (lane == (j & 31)) {
      idx_row[j] = be;
      weight_row[j] = bv;
    }
    sum += bv;
  }
  return sum;
}

template <int VPT, typename TIn>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_forward_kernel(const TIn* __restrict__ logits, const float* __restrict__ bias, int64_t T, int E, int K,
                          bool norm, float* __restrict__ probs, int32_t* __restrict__ idx,
                          float* __restrict__ weight) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T) return;
  const TIn* l = logits + t * E;
  float v[VPT];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? to_float(l[e]) : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? expf(v[i] - mx) : 0.f;
    sum += v[i];
  }
  sum = warp_sum(sum);
  float* p = probs + t * E;
  float sc[VPT];  // what the choice ranks
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    if (e < E) {
      v[i] = v[i] / sum;
      p[e] = v[i];
      sc[i] = bias ? v[i] + bias[e] : v[i];
    } else {
      sc[i] = -INFINITY;  // padding: below every score, never picked
    }
  }
  const float s = warp_pick_top_k<VPT>(sc, v, lane, K, idx + t * K, weight + t * K);
  if (norm) {
    for (int j = lane; j < K; j += 32) weight[t * K + j] = weight[t * K + j] / s;  // this lane's own picks
  }
}

// Both routers' backward (kSigmoid: DeepSeek-V3's, whose weights are scaled and whose
// renormalisation adds 1e-20 to the sum; the softmax router's scaling is 1 and eps 0):
// dp = dprobs (or 0) plus the weights' gradients (the quotient rule when renormalised), then
// through the scores: softmax dl = p * (dp - <p, dp>), sigmoid dl = dp * p * (1 - p).
template <int VPT, typename TOut, bool kSigmoid>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_backward_kernel(const float* __restrict__ dweight, const float* __restrict__ dprobs,
                           const float* __restrict__ probs, const int32_t* __restrict__ idx, int64_t T, int E, int K,
                           bool norm, float scaling, float eps, TOut* __restrict__ dlogits) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* pr = probs + t * E;
  const int32_t* id = idx + t * K;
  const float* dw = dweight + t * K;
  float p[VPT], dp[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? pr[e] : 0.f;
    dp[i] = (e < E && dprobs) ? dprobs[t * E + e] : 0.f;
  }
  float s = 1.f, dot = 0.f;
  if (norm) {
    float ss = 0.f;
    for (int j = lane; j < K; j += 32) {
      const int e = id[j];
      ss += (e >= 0 && e < E) ? pr[e] : 0.f;
    }
    s = warp_sum(ss) + eps;
    float dd = 0.f;
    for (int j = lane; j < K; j += 32) {
      const int e = id[j];
      dd += dw[j] * scaling * ((e >= 0 && e < E) ? pr[e] : 0.f) / s;
    }
    dot = warp_sum(dd);  // sum_j dw_j * w_j
  }
  for (int j = 0; j < K; ++j) {
    const int e = id[j];
    const float g = norm ? (scaling * dw[j] - dot) / s : scaling * dw[j];
#pragma unroll
    for (int i = 0; i < VPT; ++i) dp[i] += (lane + 32 * i == e) ? g : 0.f;  // a select: dp stays in registers
  }
  float pdp = 0.f;
  if (!kSigmoid) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) pdp += p[i] * dp[i];
    pdp = warp_sum(pdp);
  }
  TOut* out = dlogits + t * E;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    if (e < E) out[e] = from_float<TOut>(kSigmoid ? dp[i] * p[i] * (1.f - p[i]) : p[i] * (dp[i] - pdp));
  }
}

// DeepSeek-V3's router (ops.h: router_sigmoid_forward), one warp per row as above: s =
// sigmoid(l), c = s + bias; with groups, each group's two largest c (a warp merge of every
// lane's top two in the group), lane g holding group g's sum; topk_group rounds of a warp
// arg-max over those lanes (ties to the lower group) mark the kept groups, and every other
// expert's c becomes 0 (as HF); then K rounds of arg-max over c as router_forward_kernel,
// each pick's weight its unbiased s, scaled (and renormalised) by the lane that wrote it.
template <int VPT, typename TIn>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_sigmoid_forward_kernel(const TIn* __restrict__ logits, const float* __restrict__ bias, int64_t T, int E,
                                  int K, int G, int TG, bool norm, float scaling, float* __restrict__ probs,
                                  int32_t* __restrict__ idx, float* __restrict__ weight) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T) return;
  const TIn* l = logits + t * E;
  float* p = probs + t * E;
  float s[VPT], c[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int e = lane + 32 * i;
    if (e < E) {
      s[i] = 1.f / (1.f + expf(-to_float(l[e])));
      p[e] = s[i];
      c[i] = bias ? s[i] + bias[e] : s[i];
    } else {
      s[i] = 0.f;
      c[i] = -INFINITY;  // padding: below every score, never picked
    }
  }
  if (G > 1) {
    const int per = E / G;
    float gscore = -INFINITY;  // lane g: group g's score
    for (int g = 0; g < G; ++g) {
      float m1 = -INFINITY, m2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int e = lane + 32 * i;
        if (e < E && e / per == g) {
          if (c[i] > m1) {
            m2 = m1;
            m1 = c[i];
          } else if (c[i] > m2) {
            m2 = c[i];
          }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {  // merge two lanes' top two
        const float o1 = __shfl_xor_sync(0xffffffffu, m1, o), o2 = __shfl_xor_sync(0xffffffffu, m2, o);
        const float hi = fmaxf(m1, o1);
        m2 = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
        m1 = hi;
      }
      if (lane == g) gscore = m1 + m2;
    }
    unsigned keep = 0;
    bool group_taken = false;
    for (int j = 0; j < TG; ++j) {
      float bs = (lane < G && !group_taken) ? gscore : -INFINITY;
      int bg = lane < G && !group_taken ? lane : INT_MAX;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float os = __shfl_xor_sync(0xffffffffu, bs, o);
        const int og = __shfl_xor_sync(0xffffffffu, bg, o);
        if (os > bs || (os == bs && og < bg)) {
          bs = os;
          bg = og;
        }
      }
      keep |= 1u << bg;
      if (lane == bg) group_taken = true;
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((keep >> (e / per)) & 1u)) c[i] = 0.f;
    }
  }
  const float sum = warp_pick_top_k<VPT>(c, s, lane, K, idx + t * K, weight + t * K);
  const float f = norm ? scaling / (sum + 1e-20f) : scaling;
  for (int j = lane; j < K; j += 32) weight[t * K + j] = weight[t * K + j] * f;  // this lane's own picks
}

// Calls f(std::integral_constant<int, VPT>) for the smallest VPT with 32 * VPT >= E.
template <typename F>
void with_vpt(int E, F&& f) {
  if (E <= 32) f(std::integral_constant<int, 1>{});
  else if (E <= 64) f(std::integral_constant<int, 2>{});
  else if (E <= 128) f(std::integral_constant<int, 4>{});
  else if (E <= 256) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 16>{});
}

}  // namespace

void launch_router_forward(const void* logits, bool logits_bf16, const float* bias, int64_t T, int E, int K,
                           bool norm_topk_prob, float* probs, int32_t* idx, float* weight, cudaStream_t stream) {
  if (T == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
  with_vpt(E, [&](auto vpt) {
    constexpr int V = decltype(vpt)::value;
    if (logits_bf16) {
      router_forward_kernel<V, __nv_bfloat16><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(logits), bias, T, E, K, norm_topk_prob, probs, idx, weight);
    } else {
      router_forward_kernel<V, float><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const float*>(logits), bias, T, E, K, norm_topk_prob, probs, idx, weight);
    }
  });
}

namespace {

template <bool kSigmoid>
void launch_backward(const float* dweight, const float* dprobs, const float* probs, const int32_t* idx, int64_t T,
                     int E, int K, bool norm_topk_prob, float scaling, float eps, void* dlogits, bool out_bf16,
                     cudaStream_t stream) {
  if (T == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
  with_vpt(E, [&](auto vpt) {
    constexpr int V = decltype(vpt)::value;
    if (out_bf16) {
      router_backward_kernel<V, __nv_bfloat16, kSigmoid><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          dweight, dprobs, probs, idx, T, E, K, norm_topk_prob, scaling, eps, static_cast<__nv_bfloat16*>(dlogits));
    } else {
      router_backward_kernel<V, float, kSigmoid><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          dweight, dprobs, probs, idx, T, E, K, norm_topk_prob, scaling, eps, static_cast<float*>(dlogits));
    }
  });
}

}  // namespace

void launch_router_backward(const float* dweight, const float* dprobs, const float* probs, const int32_t* idx,
                            int64_t T, int E, int K, bool norm_topk_prob, void* dlogits, bool out_bf16,
                            cudaStream_t stream) {
  launch_backward<false>(dweight, dprobs, probs, idx, T, E, K, norm_topk_prob, 1.f, 0.f, dlogits, out_bf16, stream);
}

void launch_router_sigmoid_forward(const void* logits, bool logits_bf16, const float* bias, int64_t T, int E, int K,
                                   int n_group, int topk_group, bool norm_topk_prob, float scaling, float* probs,
                                   int32_t* idx, float* weight, cudaStream_t stream) {
  if (T == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
  with_vpt(E, [&](auto vpt) {
    constexpr int V = decltype(vpt)::value;
    if (logits_bf16) {
      router_sigmoid_forward_kernel<V, __nv_bfloat16><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(logits), bias, T, E, K, n_group, topk_group, norm_topk_prob, scaling,
          probs, idx, weight);
    } else {
      router_sigmoid_forward_kernel<V, float><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          static_cast<const float*>(logits), bias, T, E, K, n_group, topk_group, norm_topk_prob, scaling, probs, idx,
          weight);
    }
  });
}

void launch_router_sigmoid_backward(const float* dweight, const float* dprobs, const float* probs,
                                    const int32_t* idx, int64_t T, int E, int K, bool norm_topk_prob, float scaling,
                                    void* dlogits, bool out_bf16, cudaStream_t stream) {
  launch_backward<true>(dweight, dprobs, probs, idx, T, E, K, norm_topk_prob, scaling, 1e-20f, dlogits, out_bf16,
                        stream);
}

}  // namespace moetrain::ops::cuda
