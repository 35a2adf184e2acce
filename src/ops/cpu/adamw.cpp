// AdamW with decoupled weight decay (Loshchilov & Hutter), in place, element-wise:
//   m = b1 m + (1 - b1) g
//   v = b2 v + (1 - b2) g^2
//   param -= lr * ( (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps) + wd * param )
// with g = grad_scale * grad. The decay uses the parameter before this step's update. Each element is computed in
// double and stored in the tensors' dtype (f32 master weights, or f64 in tests; moments
// may instead be bf16 next to f32 masters, stored by stochastic rounding, stochastic_round.h);
// no reductions, so the result does not depend on the thread count.
#include <cmath>
#include <cstring>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/stochastic_round.h"

namespace moetrain::ops::cpu {
namespace {

uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

}  // namespace

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s) {
  MT_CHECK(param.defined(), "adamw_update: param is undefined");
  check_shape(grad, param.shape(), "adamw_update grad");
  check_shape(m, param.shape(), "adamw_update m (first moment)");
  check_shape(v, param.shape(), "adamw_update v (second moment)");
  const bool bf16_moments = m.dtype() == DType::BF16;
  if (bf16_moments) {
    check_same_dtype("adamw_update (param, grad: f32 with bf16 moments)", DType::F32, {&param, &grad});
    check_same_dtype("adamw_update (m, v)", DType::BF16, {&v});
  } else {
    check_same_dtype("adamw_update (param, grad, m, v)", param.dtype(), {&grad, &m, &v});
  }
  MT_CHECK(s.step >= 1, "adamw_update: step = {} must be >= 1 (1-based, for bias correction)", s.step);
  MT_CHECK(s.beta1 >= 0 && s.beta1 < 1 && s.beta2 >= 0 && s.beta2 < 1,
           "adamw_update: betas ({}, {}) must lie in [0, 1)", s.beta1, s.beta2);
  const double b1 = s.beta1, b2 = s.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(s.step));
  const double lr = s.lr, eps = s.eps, wd = s.weight_decay, gs = s.grad_scale;
  const int64_t n = param.numel();
  if (bf16_moments) {  // f32 master and gradient, moments stored bf16 by stochastic rounding
    float* p = param.data<float>();
    const float* g = grad.data<float>();
    bf16* M = m.data<bf16>();
    bf16* V = v.data<bf16>();
    const int64_t step = s.step, base = m.storage_offset();  // rounding keys on the element's place in m's buffer
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double gi = gs * static_cast<double>(g[i]);
      const double mi = b1 * static_cast<double>(static_cast<float>(M[i])) + (1.0 - b1) * gi;
      const double vi = b2 * static_cast<double>(static_cast<float>(V[i])) + (1.0 - b2) * gi * gi;
      M[i].bits = bf16_bits_stochastic(f32_bits(static_cast<float>(mi)), rounding_bits(base + i, step, 0));
      V[i].bits = bf16_bits_stochastic(f32_bits(static_cast<float>(vi)), rounding_bits(base + i, step, 1));
      const double pi = static_cast<double>(p[i]);
      p[i] = static_cast<float>(pi - lr * ((mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * pi));
    }
    return;
  }
  dispatch_float(param.dtype(), "adamw_update", [&](auto tag) {
    using F = decltype(tag);
    F* p = param.data<F>();
    const F* g = grad.data<F>();
    F* M = m.data<F>();
    F* V = v.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const double gi = gs * static_cast<double>(g[i]);
      const double mi = b1 * static_cast<double>(M[i]) + (1.0 - b1) * gi;
      const double vi = b2 * static_cast<double>(V[i]) + (1.0 - b2) * gi * gi;
      M[i] = static_cast<F>(mi);
      V[i] = static_cast<F>(vi);
      const double pi = static_cast<double>(p[i]);
      p[i] = static_cast<F>(pi - lr * ((mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * pi));
    }
  });
}

void adamw_update_all(AdamWTensors& t, const AdamWStep& s) {
  for (size_t i = 0; i < t.params.size(); ++i) {
    AdamWStep si = s;
    if (!t.decay[i]) si.weight_decay = 0;
    cpu::adamw_update(t.params[i], t.grads[i], t.m[i], t.v[i], si);
    if (t.values[i].defined()) cpu::cast_into(t.values[i], t.params[i]);
  }
}

}  // namespace moetrain::ops::cpu
