// MoE auxiliary losses: Hugging Face load balancing and the ST-MoE router z-loss.
//
// Load balancing reproduces transformers' load_balancing_loss_func (Qwen3-MoE, no
// attention mask), whose steps are
//   logits  = cat(gate_logits of every routed layer, dim=0)        [R, E]
//   routing_weights = softmax(logits)                              [R, E]
//   expert_mask = one_hot(topk(routing_weights, K).indices, E)     [R, K, E]
//   tokens_per_expert = mean(expert_mask, dim=0)                   [K, E]
//   router_prob_per_expert = mean(routing_weights, dim=0)          [E]
//   loss = sum(tokens_per_expert * router_prob_per_expert) * E
// and the model adds router_aux_loss_coef * loss. Summing the mask mean over K gives
// n_e / R (n_e = top-k selections of expert e, each row picks an expert at most once), so
//   loss = coef * E * sum_e (n_e / R) * (P_e / R),   P_e = sum_r probs[r, e].
// The layers contribute additively to n_e and P_e, so each layer accumulates them here
// and the engine forms the scalar once all layers ran. top-k is piecewise constant, so
//   d loss / d probs[r, e] = coef * E * n_e / R^2   (the same for every row r)
// which router_backward then carries through the softmax.
//
// z-loss (ST-MoE): loss_sum = sum_r lse(logits[r])^2;
//   d/dlogits[r] = 2 lse[r] softmax(logits[r]), times the caller's scale (coef / R).
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/arg_checks.h"
#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {

void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum) {
  MT_CHECK(probs.defined() && probs.ndim() == 2, "load_balance_accumulate: probs must be [R, E], got {}",
           probs.str());
  const int64_t R = probs.size(0), E = probs.size(1);
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2 && topk_idx.size(0) == R,
           "load_balance_accumulate: topk_idx must be [R = {}, K], got {}", R, topk_idx.str());
  check_dtype(topk_idx, DType::I32, "load_balance_accumulate topk_idx");
  check_shape(selections, {E}, "load_balance_accumulate selections");
  check_shape(prob_sum, {E}, "load_balance_accumulate prob_sum");
  check_same_dtype("load_balance_accumulate (probs, selections, prob_sum)", probs.dtype(), {&selections, &prob_sum});
  const int64_t K = topk_idx.size(1);
  const int32_t* idx = topk_idx.data<int32_t>();
  std::vector<int64_t> n(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < R * K; ++i) {
    MT_CHECK(idx[i] >= 0 && idx[i] < E, "load_balance_accumulate: topk_idx[{}, {}] = {} is not an expert in [0, {})",
             i / K, i % K, idx[i], E);
    ++n[idx[i]];
  }
  dispatch_float(probs.dtype(), "load_balance_accumulate", [&](auto tag) {
    using F = decltype(tag);
    const F* p = probs.data<F>();
    F* sel = selections.data<F>();
    F* ps = prob_sum.data<F>();
    // Column sums in double; each expert's sum runs over rows in order (deterministic).
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t r = 0; r < R; ++r) s += static_cast<double>(p[r * E + e]);
      ps[e] = static_cast<F>(static_cast<double>(ps[e]) + s);
      sel[e] = static_cast<F>(static_cast<double>(sel[e]) + static_cast<double>(n[e]));
    }
  });
}

Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef) {
  MT_CHECK(selections.defined() && selections.ndim() == 1, "load_balance_backward: selections must be [E], got {}",
           selections.str());
  MT_CHECK(rows >= 0 && total_rows > 0, "load_balance_backward: rows = {} and total_rows = {} must be >= 0 and > 0",
           rows, total_rows);
  const int64_t E = selections.size(0);
  Tensor dprobs = Tensor::empty({rows, E}, selections.dtype());
  dispatch_float(selections.dtype(), "load_balance_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* sel = selections.data<F>();
    F* d = dprobs.data<F>();
    const double R = static_cast<double>(total_rows);
    std::vector<F> g(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) g[e] = static_cast<F>(coef * static_cast<double>(E) * static_cast<double>(sel[e]) / (R * R));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < E; ++e) d[r * E + e] = g[e];
    }
  });
  return dprobs;
}

Tensor router_entropy_sum(const Tensor& probs) {
  MT_CHECK(probs.defined() && probs.ndim() == 2, "router_entropy_sum: probs must be [R, E], got {}", probs.str());
  const int64_t R = probs.size(0), E = probs.size(1);
  Tensor out = Tensor::empty({1}, probs.dtype());
  dispatch_float(probs.dtype(), "router_entropy_sum", [&](auto tag) {
    using F = decltype(tag);
    const F* P = probs.data<F>();
    double total = 0;  // rows added in order: deterministic
    for (int64_t r = 0; r < R; ++r) {  // serial: R x E logs are cheap, a parallel region here is not
      double s = 0;
      for (int64_t e = 0; e < E; ++e) {
        const double p = static_cast<double>(P[r * E + e]);
        if (p > 0) s -= p * std::log(p);
      }
      total += s;
    }
    out.data<F>()[0] = static_cast<F>(total);
  });
  return out;
}

ZLossOut router_z_loss_forward(const Tensor& logits) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "router_z_loss_forward: logits must be [R, E], got {}",
           logits.str());
  const int64_t R = logits.size(0), E = logits.size(1);
  ZLossOut out;
  out.lse = Tensor::empty({R}, logits.dtype());
  out.loss_sum = Tensor::empty({1}, logits.dtype());
  dispatch_float(logits.dtype(), "router_z_loss_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* L = logits.data<F>();
    F* lse = out.lse.data<F>();
    std::vector<double> sq(static_cast<size_t>(R));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const F* l = L + r * E;
      double mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(l[e]) - mx);
      const double z = mx + std::log(s);
      lse[r] = static_cast<F>(z);
      sq[r] = z * z;
    }
    double total = 0;  // summed in row order: deterministic
    for (int64_t r = 0; r < R; ++r) total += sq[r];
    out.loss_sum.data<F>()[0] = static_cast<F>(total);
  });
  return out;
}

Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale) {
  MT_CHECK(probs.defined() && probs.ndim() == 2, "router_z_loss_backward: probs must be [R, E], got {}", probs.str());
  const int64_t R = probs.size(0), E = probs.size(1);
  check_shape(lse, {R}, "router_z_loss_backward lse");
  check_same_dtype("router_z_loss_backward", probs.dtype(), {&lse});
  Tensor d = Tensor::empty({R, E}, probs.dtype());
  dispatch_float(probs.dtype(), "router_z_loss_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* p = probs.data<F>();
    const F* z = lse.data<F>();
    F* out = d.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const double c = scale * 2.0 * static_cast<double>(z[r]);
      for (int64_t e = 0; e < E; ++e) out[r * E + e] = static_cast<F>(c * static_cast<double>(p[r * E + e]));
    }
  });
  return d;
}

}  // namespace moetrain::ops::cpu

// ---- DeepSeek-V3's sequence-wise balance loss (ops.h) -------------------------------------
namespace moetrain::ops::cpu {
namespace {

// Each sequence's selections of each expert, f64 [B, E] (every expert id checked).
std::vector<double> selections(const char* op, const Tensor& topk_idx, int64_t batch, int64_t E) {
  const int64_t R = topk_idx.size(0), K = topk_idx.size(1), S = R / batch;
  const int32_t* idx = topk_idx.data<int32_t>();
  std::vector<double> n(static_cast<size_t>(batch * E), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[r * K + k];
      MT_CHECK(e >= 0 && e < E, "{}: topk_idx[{}, {}] = {} is not an expert in [0, {})", op, r, k, e, E);
      n[static_cast<size_t>((r / S) * E + e)] += 1;
    }
  }
  return n;
}

// Checks the arguments; returns the S the sums divide by (the whole sequences' under
// context parallelism), and fills f [B, E] (E / (K S) times each sequence's selections).
int64_t seq_balance_counts(const char* op, const Tensor& probs, const Tensor& topk_idx, int64_t batch,
                           const SeqBalanceWhole& whole, std::vector<double>& f) {
  int64_t S = check_seq_balance_args(op, probs, topk_idx, batch);
  const int64_t E = probs.size(1), K = topk_idx.size(1);
  if (whole.counts.defined()) {
    MT_CHECK(whole.counts.dtype() == DType::F64 && whole.counts.numel() == batch * E,
             "{}: whole.counts is {}, expected f64 [{}, {}] (seq_balance_counts)", op, whole.counts.str(), batch, E);
    MT_CHECK(whole.seq >= S, "{}: whole.seq = {} is shorter than this rank's part of a sequence ({})", op, whole.seq, S);
    f = whole.counts.to_double_vector();
    S = whole.seq;
  } else {
    f = selections(op, topk_idx, batch, E);
  }
  for (double& x : f) x *= static_cast<double>(E) / static_cast<double>(K * S);
  return S;
}

}  // namespace

Tensor seq_balance_counts(const Tensor& topk_idx, int64_t batch, int64_t experts) {
  MT_CHECK(topk_idx.ndim() == 2 && topk_idx.dtype() == DType::I32 && batch > 0 && topk_idx.size(0) % batch == 0,
           "seq_balance_counts: topk_idx {} must be i32 [batch * S, K] with batch = {}", topk_idx.str(), batch);
  return Tensor::from_vector(selections("seq_balance_counts", topk_idx, batch, experts), {batch, experts});
}

Tensor seq_balance_loss_sum(const Tensor& probs, const Tensor& topk_idx, int64_t batch, const SeqBalanceWhole& whole) {
  std::vector<double> f;
  const int64_t S = seq_balance_counts("seq_balance_loss_sum", probs, topk_idx, batch, whole, f);
  const int64_t n = probs.size(0) / batch;  // this rank's tokens of a sequence
  const int64_t R = probs.size(0), E = probs.size(1);
  Tensor out = Tensor::empty({1}, probs.dtype());
  dispatch_float(probs.dtype(), "seq_balance_loss_sum", [&](auto tag) {
    using F = decltype(tag);
    const F* p = probs.data<F>();
    double total = 0;
    for (int64_t r = 0; r < R; ++r) {
      double z = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) {
        z += static_cast<double>(p[r * E + e]);
        dot += f[static_cast<size_t>((r / n) * E + e)] * static_cast<double>(p[r * E + e]);
      }
      total += dot / z / static_cast<double>(S);
    }
    out.data<F>()[0] = static_cast<F>(total);
  });
  return out;
}

Tensor seq_balance_backward(const Tensor& probs, const Tensor& topk_idx, int64_t batch, double scale,
                            const SeqBalanceWhole& whole) {
  std::vector<double> f;
  const int64_t S = seq_balance_counts("seq_balance_backward", probs, topk_idx, batch, whole, f);
  const int64_t n = probs.size(0) / batch;  // this rank's tokens of a sequence
  const int64_t R = probs.size(0), E = probs.size(1);
  Tensor d = Tensor::empty({R, E}, probs.dtype());
  dispatch_float(probs.dtype(), "seq_balance_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* p = probs.data<F>();
    F* g = d.data<F>();
    for (int64_t r = 0; r < R; ++r) {
      const double* fr = f.data() + (r / n) * E;
      double z = 0, dot = 0;
      for (int64_t e = 0; e < E; ++e) {
        z += static_cast<double>(p[r * E + e]);
        dot += fr[e] * static_cast<double>(p[r * E + e]);
      }
      for (int64_t e = 0; e < E; ++e) g[r * E + e] = static_cast<F>(scale / static_cast<double>(S) * (fr[e] - dot / z) / z);
    }
  });
  return d;
}

}  // namespace moetrain::ops::cpu
