// Linear layer without bias, Hugging Face weight layout [out, in].
//
// forward:         y  = x W^T        x [T, in], W [out, in] -> y [T, out]  (+ residual: beta = 1)
// backward_input:  dx = dy W         dy [T, out]            -> dx [T, in]
// backward_weight: dW += dy^T x      (accumulates: beta = 1)
//
// All three are one GEMM (cblas, row-major). BLAS is called from serial code only.
#include <cblas.h>

#include <climits>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// C[M, N] = alpha * op(A) op(B) + beta * C, row-major, leading dimensions lda, ldb, ldc.
template <typename F>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const F* A, int64_t lda, const F* B, int64_t ldb,
          F beta, F* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // nothing to add: C = beta * C
    for (int64_t i = 0; i < M * N; ++i) C[i] = beta == F(0) ? F(0) : beta * C[i];
    return;
  }
  for (int64_t d : {M, N, K, lda, ldb, ldc}) MT_CHECK(d <= INT_MAX, "linear: dimension {} exceeds BLAS int range", d);
  const auto opA = ta ? CblasTrans : CblasNoTrans, opB = tb ? CblasTrans : CblasNoTrans;
  const int m = int(M), n = int(N), k = int(K);
  if constexpr (std::is_same_v<F, float>) {
    cblas_sgemm(CblasRowMajor, opA, opB, m, n, k, 1.0f, A, int(lda), B, int(ldb), beta, C, int(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, opA, opB, m, n, k, 1.0, A, int(lda), B, int(ldb), beta, C, int(ldc));
  }
}

void check_2d(const Tensor& t, const char* name, const char* op) {
  MT_CHECK(t.defined() && t.ndim() == 2, "{}: tensor {} must be 2-D, got {}", op, name, t.str());
}

}  // namespace

Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& residual) {
  check_2d(x, "x", "linear_forward");
  check_2d(w, "w", "linear_forward");
  const int64_t T = x.size(0), in = x.size(1), out = w.size(0);
  check_shape(w, {out, in}, "w");
  check_same_dtype("linear_forward", x.dtype(), {&w, &residual});
  if (residual.defined()) check_shape(residual, {T, out}, "linear_forward residual");
  Tensor y = residual.defined() ? residual.clone() : Tensor::empty({T, out}, x.dtype());
  dispatch_float(x.dtype(), "linear_forward", [&](auto tag) {
    using F = decltype(tag);
    gemm<F>(false, true, T, out, in, x.data<F>(), in, w.data<F>(), in, F(residual.defined() ? 1 : 0), y.data<F>(),
            out);
  });
  return y;
}

// dx (+)= dy W; beta 0 writes, 1 accumulates.
static void backward_input_into(const Tensor& dy, const Tensor& w, Tensor& dx, double beta, const char* op) {
  check_2d(dy, "dy", op);
  check_2d(w, "w", op);
  const int64_t T = dy.size(0), out = w.size(0), in = w.size(1);
  check_shape(dy, {T, out}, "dy");
  check_shape(dx, {T, in}, "dx");
  check_same_dtype(op, dy.dtype(), {&w, &dx});
  dispatch_float(dy.dtype(), op, [&](auto tag) {
    using F = decltype(tag);
    gemm<F>(false, false, T, in, out, dy.data<F>(), out, w.data<F>(), in, F(beta), dx.data<F>(), in);
  });
}

Tensor linear_backward_input(const Tensor& dy, const Tensor& w) {
  check_2d(dy, "dy", "linear_backward_input");
  check_2d(w, "w", "linear_backward_input");
  Tensor dx = Tensor::empty({dy.size(0), w.size(1)}, dy.dtype());
  backward_input_into(dy, w, dx, 0.0, "linear_backward_input");
  return dx;
}

void linear_backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  MT_CHECK(dx.defined(), "linear_backward_input_add: dx is undefined");
  backward_input_into(dy, w, dx, 1.0, "linear_backward_input_add");
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  check_2d(dy, "dy", "linear_backward_weight");
  check_2d(x, "x", "linear_backward_weight");
  const int64_t T = x.size(0), in = x.size(1), out = dy.size(1);
  check_shape(dy, {T, out}, "dy");
  check_shape(dw, {out, in}, "dw");
  check_same_dtype("linear_backward_weight", dw.dtype(), {&dy, &x});
  dispatch_float(dw.dtype(), "linear_backward_weight", [&](auto tag) {
    using F = decltype(tag);
    gemm<F>(true, false, out, in, T, dy.data<F>(), out, x.data<F>(), in, F(accumulate ? 1 : 0), dw.data<F>(), in);
  });
}

}  // namespace moetrain::ops::cpu
