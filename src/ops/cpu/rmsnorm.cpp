// RMSNorm over the last D = w.numel() elements; x is read as R = numel/D rows of D.
//
// forward:  rstd[r] = 1 / sqrt(mean_i x[r,i]^2 + eps),  y[r,i] = x[r,i] * rstd[r] * w[i]
// backward: with g[i] = w[i] * dy[r,i],
//   dx[r,i] = rstd * (g[i] - x[r,i] * rstd^2 * mean_j(g[j] * x[r,j]))
//   dw[i]  += sum_r dy[r,i] * x[r,i] * rstd[r]
// Row reductions run in double. dw sums fixed blocks of rows (independent of the thread
// count) into per-block partials, then adds the partials in block order: deterministic.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// Rows of x for norm weight w, checking that D divides x.
int64_t row_count(const Tensor& x, const Tensor& w, const char* op) {
  MT_CHECK(x.defined() && w.defined(), "{}: x and w must be defined", op);
  MT_CHECK(w.ndim() == 1 && w.numel() > 0, "{}: weight w must be 1-D and non-empty, got {}", op, w.str());
  const int64_t D = w.numel();
  MT_CHECK(x.ndim() >= 1 && x.size(-1) % D == 0, "{}: x {} cannot be read as rows of w's size {}", op, x.str(), D);
  return x.numel() / D;
}

}  // namespace

RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  const int64_t R = row_count(x, w, "rmsnorm_forward"), D = w.numel();
  check_same_dtype("rmsnorm_forward", x.dtype(), {&w});
  RmsNormOut o{Tensor::empty(x.shape(), x.dtype()), Tensor::empty({R}, x.dtype())};
  dispatch_float(x.dtype(), "rmsnorm_forward", [&](auto tag) {
    using F = decltype(tag);
    const F *px = x.data<F>(), *pw = w.data<F>();
    F *py = o.y.data<F>(), *pr = o.rstd.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const F* xr = px + r * D;
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * double(xr[i]);
      const double rstd = 1.0 / std::sqrt(ss / double(D) + eps);
      for (int64_t i = 0; i < D; ++i) py[r * D + i] = F(double(xr[i]) * rstd * double(pw[i]));
      pr[r] = F(rstd);
    }
  });
  return o;
}

// The CPU quantizes y as it is stored (f32 or bf16): the reference's definition.
RmsNormOut rmsnorm_forward_fp8(const Tensor& x, const Tensor& w, double eps) {
  RmsNormOut o = cpu::rmsnorm_forward(x, w, eps);
  o.y_q = cpu::quantize_fp8(o.y, Fp8Blocks::kRows);
  return o;
}

Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& residual) {
  const int64_t R = row_count(x, w, "rmsnorm_backward_input"), D = w.numel();
  check_shape(dy, x.shape(), "dy");
  check_shape(rstd, {R}, "rstd");
  check_same_dtype("rmsnorm_backward_input", x.dtype(), {&dy, &w, &rstd});
  Tensor dx = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(x.dtype(), "rmsnorm_backward_input", [&](auto tag) {
    using F = decltype(tag);
    const F *px = x.data<F>(), *pw = w.data<F>(), *pg = dy.data<F>(), *pr = rstd.data<F>();
    F* pdx = dx.data<F>();
    const F* pres = residual.defined() ? residual.data<F>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const F *xr = px + r * D, *gr = pg + r * D;
      double dot = 0;  // sum_j w[j] dy[j] x[j]
      for (int64_t i = 0; i < D; ++i) dot += double(pw[i]) * double(gr[i]) * double(xr[i]);
      const double s = double(pr[r]), c = s * s * dot / double(D);
      for (int64_t i = 0; i < D; ++i) {
        const double extra = pres ? double(pres[r * D + i]) : 0.0;
        pdx[r * D + i] = F(s * (double(pw[i]) * double(gr[i]) - double(xr[i]) * c) + extra);
      }
    }
  });
  return dx;
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw) {
  const int64_t R = row_count(x, dw, "rmsnorm_backward_weight"), D = dw.numel();
  check_shape(dy, x.shape(), "dy");
  check_shape(rstd, {R}, "rstd");
  check_same_dtype("rmsnorm_backward_weight", dw.dtype(), {&dy, &x, &rstd});
  dispatch_float(dw.dtype(), "rmsnorm_backward_weight", [&](auto tag) {
    using F = decltype(tag);
    const F *px = x.data<F>(), *pg = dy.data<F>(), *pr = rstd.data<F>();
    F* pdw = dw.data<F>();
    // Block size depends only on R, so the summation order does not depend on threads.
    const int64_t block = std::max<int64_t>(256, (R + 63) / 64);
    const int64_t nblocks = (R + block - 1) / block;
    std::vector<double> partial(static_cast<size_t>(nblocks * D), 0.0);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      double* acc = partial.data() + b * D;
      for (int64_t r = b * block; r < std::min(R, (b + 1) * block); ++r) {
        const double s = double(pr[r]);
        for (int64_t i = 0; i < D; ++i) acc[i] += double(pg[r * D + i]) * double(px[r * D + i]) * s;
      }
    }
    for (int64_t i = 0; i < D; ++i) {
      double sum = 0;
      for (int64_t b = 0; b < nblocks; ++b) sum += partial[b * D + i];
      pdw[i] = F(double(pdw[i]) + sum);
    }
  });
}

// The reference: the two ops in turn.
RmsNormOut rmsnorm_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& positions,
                                int64_t head_dim, double theta) {
  RmsNormOut n = rmsnorm_forward(x, w, eps);
  n.y = cpu::rope_forward(n.y, positions, RopeSpec{head_dim, theta});
  return n;
}

RmsNormRopeGrads rmsnorm_rope_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       const Tensor& positions, int64_t head_dim, double theta) {
  const Tensor dn = cpu::rope_backward(dy, positions, RopeSpec{head_dim, theta});
  RmsNormRopeGrads g{rmsnorm_backward_input(dn, x, w, rstd, Tensor()), Tensor::zeros({w.numel()}, x.dtype())};
  rmsnorm_backward_weight(dn, x, rstd, g.dw);
  return g;
}

}  // namespace moetrain::ops::cpu
