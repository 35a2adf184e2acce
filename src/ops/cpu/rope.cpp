// Rotary position embedding (ops.h's RopeSpec): rotate-half pairs (i, i + hd/2), as Hugging
// Face Llama / Qwen3, or interleaved pairs (2i, 2i+1), as DeepSeek-V3; the last hd values of
// each head of `stride` turn, the rest are copied.
//
//   angle = pos[t] * inv_freq[i]   (theta^(-2i/hd), or the given frequencies: YaRN's)
//   forward:  (a, b) -> scale * (a cos - b sin,  b cos + a sin)
//   backward: the transpose, scale * (a cos + b sin,  b cos - a sin)
// Angles, cos and sin are computed in double, once per token and shared by its heads.
#include <cmath>
#include <vector>

#include "ops/arg_checks.h"
#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward).
Tensor rotate(const Tensor& x, const Tensor& positions, const RopeSpec& r, double sign, const char* op) {
  const RopeDims d = check_rope_args(op, x, positions, r);  // (no structured binding: lambdas capture these)
  const int64_t T = d.T, W = d.W, hd = d.head_dim, stride = d.stride, half = d.half;
  const int64_t pass = stride - hd;
  const int32_t* pos = positions.data<int32_t>();
  std::vector<double> inv_freq = r.inv_freq;
  if (inv_freq.empty()) {
    inv_freq.resize(half);
    for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(r.theta, -2.0 * double(i) / double(hd));
  }
  // Pair i's two offsets within the rotary dims.
  const int64_t step = r.interleaved ? 2 : 1, other = r.interleaved ? 1 : half;
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(x.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    const F* px = x.data<F>();
    F* py = y.data<F>();
#pragma omp parallel
    {
      std::vector<double> c(half), s(half);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < half; ++i) {
          const double angle = double(pos[t]) * inv_freq[i];
          c[i] = r.scale * std::cos(angle);
          s[i] = r.scale * sign * std::sin(angle);
        }
        for (int64_t h0 = t * W; h0 < (t + 1) * W; h0 += stride) {
          for (int64_t j = 0; j < pass; ++j) py[h0 + j] = px[h0 + j];
          const int64_t r0 = h0 + pass;
          for (int64_t i = 0; i < half; ++i) {
            const int64_t ia = r0 + i * step, ib = ia + other;
            const double a = double(px[ia]), b = double(px[ib]);
            py[ia] = F(a * c[i] - b * s[i]);
            py[ib] = F(b * c[i] + a * s[i]);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& r) {
  return rotate(x, positions, r, 1.0, "rope_forward");
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, const RopeSpec& r) {
  return rotate(dy, positions, r, -1.0, "rope_backward");
}

}  // namespace moetrain::ops::cpu
