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

// Checks a shard's logits [T, Vs] of a vocabulary of shard.size and targets i32 [T] in
// [0, size) or -100.
const int32_t* checked_shard(const Tensor& logits, const Tensor& targets, const VocabShard& shard, const char* op) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "{}: logits must be [T, Vs], got {}", op, logits.str());
  const int64_t T = logits.size(0), Vs = logits.size(1);
  MT_CHECK((Vs > 0 || T == 0) && shard.begin >= 0 && shard.begin + Vs <= shard.size,
           "{}: logits {} hold columns [{}, {}) that do not lie in a vocabulary of {}", op, logits.str(), shard.begin,
           shard.begin + Vs, shard.size);
  check_shape(targets, {T}, "targets");
  check_dtype(targets, DType::I32, "targets");
  const int32_t* tg = targets.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    MT_CHECK(tg[t] == kIgnoreIndex || (tg[t] >= 0 && tg[t] < shard.size),
             "{}: target {} at position {} is outside [0, {}) and is not the ignore index {}", op, tg[t], t,
             shard.size, kIgnoreIndex);
  }
  return tg;
}

// The whole vocabulary as its one shard: logits [T, V], targets in [0, V) or -100.
const int32_t* checked_targets(const Tensor& logits, const Tensor& targets, const char* op) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "{}: logits must be [T, V], got {}", op, logits.str());
  return checked_shard(logits, targets, {0, logits.size(1)}, op);
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

// The whole vocabulary as its one shard (below).
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale) {
  checked_targets(logits, targets, "cross_entropy_backward");
  return vocab_shard_backward(logits, targets, lse, {0, logits.size(1)}, scale);
}

// ---- a vocabulary split across ranks (ops.h) --------------------------------------------


VocabShardStats vocab_shard_stats(const Tensor& logits, const Tensor& targets, const VocabShard& shard) {
  const int32_t* tg = checked_shard(logits, targets, shard, "vocab_shard_stats");
  const int64_t T = logits.size(0), Vs = logits.size(1);
  VocabShardStats o{Tensor::empty({T}, logits.dtype()), Tensor::empty({T}, logits.dtype())};
  dispatch_float(logits.dtype(), "vocab_shard_stats", [&](auto tag) {
    using F = decltype(tag);
    const F* px = logits.data<F>();
    F *plse = o.lse.data<F>(), *ptl = o.target_logit.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* x = px + t * Vs;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < Vs; ++i) mx = std::max(mx, double(x[i]));
      double sum = 0;
      for (int64_t i = 0; i < Vs; ++i) sum += std::exp(double(x[i]) - mx);
      plse[t] = F(mx + std::log(sum));
      const int64_t local = static_cast<int64_t>(tg[t]) - shard.begin;
      ptl[t] = tg[t] != kIgnoreIndex && local >= 0 && local < Vs ? x[local] : F(0);
    }
  });
  return o;
}

// lse = log sum_r exp(lse_r) (from the largest), target logit = sum_r of the shards' (one is
// not 0); per-row losses summed in row order.
CrossEntropyOut vocab_parallel_loss(const Tensor& shard_lse, const Tensor& shard_target_logit, const Tensor& targets) {
  const char* op = "vocab_parallel_loss";
  MT_CHECK(shard_lse.defined() && shard_lse.ndim() == 2, "{}: shard_lse must be [R, T], got {}", op, shard_lse.str());
  const int64_t R = shard_lse.size(0), T = shard_lse.size(1);
  check_shape(shard_target_logit, {R, T}, "shard_target_logit");
  check_same_dtype(op, shard_lse.dtype(), {&shard_target_logit});
  check_shape(targets, {T}, "targets");
  check_dtype(targets, DType::I32, "targets");
  const int32_t* tg = targets.data<int32_t>();
  CrossEntropyOut o{Tensor::empty({1}, shard_lse.dtype()), Tensor::empty({T}, shard_lse.dtype())};
  dispatch_float(shard_lse.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    const F *pl = shard_lse.data<F>(), *ptl = shard_target_logit.data<F>();
    F* plse = o.lse.data<F>();
    double total = 0;
    for (int64_t t = 0; t < T; ++t) {
      double mx = -std::numeric_limits<double>::infinity(), x_tg = 0;
      for (int64_t r = 0; r < R; ++r) mx = std::max(mx, double(pl[r * T + t]));
      double sum = 0;
      for (int64_t r = 0; r < R; ++r) {
        sum += std::exp(double(pl[r * T + t]) - mx);
        x_tg += double(ptl[r * T + t]);
      }
      const double lse = mx + std::log(sum);
      plse[t] = F(lse);
      if (tg[t] != kIgnoreIndex) total += lse - x_tg;
    }
    o.loss_sum.data<F>()[0] = F(total);
  });
  return o;
}

Tensor vocab_shard_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const VocabShard& shard,
                            double scale) {
  const int32_t* tg = checked_shard(logits, targets, shard, "vocab_shard_backward");
  const int64_t T = logits.size(0), Vs = logits.size(1);
  check_shape(lse, {T}, "lse");
  check_same_dtype("vocab_shard_backward", logits.dtype(), {&lse});
  Tensor dlogits = Tensor::empty(logits.shape(), logits.dtype());
  dispatch_float(logits.dtype(), "vocab_shard_backward", [&](auto tag) {
    using F = decltype(tag);
    const F *px = logits.data<F>(), *plse = lse.data<F>();
    F* pd = dlogits.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* d = pd + t * Vs;
      if (tg[t] == kIgnoreIndex) {
        std::fill(d, d + Vs, F(0));
        continue;
      }
      const F* x = px + t * Vs;
      const double l = double(plse[t]);
      const int64_t local = static_cast<int64_t>(tg[t]) - shard.begin;
      for (int64_t i = 0; i < Vs; ++i) d[i] = F(scale * (std::exp(double(x[i]) - l) - (i == local ? 1.0 : 0.0)));
    }
  });
  return dlogits;
}

}  // namespace moetrain::ops::cpu
