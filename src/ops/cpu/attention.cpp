// Causal grouped-query attention (flash-style: no S x S matrix is kept).
//
// Token-major: q [B*S, Hq*D], k [B*S, Hkv*D], v [B*S, Hkv*Dv] (Dv = D unless the shape says
// otherwise), out [B*S, Hq*Dv]; query head h reads kv head
// g = h / (Hq/Hkv). Query s of sequence b may see key j when j <= s and, if segment ids
// are given, seg[b,j] == seg[b,s]. With s_j = scale * q_s . k_j over the visible j:
//   forward:  lse_s = log sum_j exp(s_j),  P_sj = exp(s_j - lse_s),  O_s = sum_j P_sj v_j
//   backward: dP_sj = dO_s . v_j,  Delta_s = dO_s . O_s,  dS_sj = P_sj (dP_sj - Delta_s)
//             dQ_s = scale sum_j dS_sj k_j,  dK_j = scale sum_{h in group, s} dS_sj q_s,
//             dV_j = sum_{h in group, s} P_sj dO_s
// P is recomputed from the saved lse. Forward runs one (batch, query head) per task;
// backward one (batch, kv head) per task, looping its query heads in order, so dK/dV
// are summed by one thread in a fixed order (deterministic, no atomics). Dot products
// and accumulations are in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/arg_checks.h"
#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

void check_heads(const char* op, const AttentionShape& a) {
  MT_CHECK(a.batch >= 0 && a.seq >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0,
           "{}: bad shape batch={} seq={} q_heads={} kv_heads={} head_dim={}", op, a.batch, a.seq, a.q_heads,
           a.kv_heads, a.head_dim);
  MT_CHECK(a.q_heads % a.kv_heads == 0, "{}: q_heads {} is not a multiple of kv_heads {}", op, a.q_heads,
           a.kv_heads);
  MT_CHECK(a.scale > 0 && std::isfinite(a.scale), "{}: softmax scale must be positive, got {}", op, a.scale);
  MT_CHECK(a.v_head_dim >= 0, "{}: v_head_dim must be >= 0 (0: head_dim), got {}", op, a.v_head_dim);
}

void check_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                const AttentionShape& a) {
  check_heads(op, a);
  const int64_t T = a.batch * a.seq;
  check_shape(q, {T, a.q_heads * a.head_dim}, "q");
  check_shape(k, {T, a.kv_heads * a.head_dim}, "k");
  check_shape(v, {T, a.kv_heads * a.value_dim()}, "v");
  if (seg.defined()) {
    check_shape(seg, {T}, "segment_ids");
    check_dtype(seg, DType::I32, "segment_ids");
  }
  check_same_dtype(op, q.dtype(), {&k, &v});
}

template <typename F>
double dot(const F* a, const F* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// The keys of sequence b that query row s may see: rows [begin(s), end(s)) that visible() admits.
struct Visibility {
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  bool causal = true;
  const int32_t* q_seg = nullptr;  // [B*S] or null (then k_seg too)
  const int32_t* k_seg = nullptr;
  int64_t seq = 0;
  int64_t begin(int64_t s) const { return s >= q_begin && s < q_end ? k_begin : 0; }
  int64_t end(int64_t s) const {
    if (s < q_begin || s >= q_end) return 0;
    return causal ? std::min(s + 1, k_end) : k_end;
  }
  bool visible(int64_t b, int64_t s, int64_t j) const { return !q_seg || q_seg[b * seq + s] == k_seg[b * seq + j]; }
};

// The forward over the visible keys; a query that sees none gets out 0 and lse -inf.
AttentionOut forward(const Tensor& q, const Tensor& k, const Tensor& v, const Visibility& vis, const AttentionShape& a) {
  const int64_t B = a.batch, S = a.seq, Sk = a.seq, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim,
                Dv = a.value_dim();
  const int64_t group = Hq / Hkv, qw = Hq * D, kw = Hkv * D, vw = Hkv * Dv, ow = Hq * Dv;
  AttentionOut o{Tensor::empty({B * S, ow}, q.dtype()), Tensor::empty({B, Hq, S}, q.dtype())};
  dispatch_float(q.dtype(), "attention_forward", [&](auto tag) {
    using F = decltype(tag);
    const F *pq = q.data<F>(), *pk = k.data<F>(), *pv = v.data<F>();
    F *po = o.out.data<F>(), *plse = o.lse.data<F>();
#pragma omp parallel
    {
      std::vector<double> sc(Sk), acc(Dv);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * Hq; ++bh) {
        const int64_t b = bh / Hq, h = bh % Hq, g = h / group;
        const F* kb = pk + b * Sk * kw + g * D;
        const F* vb = pv + b * Sk * vw + g * Dv;
        for (int64_t s = 0; s < S; ++s) {
          const F* qs = pq + (b * S + s) * qw + h * D;
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = vis.begin(s); j < vis.end(s); ++j) {
            if (!vis.visible(b, s, j)) continue;
            sc[j] = a.scale * dot(qs, kb + j * kw, D);
            mx = std::max(mx, sc[j]);
          }
          double sum = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = vis.begin(s); j < vis.end(s); ++j) {
            if (!vis.visible(b, s, j)) continue;
            const double p = std::exp(sc[j] - mx);
            sum += p;
            const F* vj = vb + j * vw;
            for (int64_t d = 0; d < Dv; ++d) acc[d] += p * double(vj[d]);
          }
          F* os = po + (b * S + s) * ow + h * Dv;
          for (int64_t d = 0; d < Dv; ++d) os[d] = F(sum > 0 ? acc[d] / sum : 0.0);
          plse[bh * S + s] = F(sum > 0 ? mx + std::log(sum) : -std::numeric_limits<double>::infinity());
        }
      }
    }
  });
  return o;
}

// The gradients through the visible keys, from the output and lse over every part.
AttentionGrads backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Visibility& vis, const AttentionShape& a, const char* op) {
  const int64_t B = a.batch, S = a.seq, Sk = a.seq, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim,
                Dv = a.value_dim();
  const int64_t group = Hq / Hkv, qw = Hq * D, kw = Hkv * D, vw = Hkv * Dv, ow = Hq * Dv;
  check_shape(dout, {B * S, ow}, "dout");
  check_shape(out, {B * S, ow}, "out");
  check_shape(lse, {B, Hq, S}, "lse");
  check_same_dtype(op, q.dtype(), {&dout, &out, &lse});
  AttentionGrads gr{Tensor::empty(q.shape(), q.dtype()), Tensor::empty(k.shape(), q.dtype()),
                    Tensor::empty(v.shape(), q.dtype())};
  dispatch_float(q.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    const F *pq = q.data<F>(), *pk = k.data<F>(), *pv = v.data<F>();
    const F *pdo = dout.data<F>(), *po = out.data<F>(), *plse = lse.data<F>();
    F *pdq = gr.dq.data<F>(), *pdk = gr.dk.data<F>(), *pdv = gr.dv.data<F>();
#pragma omp parallel
    {
      std::vector<double> dk(Sk * D), dv(Sk * Dv), dq(D);
#pragma omp for schedule(static)
      for (int64_t bg = 0; bg < B * Hkv; ++bg) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        const F* kb = pk + b * Sk * kw + g * D;
        const F* vb = pv + b * Sk * vw + g * Dv;
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t s = 0; s < S; ++s) {
            const int64_t row = (b * S + s) * qw + h * D, orow = (b * S + s) * ow + h * Dv;
            const F *qs = pq + row, *dos = pdo + orow;
            const double l = double(plse[(b * Hq + h) * S + s]);
            const double delta = dot(dos, po + orow, Dv);
            std::fill(dq.begin(), dq.end(), 0.0);
            for (int64_t j = vis.begin(s); j < vis.end(s); ++j) {
              if (!vis.visible(b, s, j)) continue;
              const F *kj = kb + j * kw, *vj = vb + j * vw;
              const double p = std::exp(a.scale * dot(qs, kj, D) - l);
              const double ds = a.scale * p * (dot(dos, vj, Dv) - delta);  // scale folded in
              double *dkj = dk.data() + j * D, *dvj = dv.data() + j * Dv;
              for (int64_t d = 0; d < D; ++d) {
                dq[d] += ds * double(kj[d]);
                dkj[d] += ds * double(qs[d]);
              }
              for (int64_t d = 0; d < Dv; ++d) dvj[d] += p * double(dos[d]);
            }
            for (int64_t d = 0; d < D; ++d) pdq[row + d] = F(dq[d]);
          }
        }
        for (int64_t j = 0; j < Sk; ++j) {
          for (int64_t d = 0; d < D; ++d) pdk[(b * Sk + j) * kw + g * D + d] = F(dk[j * D + d]);
          for (int64_t d = 0; d < Dv; ++d) pdv[(b * Sk + j) * vw + g * Dv + d] = F(dv[j * Dv + d]);
        }
      }
    }
  });
  return gr;
}

// Self-attention: every query row sees the key rows up to its own, one segment array for both.
Visibility causal(const Tensor& segment_ids, const AttentionShape& a) {
  const int32_t* seg = segment_ids.defined() ? segment_ids.data<int32_t>() : nullptr;
  return {0, a.seq, 0, a.seq, true, seg, seg, a.seq};
}

Visibility part_of(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& p, const AttentionShape& a,
                   const char* op) {
  check_args(op, q, k, v, Tensor(), a);
  check_attention_part(op, p, a);
  return {p.q_begin,
          p.q_end,
          p.k_begin,
          p.k_end,
          p.causal,
          p.q_segments.defined() ? p.q_segments.data<int32_t>() : nullptr,
          p.k_segments.defined() ? p.k_segments.data<int32_t>() : nullptr,
          a.seq};
}

}  // namespace

AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids,
                               const AttentionShape& a) {
  check_args("attention_forward", q, k, v, segment_ids, a);
  return forward(q, k, v, causal(segment_ids, a), a);
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& segment_ids, const Tensor& out, const Tensor& lse,
                                  const AttentionShape& a) {
  check_args("attention_backward", q, k, v, segment_ids, a);
  return backward(dout, q, k, v, out, lse, causal(segment_ids, a), a, "attention_backward");
}

AttentionOut attention_part_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part,
                                    const AttentionShape& a) {
  return forward(q, k, v, part_of(q, k, v, part, a, "attention_part_forward"), a);
}

AttentionGrads attention_part_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionPart& part, const Tensor& out, const Tensor& lse,
                                       const AttentionShape& a) {
  return backward(dout, q, k, v, out, lse, part_of(q, k, v, part, a, "attention_part_backward"), a,
                  "attention_part_backward");
}

// Online softmax over parts: with w = exp(lse - lse'), lse' = log(e^lse_a + e^lse_b),
// out' = w_a out_a + w_b out_b. A row that saw nothing (lse -inf) adds nothing.
void attention_merge(AttentionOut& acc, const AttentionOut& part) {
  check_shape(part.out, acc.out.shape(), "part.out");
  check_shape(part.lse, acc.lse.shape(), "part.lse");
  check_same_dtype("attention_merge", acc.out.dtype(), {&acc.lse, &part.out, &part.lse});
  const AttentionOut& block = part;
  const int64_t B = acc.lse.size(0), Hq = acc.lse.size(1), S = acc.lse.size(2);
  const int64_t ow = acc.out.size(1), Dv = ow / Hq;
  dispatch_float(acc.out.dtype(), "attention_merge", [&](auto tag) {
    using F = decltype(tag);
    F *po = acc.out.data<F>(), *pl = acc.lse.data<F>();
    const F *bo = block.out.data<F>(), *bl = block.lse.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < B * Hq * S; ++i) {
      const int64_t b = i / (Hq * S), h = (i / S) % Hq, s = i % S;
      const double la = double(pl[i]), lb = double(bl[i]);
      if (std::isinf(lb) && lb < 0) continue;
      const double m = std::max(la, lb);
      const double l = m + std::log(std::exp(la - m) + std::exp(lb - m));
      const double wa = std::exp(la - l), wb = std::exp(lb - l);
      F* o = po + (b * S + s) * ow + h * Dv;
      const F* ob = bo + (b * S + s) * ow + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] = F(wa * double(o[d]) + wb * double(ob[d]));
      pl[i] = F(l);
    }
  });
}

}  // namespace moetrain::ops::cpu
