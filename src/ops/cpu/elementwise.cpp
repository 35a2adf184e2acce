// Small reductions and element-wise helpers.
//
// sum_squares(x) = sum_i x_i^2 in double. Deterministic whatever the thread count: the
// elements are cut into fixed chunks of kChunk, each chunk is summed in order, then the
// chunk sums are added in chunk order.
// scale_: x *= alpha.  add_: y += x.  all_finite: no NaN or +-inf.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {
constexpr int64_t kChunk = 1 << 14;
}

double sum_squares(const Tensor& x) {
  MT_CHECK(x.defined(), "sum_squares: x is undefined");
  const int64_t n = x.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  dispatch_float(x.dtype(), "sum_squares", [&](auto tag) {
    using F = decltype(tag);
    const F* p = x.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = std::min(n, (c + 1) * kChunk);
      double s = 0;
      for (int64_t i = c * kChunk; i < end; ++i) s += static_cast<double>(p[i]) * static_cast<double>(p[i]);
      partial[c] = s;
    }
  });
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

void scale_(Tensor& x, double alpha) {
  MT_CHECK(x.defined(), "scale_: x is undefined");
  const int64_t n = x.numel();
  dispatch_float(x.dtype(), "scale_", [&](auto tag) {
    using F = decltype(tag);
    F* p = x.data<F>();
    const F a = static_cast<F>(alpha);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] *= a;
  });
}

void add_(Tensor& y, const Tensor& x) {
  MT_CHECK(y.defined(), "add_: y is undefined");
  check_shape(x, y.shape(), "add_ x (must match y)");
  check_same_dtype("add_ (y, x)", y.dtype(), {&x});
  const int64_t n = y.numel();
  dispatch_float(y.dtype(), "add_", [&](auto tag) {
    using F = decltype(tag);
    F* a = y.data<F>();
    const F* b = x.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
  });
}

bool all_finite(const Tensor& x) {
  MT_CHECK(x.defined(), "all_finite: x is undefined");
  const int64_t n = x.numel();
  bool ok = true;
  dispatch_float(x.dtype(), "all_finite", [&](auto tag) {
    using F = decltype(tag);
    const F* p = x.data<F>();
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(p[i]);
    ok = bad == 0;
  });
  return ok;
}

double sum_squares_all(const std::vector<Tensor>& xs) {
  double sq = 0;
  for (const Tensor& x : xs) sq += cpu::sum_squares(x);
  return sq;
}

void sum_squares_all_into(const std::vector<Tensor>& xs, Tensor& out, int64_t index) {
  out.data<double>()[index] = sum_squares_all(xs);
}

void zero_all(const std::vector<Tensor>& xs) {
  for (Tensor x : xs) x.zero_();
}

}  // namespace moetrain::ops::cpu
