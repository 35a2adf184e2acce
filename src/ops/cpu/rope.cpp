// Rotary position embedding, rotate-half convention (Hugging Face Llama / Qwen3).
//
// x [T, heads * hd]; within each head, element i < hd/2 pairs with element i + hd/2:
//   angle = pos[t] * theta^(-2i/hd)
//   forward:  (a, b) -> (a cos - b sin,  b cos + a sin)
//   backward: the transpose (= inverse) rotation, (a, b) -> (a cos + b sin,  b cos - a sin)
// Angles, cos and sin are computed in double, once per token and shared by its heads.
#include <cmath>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle (backward).
Tensor rotate(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta, double sign,
              const char* op) {
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: input must be [T, heads*head_dim], got {}", op, x.str());
  MT_CHECK(head_dim > 0 && head_dim % 2 == 0, "{}: head_dim must be positive and even, got {}", op, head_dim);
  MT_CHECK(x.size(1) % head_dim == 0, "{}: width {} of {} is not a multiple of head_dim {}", op, x.size(1),
           x.str(), head_dim);
  MT_CHECK(theta > 0, "{}: theta must be positive, got {}", op, theta);
  const int64_t T = x.size(0), W = x.size(1), half = head_dim / 2;
  check_shape(positions, {T}, "positions");
  check_dtype(positions, DType::I32, "positions");
  const int32_t* pos = positions.data<int32_t>();
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * double(i) / double(head_dim));
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
          c[i] = std::cos(angle);
          s[i] = sign * std::sin(angle);
        }
        for (int64_t h0 = t * W; h0 < (t + 1) * W; h0 += head_dim) {
          for (int64_t i = 0; i < half; ++i) {
            const double a = double(px[h0 + i]), b = double(px[h0 + half + i]);
            py[h0 + i] = F(a * c[i] - b * s[i]);
            py[h0 + half + i] = F(b * c[i] + a * s[i]);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

Tensor rope_forward(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta) {
  return rotate(x, positions, head_dim, theta, 1.0, "rope_forward");
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, int64_t head_dim, double theta) {
  return rotate(dy, positions, head_dim, theta, -1.0, "rope_backward");
}

}  // namespace moetrain::ops::cpu
