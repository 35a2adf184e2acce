// Router: softmax -> top-k -> optional renormalisation (HF Qwen3-MoE / Mixtral gate).
//
// Forward, per row t of logits [T, E]:
//   p = softmax(l)                     (max-subtracted, accumulated in double)
//   idx[t, :] = the K experts of largest p (+ bias, when a selection bias is given),
//               descending, ties to the lower expert id
//   w[t, k] = p[idx_k]                 or, when norm_topk_prob, p[idx_k] / S, S = sum_j p[idx_j]
// Backward (top-k selection is piecewise constant, so idx is a constant):
//   without norm: dp[idx_k] += dw_k
//   with norm:    dp[idx_k] += (dw_k - sum_j dw_j w_j) / S        (quotient rule)
//   dp += dprobs (the extra gradient, e.g. from the load-balancing loss), then softmax:
//   dl = p * (dp - sum_e p_e dp_e)
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {

RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob, const Tensor& selection_bias) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "router_forward: logits must be [T, E], got {}", logits.str());
  const int64_t T = logits.size(0), E = logits.size(1);
  MT_CHECK(k >= 1 && k <= E, "router_forward: top_k = {} must be in [1, num_experts = {}]", k, E);
  if (selection_bias.defined()) {
    check_shape(selection_bias, {E}, "router_forward selection_bias");
    check_dtype(selection_bias, DType::F32, "router_forward selection_bias");
  }
  const float* bias = selection_bias.defined() ? selection_bias.data<float>() : nullptr;
  RouterOut out;
  out.probs = Tensor::empty({T, E}, logits.dtype());
  out.topk_idx = Tensor::empty({T, k}, DType::I32);
  out.topk_weight = Tensor::empty({T, k}, logits.dtype());
  dispatch_float(logits.dtype(), "router_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* L = logits.data<F>();
    F* P = out.probs.data<F>();
    int32_t* I = out.topk_idx.data<int32_t>();
    F* W = out.topk_weight.data<F>();
#pragma omp parallel
    {
      std::vector<int32_t> order(static_cast<size_t>(E));
      std::vector<double> score(static_cast<size_t>(E));  // what the choice ranks: p (+ bias)
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        const F* l = L + t * E;
        F* p = P + t * E;
        double mx = -INFINITY;
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]) - mx);
        for (int64_t e = 0; e < E; ++e) p[e] = static_cast<F>(std::exp(static_cast<double>(l[e]) - mx) / sum);
        for (int64_t e = 0; e < E; ++e) score[e] = static_cast<double>(p[e]) + (bias ? static_cast<double>(bias[e]) : 0.0);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
          return score[a] > score[b] || (score[a] == score[b] && a < b);
        });
        double s = 0;
        for (int64_t j = 0; j < k; ++j) s += static_cast<double>(p[order[j]]);
        for (int64_t j = 0; j < k; ++j) {
          I[t * k + j] = order[j];
          double w = static_cast<double>(p[order[j]]);
          W[t * k + j] = static_cast<F>(norm_topk_prob ? w / s : w);
        }
      }
    }
  });
  return out;
}

Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd, bool norm_topk_prob) {
  MT_CHECK(fwd.probs.defined() && fwd.probs.ndim() == 2, "router_backward: fwd.probs must be [T, E], got {}",
           fwd.probs.str());
  const int64_t T = fwd.probs.size(0), E = fwd.probs.size(1);
  MT_CHECK(fwd.topk_idx.defined() && fwd.topk_idx.ndim() == 2 && fwd.topk_idx.size(0) == T,
           "router_backward: fwd.topk_idx must be [T = {}, K], got {}", T, fwd.topk_idx.str());
  check_dtype(fwd.topk_idx, DType::I32, "router_backward fwd.topk_idx");
  const int64_t K = fwd.topk_idx.size(1);
  const int32_t* idx_all = fwd.topk_idx.data<int32_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    MT_CHECK(idx_all[i] >= 0 && idx_all[i] < E, "router_backward: fwd.topk_idx[{}] = {} is not an expert in [0, {})",
             i, idx_all[i], E);
  }
  check_shape(dtopk_weight, {T, K}, "router_backward dtopk_weight");
  if (dprobs.defined()) check_shape(dprobs, {T, E}, "router_backward dprobs");
  check_same_dtype("router_backward", fwd.probs.dtype(), {&dtopk_weight, &dprobs});
  Tensor dlogits = Tensor::empty({T, E}, fwd.probs.dtype());
  dispatch_float(fwd.probs.dtype(), "router_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* P = fwd.probs.data<F>();
    const int32_t* I = fwd.topk_idx.data<int32_t>();
    const F* DW = dtopk_weight.data<F>();
    const F* DP = dprobs.defined() ? dprobs.data<F>() : nullptr;
    F* DL = dlogits.data<F>();
#pragma omp parallel
    {
      std::vector<double> dp(static_cast<size_t>(E));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        const F* p = P + t * E;
        const int32_t* idx = I + t * K;
        const F* dw = DW + t * K;
        for (int64_t e = 0; e < E; ++e) dp[e] = DP ? static_cast<double>(DP[t * E + e]) : 0.0;
        if (norm_topk_prob) {
          double s = 0, dot = 0;
          for (int64_t j = 0; j < K; ++j) s += static_cast<double>(p[idx[j]]);
          for (int64_t j = 0; j < K; ++j) dot += static_cast<double>(dw[j]) * static_cast<double>(p[idx[j]]);
          dot /= s;  // sum_j dw_j w_j
          for (int64_t j = 0; j < K; ++j) dp[idx[j]] += (static_cast<double>(dw[j]) - dot) / s;
        } else {
          for (int64_t j = 0; j < K; ++j) dp[idx[j]] += static_cast<double>(dw[j]);
        }
        double pdp = 0;
        for (int64_t e = 0; e < E; ++e) pdp += static_cast<double>(p[e]) * dp[e];
        for (int64_t e = 0; e < E; ++e) DL[t * E + e] = static_cast<F>(static_cast<double>(p[e]) * (dp[e] - pdp));
      }
    }
  });
  return dlogits;
}

}  // namespace moetrain::ops::cpu
