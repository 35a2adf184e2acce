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
#include <cstring>

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

// A split f32 master (engine/parameters.h): the bf16 weight the model computes with is its
// high half, rounded to nearest with ties away from zero, and a 16-bit integer holds the
// rest, so that the two are the master exactly in 4 bytes (with the weight it saves the
// separate f32 copy: 6 bytes an element become 4, and the update moves 28 bytes, not 30).
// With u the master's bits: high = (u + 0x8000) >> 16, low = the low 16 bits of u read as
// signed, and u = (high << 16) + low. A tie rounds up in magnitude because only then does
// low = -0x8000 fit 16 bits (rounding a tie down would need +0x8000).
MT_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
MT_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
MT_HOST_DEVICE float master_join(uint16_t high, int16_t low) {
  return bits_float((static_cast<uint32_t>(high) << 16) + static_cast<uint32_t>(static_cast<int32_t>(low)));
}
// A NaN master becomes the quiet NaN of its sign first: the carry into the high half could
// otherwise turn a NaN into an infinity or a zero weight.
MT_HOST_DEVICE void master_split(float master, uint16_t& high, int16_t& low) {
  uint32_t u = float_bits(master);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = (u & 0x80000000u) | 0x7fc00000u;
  high = static_cast<uint16_t>((u + 0x8000u) >> 16);
  low = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
}

}  // namespace moetrain::ops
