// The per-element AdamW arithmetic for f32 masters, shared by the CPU reference
// (ops/cpu/adamw.cpp) and the CUDA kernel (ops/cuda/adamw.cu), so that both give the same
// bits: f32 throughout (as PyTorch's fused AdamW), every product and sum rounded on its own
// (no fused multiply-add on either side: the device code names its rounding, the host file
// is compiled with -ffp-contract=off, CMakeLists.txt), IEEE division and square root.
//
// Why f32 and not double: the update is memory-bound on a whole GPU, but beside the next
// forward it runs on a few multiprocessors (LayerwiseOptimizer), where double arithmetic (two
// divisions and a square root an element) capped each multiprocessor at ~50 GB/s.
#pragma once

#include <cmath>
#include <cstdint>

#include "ops/stochastic_round.h"  // MT_HOST_DEVICE

namespace moetrain::ops {

// A step's constants, rounded to f32 once.
struct AdamWConstants {
  float lr, b1, one_minus_b1, b2, one_minus_b2, inv_bc1, inv_bc2, eps, grad_scale;
};

// step: 1-based (bias corrections 1 - b^step, applied as multiplications by their reciprocals).
inline AdamWConstants adamw_constants(double lr, double b1, double b2, double eps, double grad_scale, int64_t step) {
  const double t = static_cast<double>(step);
  return AdamWConstants{static_cast<float>(lr),
                        static_cast<float>(b1),
                        static_cast<float>(1.0 - b1),
                        static_cast<float>(b2),
                        static_cast<float>(1.0 - b2),
                        static_cast<float>(1.0 / (1.0 - std::pow(b1, t))),
                        static_cast<float>(1.0 / (1.0 - std::pow(b2, t))),
                        static_cast<float>(eps),
                        static_cast<float>(grad_scale)};
}

namespace adamw_f32 {
#if defined(__CUDA_ARCH__)
MT_HOST_DEVICE float mul(float a, float b) { return __fmul_rn(a, b); }
MT_HOST_DEVICE float add(float a, float b) { return __fadd_rn(a, b); }
MT_HOST_DEVICE float div(float a, float b) { return __fdiv_rn(a, b); }
MT_HOST_DEVICE float sqrt(float a) { return __fsqrt_rn(a); }
#else
MT_HOST_DEVICE float mul(float a, float b) { return a * b; }
MT_HOST_DEVICE float add(float a, float b) { return a + b; }
MT_HOST_DEVICE float div(float a, float b) { return a / b; }
MT_HOST_DEVICE float sqrt(float a) { return std::sqrt(a); }
#endif
}  // namespace adamw_f32

// One element: m, v become the new moments (before any rounding to their storage), p the
// updated master:
//   g = grad_scale grad; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g g;
//   p -= lr ((m inv_bc1) / (sqrt(v inv_bc2) + eps) + wd p)
MT_HOST_DEVICE void adamw_element(float& p, float grad, float& m, float& v, float wd, const AdamWConstants& c) {
  namespace f = adamw_f32;
  const float g = f::mul(c.grad_scale, grad);
  m = f::add(f::mul(c.b1, m), f::mul(c.one_minus_b1, g));
  v = f::add(f::mul(c.b2, v), f::mul(f::mul(c.one_minus_b2, g), g));
  const float denom = f::add(f::sqrt(f::mul(v, c.inv_bc2)), c.eps);
  p = f::add(p, -f::mul(c.lr, f::add(f::div(f::mul(m, c.inv_bc1), denom), f::mul(wd, p))));
}

}  // namespace moetrain::ops
