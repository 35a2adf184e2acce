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

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

void check_args(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                const AttentionShape& a) {
  MT_CHECK(a.batch >= 0 && a.seq >= 0 && a.q_heads > 0 && a.kv_heads > 0 && a.head_dim > 0,
           "{}: bad shape batch={} seq={} q_heads={} kv_heads={} head_dim={}", op, a.batch, a.seq, a.q_heads,
           a.kv_heads, a.head_dim);
  MT_CHECK(a.q_heads % a.kv_heads == 0, "{}: q_heads {} is not a multiple of kv_heads {}", op, a.q_heads,
           a.kv_heads);
  MT_CHECK(a.scale > 0 && std::isfinite(a.scale), "{}: softmax scale must be positive, got {}", op, a.scale);
  MT_CHECK(a.v_head_dim >= 0, "{}: v_head_dim must be >= 0 (0: head_dim), got {}", op, a.v_head_dim);
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

}  // namespace

AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids,
                               const AttentionShape& a) {
  check_args("attention_forward", q, k, v, segment_ids, a);
  const int64_t B = a.batch, S = a.seq, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim, Dv = a.value_dim();
  const int64_t group = Hq / Hkv, qw = Hq * D, kw = Hkv * D, vw = Hkv * Dv, ow = Hq * Dv;
  const int32_t* seg = segment_ids.defined() ? segment_ids.data<int32_t>() : nullptr;
  AttentionOut o{Tensor::empty({B * S, ow}, q.dtype()), Tensor::empty({B, Hq, S}, q.dtype())};
  dispatch_float(q.dtype(), "attention_forward", [&](auto tag) {
    using F = decltype(tag);
    const F *pq = q.data<F>(), *pk = k.data<F>(), *pv = v.data<F>();
    F *po = o.out.data<F>(), *plse = o.lse.data<F>();
#pragma omp parallel
    {
      std::vector<double> sc(S), acc(Dv);
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * Hq; ++bh) {
        const int64_t b = bh / Hq, h = bh % Hq, g = h / group;
        const F* kb = pk + b * S * kw + g * D;
        const F* vb = pv + b * S * vw + g * Dv;
        for (int64_t s = 0; s < S; ++s) {
          const F* qs = pq + (b * S + s) * qw + h * D;
          const int32_t* sg = seg ? seg + b * S : nullptr;
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j <= s; ++j) {
            if (sg && sg[j] != sg[s]) continue;
            sc[j] = a.scale * dot(qs, kb + j * kw, D);
            mx = std::max(mx, sc[j]);
          }
          double sum = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; j <= s; ++j) {
            if (sg && sg[j] != sg[s]) continue;
            const double p = std::exp(sc[j] - mx);
            sum += p;
            const F* vj = vb + j * vw;
            for (int64_t d = 0; d < Dv; ++d) acc[d] += p * double(vj[d]);
          }
          F* os = po + (b * S + s) * ow + h * Dv;
          for (int64_t d = 0; d < Dv; ++d) os[d] = F(acc[d] / sum);
          plse[bh * S + s] = F(mx + std::log(sum));
        }
      }
    }
  });
  return o;
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& segment_ids, const Tensor& out, const Tensor& lse,
                                  const AttentionShape& a) {
  check_args("attention_backward", q, k, v, segment_ids, a);
  const int64_t B = a.batch, S = a.seq, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim, Dv = a.value_dim();
  const int64_t group = Hq / Hkv, qw = Hq * D, kw = Hkv * D, vw = Hkv * Dv, ow = Hq * Dv;
  check_shape(dout, {B * S, ow}, "dout");
  check_shape(out, {B * S, ow}, "out");
  check_shape(lse, {B, Hq, S}, "lse");
  check_same_dtype("attention_backward", q.dtype(), {&dout, &out, &lse});
  const int32_t* seg = segment_ids.defined() ? segment_ids.data<int32_t>() : nullptr;
  AttentionGrads gr{Tensor::empty(q.shape(), q.dtype()), Tensor::empty(k.shape(), q.dtype()),
                    Tensor::empty(v.shape(), q.dtype())};
  dispatch_float(q.dtype(), "attention_backward", [&](auto tag) {
    using F = decltype(tag);
    const F *pq = q.data<F>(), *pk = k.data<F>(), *pv = v.data<F>();
    const F *pdo = dout.data<F>(), *po = out.data<F>(), *plse = lse.data<F>();
    F *pdq = gr.dq.data<F>(), *pdk = gr.dk.data<F>(), *pdv = gr.dv.data<F>();
#pragma omp parallel
    {
      std::vector<double> dk(S * D), dv(S * Dv), dq(D);
#pragma omp for schedule(static)
      for (int64_t bg = 0; bg < B * Hkv; ++bg) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        const F* kb = pk + b * S * kw + g * D;
        const F* vb = pv + b * S * vw + g * Dv;
        const int32_t* sg = seg ? seg + b * S : nullptr;
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t s = 0; s < S; ++s) {
            const int64_t row = (b * S + s) * qw + h * D, orow = (b * S + s) * ow + h * Dv;
            const F *qs = pq + row, *dos = pdo + orow;
            const double l = double(plse[(b * Hq + h) * S + s]);
            const double delta = dot(dos, po + orow, Dv);
            std::fill(dq.begin(), dq.end(), 0.0);
            for (int64_t j = 0; j <= s; ++j) {
              if (sg && sg[j] != sg[s]) continue;
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
        for (int64_t j = 0; j < S; ++j) {
          for (int64_t d = 0; d < D; ++d) pdk[(b * S + j) * kw + g * D + d] = F(dk[j * D + d]);
          for (int64_t d = 0; d < Dv; ++d) pdv[(b * S + j) * vw + g * Dv + d] = F(dv[j * Dv + d]);
        }
      }
    }
  });
  return gr;
}

}  // namespace moetrain::ops::cpu
