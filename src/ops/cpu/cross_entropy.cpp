// Softmax cross-entropy over a vocabulary, with ignore index -100.
//
// logits [T, V], targets i32 [T]:
//   forward:  lse[t] = log sum_v exp(logits[t,v]);
//             loss_sum = sum over t with target != -100 of (lse[t] - logits[t, target[t]])
//   backward: dlogits[t,v] = scale * (exp(logits[t,v] - lse[t]) - [v == target[t]]),
//             and 0 for the rows whose target is -100.
// Row reductions are in double; per-row losses are summed in row order (deterministic).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// Checks logits [T, V] and targets i32 [T] with entries in [0, V) or -100.
const int32_t* checked_targets(const Tensor& logits, const Tensor& targets, const char* op) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "{}: logits must be [T, V], got {}", op, logits.str());
  const int64_t T = logits.size(0), V = logits.size(1);
  check_shape(targets, {T}, "targets");
  check_dtype(targets, DType::I32, "targets");
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    MT_CHECK(tg[t] == kIgnoreIndex || (tg[t] >= 0 && tg[t] < V),
             "{}: target {} at position {} is outside [0, {}) and is not the ignore index {}", op, tg[t], t, V,
             kIgnoreIndex);
  }
  return tg;
}

}  // namespace

CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets) {
  const int32_t* tg = checked_targets(logits, targets, "cross_entropy_forward");
  const int64_t T = logits.size(0), V = logits.size(1);
  MT_CHECK(V > 0 || T == 0, "cross_entropy_forward: logits {} have an empty vocabulary", logits.str());
  CrossEntropyOut o{Tensor::empty({1}, logits.dtype()), Tensor::empty({T}, logits.dtype())};
  std::vector<double> row_loss(T, 0.0);
  dispatch_float(logits.dtype(), "cross_entropy_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* px = logits.data<F>();
    F* plse = o.lse.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* x = px + t * V;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < V; ++i) mx = std::max(mx, double(x[i]));
      double sum = 0;
      for (int64_t i = 0; i < V; ++i) sum += std::exp(double(x[i]) - mx);
      const double lse = mx + std::log(sum);
      plse[t] = F(lse);
      if (tg[t] != kIgnoreIndex) row_loss[t] = lse - double(x[tg[t]]);
    }
    double total = 0;
    for (int64_t t = 0; t < T; ++t) total += row_loss[t];
    o.loss_sum.data<F>()[0] = F(total);
  });
  return o;
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale) {
  const int32_t* tg = checked_targets(logits, targets, "cross_entropy_backward");
  const int64_t T = logits.size(0), V = logits.size(1);
  check_shape(lse, {T}, "lse");
  check_same_dtype("cross_entropy_backward", logits.dtype(), {&lse});
  Tensor dlogits = Tensor::empty(logits.shape(), logits.dtype());
  dispatch_float(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using F = decltype(tag);
    const F *px = logits.data<F>(), *plse = lse.data<F>();
    F* pd = dlogits.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* d = pd + t * V;
      if (tg[t] == kIgnoreIndex) {
        std::fill(d, d + V, F(0));
        continue;
      }
      const F* x = px + t * V;
      const double l = double(plse[t]);
      for (int64_t i = 0; i < V; ++i) d[i] = F(scale * std::exp(double(x[i]) - l));
      d[tg[t]] = F(scale * (std::exp(double(x[tg[t]]) - l) - 1.0));
    }
  });
  return dlogits;
}

}  // namespace moetrain::ops::cpu
