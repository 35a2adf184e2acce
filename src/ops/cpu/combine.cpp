// Weighted combine of the K expert outputs of each token, plus an optional residual.
//
// Forward:  y[t] = residual[t] + sum_k w[t,k] * e[r]   r = t*K+k, or order[t*K+k] ([T*K, H])
//           (with an order, e may hold R < T*K rows: slots with r >= R are absent)
// Backward: de[r] = w[t,k] * dy[t]
//           dw[t,k]   = <dy[t], e[r]>                          (accumulated in double)
//           dresidual = dy                                     (the caller reuses dy)
#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// Checks weight [T, K] (expert_out's rows are checked with the order, in ops/dispatch.cpp);
// returns {T, K, H, R}.
struct Dims {
  int64_t T, K, H, R;
};
Dims check_combine(const char* op, const Tensor& expert_out, const Tensor& weight) {
  MT_CHECK(weight.defined() && weight.ndim() == 2, "{}: weight must be [T, K], got {}", op, weight.str());
  MT_CHECK(expert_out.defined() && expert_out.ndim() == 2, "{}: expert_out must be [R, H], got {}", op,
           expert_out.str());
  return {weight.size(0), weight.size(1), expert_out.size(1), expert_out.size(0)};
}

}  // namespace

Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual, const Tensor& order) {
  const Dims d = check_combine("combine_forward", expert_out, weight);
  const int64_t T = d.T, K = d.K, H = d.H, R = d.R;  // plain variables: lambdas capture them (clang 14 cannot capture bindings)
  if (residual.defined()) check_shape(residual, {T, H}, "combine_forward residual");
  check_same_dtype("combine_forward", expert_out.dtype(), {&weight, &residual});
  Tensor y = Tensor::empty({T, H}, expert_out.dtype());
  dispatch_float(expert_out.dtype(), "combine_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* e = expert_out.data<F>();
    const F* w = weight.data<F>();
    const F* res = residual.defined() ? residual.data<F>() : nullptr;
    const int32_t* ord = order.defined() ? order.data<int32_t>() : nullptr;
    F* out = y.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* o = out + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = res ? res[t * H + h] : F(0);
      for (int64_t k = 0; k < K; ++k) {
        const F wk = w[t * K + k];
        const int64_t at = ord ? ord[t * K + k] : t * K + k;
        if (at >= R) continue;  // absent
        const F* row = e + at * H;
        for (int64_t h = 0; h < H; ++h) o[h] += wk * row[h];
      }
    }
  });
  return y;
}

CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight, const Tensor& order) {
  const Dims d = check_combine("combine_backward", expert_out, weight);
  const int64_t T = d.T, K = d.K, H = d.H, R = d.R;  // plain variables: lambdas capture them (clang 14 cannot capture bindings)
  check_shape(dy, {T, H}, "combine_backward dy");
  check_same_dtype("combine_backward", dy.dtype(), {&expert_out, &weight});
  CombineGrads g;
  g.dexpert_out = Tensor::empty({R, H}, dy.dtype());
  g.dweight = Tensor::empty({T, K}, dy.dtype());
  dispatch_float(dy.dtype(), "combine_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* d = dy.data<F>();
    const F* e = expert_out.data<F>();
    const F* w = weight.data<F>();
    F* de = g.dexpert_out.data<F>();
    F* dw = g.dweight.data<F>();
    const int32_t* ord = order.defined() ? order.data<int32_t>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* dyt = d + t * H;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = t * K + k;
        const F wk = w[r];
        const int64_t at = ord ? ord[r] : r;
        if (at >= R) {  // absent
          dw[r] = F(0);
          continue;
        }
        const F* row = e + at * H;
        F* drow = de + at * H;
        double acc = 0;
        for (int64_t h = 0; h < H; ++h) {
          drow[h] = wk * dyt[h];
          acc += static_cast<double>(dyt[h]) * static_cast<double>(row[h]);
        }
        dw[r] = static_cast<F>(acc);
      }
    }
  });
  return g;
}

}  // namespace moetrain::ops::cpu
