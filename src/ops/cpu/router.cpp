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
#include <string>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

struct BackwardDims {
  int64_t T, E, K;
};

// A router backward's arguments against its forward's outputs (both routers' backwards
// take the same ones, every expert id checked); names in errors are `op`'s.
BackwardDims check_backward(const char* op, const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd) {
  const std::string n = op;
  MT_CHECK(fwd.probs.defined() && fwd.probs.ndim() == 2, "{}: fwd.probs must be [T, E], got {}", op, fwd.probs.str());
  const int64_t T = fwd.probs.size(0), E = fwd.probs.size(1);
  MT_CHECK(fwd.topk_idx.defined() && fwd.topk_idx.ndim() == 2 && fwd.topk_idx.size(0) == T,
           "{}: fwd.topk_idx must be [T = {}, K], got {}", op, T, fwd.topk_idx.str());
  check_dtype(fwd.topk_idx, DType::I32, (n + " fwd.topk_idx").c_str());
  const int64_t K = fwd.topk_idx.size(1);
  const int32_t* idx_all = fwd.topk_idx.data<int32_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    MT_CHECK(idx_all[i] >= 0 && idx_all[i] < E, "{}: fwd.topk_idx[{}] = {} is not an expert in [0, {})", op, i,
             idx_all[i], E);
  }
  check_shape(dtopk_weight, {T, K}, (n + " dtopk_weight").c_str());
  if (dprobs.defined()) check_shape(dprobs, {T, E}, (n + " dprobs").c_str());
  check_same_dtype(op, fwd.probs.dtype(), {&dtopk_weight, &dprobs});
  return {T, E, K};
}

}  // namespace

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
  const BackwardDims dims = check_backward("router_backward", dtopk_weight, dprobs, fwd);
  const int64_t T = dims.T, E = dims.E, K = dims.K;
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


// DeepSeek-V3's router: sigmoid scores, group-limited top-k (ops.h has the forward's rules).
//
// Backward (the choice is piecewise constant, so idx is a constant), per row:
//   without norm: ds[idx_k] += scaling * dw_k
//   with norm:    D = sum_j s[idx_j] + 1e-20, w_k = scaling * s[idx_k] / D:
//                 ds[idx_k] += scaling * dw_k / D - sum_j dw_j w_j / D      (quotient rule)
//   ds += dprobs (the extra gradient), then the sigmoid: dl = ds * s * (1 - s)
RouterOut router_sigmoid_forward(const Tensor& logits, const Tensor& bias, int64_t k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk_prob, double scaling) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "router_sigmoid_forward: logits must be [T, E], got {}",
           logits.str());
  const int64_t T = logits.size(0), E = logits.size(1);
  MT_CHECK(n_group >= 1 && E % n_group == 0 && (n_group == 1 || E / n_group >= 2),
           "router_sigmoid_forward: n_group = {} must divide num_experts = {} into groups of 2 or more", n_group, E);
  MT_CHECK(topk_group >= 1 && topk_group <= n_group, "router_sigmoid_forward: topk_group = {} must be in [1, n_group = {}]",
           topk_group, n_group);
  MT_CHECK(k >= 1 && k <= E, "router_sigmoid_forward: top_k = {} must be in [1, num_experts = {}]", k, E);
  if (bias.defined()) {
    check_shape(bias, {E}, "router_sigmoid_forward bias");
    check_dtype(bias, DType::F32, "router_sigmoid_forward bias");
  }
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  const int64_t G = n_group, per = E / n_group;
  RouterOut out;
  out.probs = Tensor::empty({T, E}, logits.dtype());
  out.topk_idx = Tensor::empty({T, k}, DType::I32);
  out.topk_weight = Tensor::empty({T, k}, logits.dtype());
  dispatch_float(logits.dtype(), "router_sigmoid_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* L = logits.data<F>();
    F* S = out.probs.data<F>();
    int32_t* I = out.topk_idx.data<int32_t>();
    F* W = out.topk_weight.data<F>();
#pragma omp parallel
    {
      std::vector<double> c(static_cast<size_t>(E)), group(static_cast<size_t>(G));
      std::vector<int32_t> order(static_cast<size_t>(E)), gorder(static_cast<size_t>(G));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        F* s = S + t * E;
        for (int64_t e = 0; e < E; ++e) {
          s[e] = static_cast<F>(1.0 / (1.0 + std::exp(-static_cast<double>(L[t * E + e]))));
          // The choice ranks the scores as stored (F), as HF ranks its f32 scores.
          c[e] = static_cast<double>(s[e]) + (b ? static_cast<double>(b[e]) : 0.0);
        }
        if (G > 1) {
          for (int64_t g = 0; g < G; ++g) {  // the sum of the group's two largest
            double m1 = -INFINITY, m2 = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; ++e) {
              if (c[e] > m1) {
                m2 = m1;
                m1 = c[e];
              } else if (c[e] > m2) {
                m2 = c[e];
              }
            }
            group[g] = m1 + m2;
          }
          std::iota(gorder.begin(), gorder.end(), 0);
          std::partial_sort(gorder.begin(), gorder.begin() + topk_group, gorder.end(), [&](int32_t a, int32_t b2) {
            return group[a] > group[b2] || (group[a] == group[b2] && a < b2);
          });
          for (int64_t j = topk_group; j < G; ++j) {  // the groups past the kept ones: masked
            const int64_t g = gorder[static_cast<size_t>(j)];
            std::fill(c.begin() + g * per, c.begin() + (g + 1) * per, 0.0);
          }
        }
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b2) {
          return c[a] > c[b2] || (c[a] == c[b2] && a < b2);
        });
        double sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += static_cast<double>(s[order[j]]);
        const double denom = norm_topk_prob ? sum + 1e-20 : 1.0;
        for (int64_t j = 0; j < k; ++j) {
          I[t * k + j] = order[j];
          W[t * k + j] = static_cast<F>(scaling * static_cast<double>(s[order[j]]) / denom);
        }
      }
    }
  });
  return out;
}

Tensor router_sigmoid_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                               bool norm_topk_prob, double scaling) {
  const BackwardDims dims = check_backward("router_sigmoid_backward", dtopk_weight, dprobs, fwd);
  const int64_t T = dims.T, E = dims.E, K = dims.K;
  Tensor dlogits = Tensor::empty({T, E}, fwd.probs.dtype());
  dispatch_float(fwd.probs.dtype(), "router_sigmoid_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* S = fwd.probs.data<F>();
    const int32_t* I = fwd.topk_idx.data<int32_t>();
    const F* DW = dtopk_weight.data<F>();
    const F* DP = dprobs.defined() ? dprobs.data<F>() : nullptr;
    F* DL = dlogits.data<F>();
#pragma omp parallel
    {
      std::vector<double> ds(static_cast<size_t>(E));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        const F* s = S + t * E;
        const int32_t* idx = I + t * K;
        const F* dw = DW + t * K;
        for (int64_t e = 0; e < E; ++e) ds[e] = DP ? static_cast<double>(DP[t * E + e]) : 0.0;
        if (norm_topk_prob) {
          double sum = 0, dot = 0;  // dot: sum_j dw_j w_j
          for (int64_t j = 0; j < K; ++j) sum += static_cast<double>(s[idx[j]]);
          const double D = sum + 1e-20;
          for (int64_t j = 0; j < K; ++j) dot += static_cast<double>(dw[j]) * scaling * static_cast<double>(s[idx[j]]) / D;
          for (int64_t j = 0; j < K; ++j) ds[idx[j]] += (scaling * static_cast<double>(dw[j]) - dot) / D;
        } else {
          for (int64_t j = 0; j < K; ++j) ds[idx[j]] += scaling * static_cast<double>(dw[j]);
        }
        for (int64_t e = 0; e < E; ++e) {
          const double se = static_cast<double>(s[e]);
          DL[t * E + e] = static_cast<F>(ds[e] * se * (1.0 - se));
        }
      }
    }
  });
  return dlogits;
}

}  // namespace moetrain::ops::cpu
