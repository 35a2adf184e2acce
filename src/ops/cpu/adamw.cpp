// AdamW with decoupled weight decay (Loshchilov & Hutter), in place, element-wise:
//   m = b1 m + (1 - b1) g
//   v = b2 v + (1 - b2) g^2
//   param -= lr * ( (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps) + wd * param )
// with g = grad_scale * grad. The decay uses the parameter before this step's update. f32
// masters: f32 arithmetic shared with the CUDA kernel (ops/adamw_math.h: the same bits; moments
// f32, or bf16 stored by stochastic rounding, stochastic_round.h); f64 (tests): double. No
// reductions, so the result does not depend on the thread count.
#include <cmath>
#include <cstring>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/adamw_math.h"
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
  const int64_t n = param.numel();
  if (param.dtype() == DType::F32) {  // f32 masters: the shared f32 arithmetic, the kernel's bits
    const AdamWConstants c = adamw_constants(s.lr, s.beta1, s.beta2, s.eps, s.grad_scale, s.step);
    const float wd = static_cast<float>(s.weight_decay);
    float* p = param.data<float>();
    const float* g = grad.data<float>();
    if (bf16_moments) {  // moments stored bf16 by stochastic rounding
      bf16* M = m.data<bf16>();
      bf16* V = v.data<bf16>();
      const int64_t step = s.step, base = m.storage_offset();  // rounding keys on the element's place in m's buffer
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float mi = static_cast<float>(M[i]), vi = static_cast<float>(V[i]);
        adamw_element(p[i], g[i], mi, vi, wd, c);
        M[i].bits = bf16_bits_stochastic(f32_bits(mi), rounding_bits(base + i, step, 0));
        V[i].bits = bf16_bits_stochastic(f32_bits(vi), rounding_bits(base + i, step, 1));
      }
      return;
    }
    float* M = m.data<float>();
    float* V = v.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) adamw_element(p[i], g[i], M[i], V[i], wd, c);
    return;
  }
  // f64 (tests: finite differences, exact references): the same formula in double.
  MT_CHECK(param.dtype() == DType::F64, "adamw_update: param must be f32 or f64, got {}", dtype_name(param.dtype()));
  const double b1 = s.beta1, b2 = s.beta2;
  const double inv_bc1 = 1.0 / (1.0 - std::pow(b1, static_cast<double>(s.step)));
  const double inv_bc2 = 1.0 / (1.0 - std::pow(b2, static_cast<double>(s.step)));
  const double lr = s.lr, eps = s.eps, wd = s.weight_decay, gs = s.grad_scale;
  double* p = param.data<double>();
  const double* g = grad.data<double>();
  double* M = m.data<double>();
  double* V = v.data<double>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double gi = gs * g[i];
    M[i] = b1 * M[i] + (1.0 - b1) * gi;
    V[i] = b2 * V[i] + (1.0 - b2) * gi * gi;
    p[i] -= lr * ((M[i] * inv_bc1) / (std::sqrt(V[i] * inv_bc2) + eps) + wd * p[i]);
  }
}

void adamw_update_all(AdamWTensors& t, const AdamWStep& s) {
  for (size_t i = 0; i < t.params.size(); ++i) {
    AdamWStep si = s;
    if (!t.decay[i]) si.weight_decay = 0;
    if (t.lows[i].defined()) {  // a split master: joined, updated, split again (all exact)
      Tensor master = Tensor::empty(t.params[i].shape(), DType::F32);
      cpu::master_join_into(master, t.params[i], t.lows[i]);
      cpu::adamw_update(master, t.grads[i], t.m[i], t.v[i], si);
      cpu::master_split_into(master, t.params[i], t.lows[i]);
      continue;
    }
    cpu::adamw_update(t.params[i], t.grads[i], t.m[i], t.v[i], si);
    if (t.values[i].defined()) cpu::cast_into(t.values[i], t.params[i]);
  }
}

}  // namespace moetrain::ops::cpu
