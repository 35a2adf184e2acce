// DeepSeek-V3's MLA keys and values (ops.h): kv_b_proj's per-head [k_nope | v] rows split
// into the attention's k (with the shared rotary key appended to every head) and v, and the
// gradients gathered back (the shared key's summed over the heads).
#include "ops/arg_checks.h"
#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {

MlaKv mla_kv_forward(const Tensor& kv, const Tensor& k_rot, int64_t heads, int64_t nope, int64_t v_dim) {
  const char* op = "mla_kv_forward";
  const int64_t rope = check_mla_kv_forward_args(op, kv, k_rot, heads, nope, v_dim);
  check_same_dtype(op, kv.dtype(), {&k_rot});
  const int64_t T = kv.size(0), kw = nope + rope, kvw = nope + v_dim;
  MlaKv o{Tensor::empty({T, heads * kw}, kv.dtype()), Tensor::empty({T, heads * v_dim}, kv.dtype())};
  dispatch_float(kv.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    const F* pkv = kv.data<F>();
    const F* pr = k_rot.data<F>();
    F* pk = o.k.data<F>();
    F* pv = o.v.data<F>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const F* src = pkv + (t * heads + h) * kvw;
        F* k = pk + (t * heads + h) * kw;
        for (int64_t j = 0; j < nope; ++j) k[j] = src[j];
        for (int64_t j = 0; j < rope; ++j) k[nope + j] = pr[t * rope + j];
        for (int64_t j = 0; j < v_dim; ++j) pv[(t * heads + h) * v_dim + j] = src[nope + j];
      }
    }
  });
  return o;
}

MlaKvGrads mla_kv_backward(const Tensor& dk, const Tensor& dv, int64_t heads, int64_t nope, int64_t v_dim) {
  const char* op = "mla_kv_backward";
  const int64_t rope = check_mla_kv_backward_args(op, dk, dv, heads, nope, v_dim);
  check_same_dtype(op, dk.dtype(), {&dv});
  const int64_t T = dk.size(0), kw = nope + rope, kvw = nope + v_dim;
  MlaKvGrads g{Tensor::empty({T, heads * kvw}, dk.dtype()), Tensor::empty({T, rope}, dk.dtype())};
  dispatch_float(dk.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    const F* pk = dk.data<F>();
    const F* pv = dv.data<F>();
    F* pkv = g.dkv.data<F>();
    F* pr = g.dk_rot.data<F>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < rope; ++j) {
        double sum = 0;  // heads in order
        for (int64_t h = 0; h < heads; ++h) sum += double(pk[(t * heads + h) * kw + nope + j]);
        pr[t * rope + j] = F(sum);
      }
      for (int64_t h = 0; h < heads; ++h) {
        F* dst = pkv + (t * heads + h) * kvw;
        for (int64_t j = 0; j < nope; ++j) dst[j] = pk[(t * heads + h) * kw + j];
        for (int64_t j = 0; j < v_dim; ++j) dst[nope + j] = pv[(t * heads + h) * v_dim + j];
      }
    }
  });
  return g;
}

}  // namespace moetrain::ops::cpu
