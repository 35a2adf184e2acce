// Grouped expert SwiGLU: x [N, H] holds counts[e] consecutive rows for each expert e.
//
// Forward, for expert e and its rows x_e [c, H]:
//   g = x_e Wg[e]^T,  u = x_e Wu[e]^T          [c, I]
//   a = silu(g) * u,  silu(g) = g * sigmoid(g)
//   y_e = a Wd[e]^T                            [c, H]
// Backward input:
//   da = dy_e Wd[e]                            [c, I]
//   dg = da * u * silu'(g),  silu'(g) = s (1 + g (1 - s)),  s = sigmoid(g)
//   du = da * silu(g)
//   dx_e = dg Wg[e] + du Wu[e]
// Backward weight (accumulating, a recomputed from g and u):
//   dWd[e] += dy_e^T a;  dWg[e] += dg^T x_e;  dWu[e] += du^T x_e
// The GEMMs are one cblas call per expert (a host loop over experts); the element-wise
// parts run over all N rows at once, since they do not depend on the expert.
#include <cblas.h>

#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// Row-major C[M,N] = alpha op(A) op(B) + beta C.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, double beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              (float)alpha, A, (int)lda, B, (int)ldb, (float)beta, C, (int)ldc);
}
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
          const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

inline double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// n elements of the SwiGLU's backward, in double: da (in dg) -> dg = da u silu'(g), du = da silu(g).
template <typename F>
void dswiglu_in_place(const F* g, const F* u, F* dg, F* du, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]), s = sigmoid(gi), da = static_cast<double>(dg[i]);
    du[i] = static_cast<F>(da * gi * s);
    dg[i] = static_cast<F>(da * static_cast<double>(u[i]) * s * (1.0 + gi * (1.0 - s)));
  }
}

struct Dims {
  int64_t N, H, I, E;
  std::vector<int64_t> offsets;  // E + 1 row offsets
};

// Checks x-like [N, H] against the weights and counts; returns the dimensions.
// `w` names the weights ("w" or "dw") in the errors.
Dims check_swiglu(const char* op, int64_t N, int64_t H, const Tensor& counts, const Tensor& w_gate,
                  const Tensor& w_up, const Tensor& w_down, const char* w = "w") {
  MT_CHECK(w_gate.defined() && w_gate.ndim() == 3, "{}: {}_gate must be [E, I, H = {}], got {}", op, w, H,
           w_gate.str());
  Dims d{N, H, w_gate.size(1), w_gate.size(0), {}};
  const std::string p = fmt::format("{} {}", op, w);
  check_shape(w_gate, {d.E, d.I, H}, (p + "_gate [E, I, H]").c_str());
  check_shape(w_up, {d.E, d.I, H}, (p + "_up [E, I, H]").c_str());
  check_shape(w_down, {d.E, H, d.I}, (p + "_down [E, H, I]").c_str());
  check_shape(counts, {d.E}, fmt::format("{} counts [E]", op).c_str());
  check_dtype(counts, DType::I64, fmt::format("{} counts", op).c_str());
  MT_CHECK(N < INT_MAX && H < INT_MAX && d.I < INT_MAX, "{}: dimensions N={} H={} I={} exceed BLAS int range", op,
           N, H, d.I);
  const int64_t* c = counts.data<int64_t>();
  d.offsets.assign(static_cast<size_t>(d.E + 1), 0);
  for (int64_t e = 0; e < d.E; ++e) {
    MT_CHECK(c[e] >= 0, "{}: counts[{}] = {} is negative", op, e, c[e]);
    d.offsets[e + 1] = d.offsets[e] + c[e];
  }
  MT_CHECK(d.offsets[d.E] == N, "{}: counts sum to {} but the input has N = {} rows", op, d.offsets[d.E], N);
  return d;
}

// a = silu(g) * u over n elements.
template <typename F>
void swiglu_act(const F* g, const F* u, F* a, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]);
    a[i] = static_cast<F>(gi * sigmoid(gi) * static_cast<double>(u[i]));
  }
}

}  // namespace

SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up,
                                 const Tensor& w_down) {
  MT_CHECK(x.defined() && x.ndim() == 2, "grouped_swiglu_forward: x must be [N, H], got {}", x.str());
  const Dims d = check_swiglu("grouped_swiglu_forward", x.size(0), x.size(1), counts, w_gate, w_up, w_down);
  check_same_dtype("grouped_swiglu_forward", x.dtype(), {&w_gate, &w_up, &w_down});
  const int64_t N = d.N, H = d.H, I = d.I;
  SwigluOut out;
  out.y = Tensor::empty({N, H}, x.dtype());
  out.gate = Tensor::empty({N, I}, x.dtype());
  out.up = Tensor::empty({N, I}, x.dtype());
  out.act = Tensor::empty({N, I}, x.dtype());
  dispatch_float(x.dtype(), "grouped_swiglu_forward", [&](auto tag) {
    using F = decltype(tag);
    const F *X = x.data<F>(), *Wg = w_gate.data<F>(), *Wu = w_up.data<F>(), *Wd = w_down.data<F>();
    F *G = out.gate.data<F>(), *U = out.up.data<F>(), *A = out.act.data<F>(), *Y = out.y.data<F>();
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
      if (c == 0) continue;
      gemm(false, true, c, I, H, 1.0, X + r0 * H, H, Wg + e * I * H, H, 0.0, G + r0 * I, I);
      gemm(false, true, c, I, H, 1.0, X + r0 * H, H, Wu + e * I * H, H, 0.0, U + r0 * I, I);
    }
    swiglu_act(G, U, A, N * I);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
      if (c == 0) continue;
      gemm(false, true, c, H, I, 1.0, A + r0 * I, I, Wd + e * H * I, I, 0.0, Y + r0 * H, H);
    }
  });
  return out;
}

// FP8: the f32 products of the dequantized operands (the reference the GPU's promoted sums are
// held to), with act quantized per 1 x 128 tile before the down GEMM as on the GPU.
SwigluOut grouped_swiglu_forward_fp8(const Fp8Tensor& x, const Tensor& counts, const Fp8Tensor& w_gate,
                                     const Fp8Tensor& w_up, const Fp8Tensor& w_down, int64_t experts) {
  const int64_t H = x.q.size(1), I = w_gate.q.size(0) / experts;
  const Tensor xd = cpu::dequantize_fp8(x, DType::F32);
  const Tensor wg = cpu::dequantize_fp8(w_gate, DType::F32).view({experts, I, H});
  const Tensor wu = cpu::dequantize_fp8(w_up, DType::F32).view({experts, I, H});
  const Tensor wd = cpu::dequantize_fp8(w_down, DType::F32).view({experts, H, I});
  SwigluOut out = grouped_swiglu_forward(xd, counts, wg, wu, wd);  // gate, up, act; y from act itself
  const Dims d = check_swiglu("grouped_swiglu_forward_fp8", xd.size(0), H, counts, wg, wu, wd);
  out.act_q = cpu::quantize_fp8(out.act, Fp8Blocks::kRows);
  const Tensor act = cpu::dequantize_fp8(out.act_q, DType::F32);
  const float* A = act.data<float>();
  const float* Wd = wd.data<float>();
  float* Y = out.y.data<float>();
  for (int64_t e = 0; e < d.E; ++e) {
    const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
    if (c > 0) gemm(false, true, c, H, I, 1.0, A + r0 * I, I, Wd + e * H * I, I, 0.0, Y + r0 * H, H);
  }
  return out;
}

SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate,
                                               const Tensor& up, const Tensor& w_gate, const Tensor& w_up,
                                               const Tensor& w_down) {
  MT_CHECK(dy.defined() && dy.ndim() == 2, "grouped_swiglu_backward_input: dy must be [N, H], got {}", dy.str());
  const Dims d = check_swiglu("grouped_swiglu_backward_input", dy.size(0), dy.size(1), counts, w_gate, w_up, w_down);
  const int64_t N = d.N, H = d.H, I = d.I;
  check_shape(gate, {N, I}, "grouped_swiglu_backward_input gate");
  check_shape(up, {N, I}, "grouped_swiglu_backward_input up");
  check_same_dtype("grouped_swiglu_backward_input", dy.dtype(), {&gate, &up, &w_gate, &w_up, &w_down});
  SwigluInputGrads g;
  g.dx = Tensor::empty({N, H}, dy.dtype());
  g.dgate = Tensor::empty({N, I}, dy.dtype());
  g.dup = Tensor::empty({N, I}, dy.dtype());
  dispatch_float(dy.dtype(), "grouped_swiglu_backward_input", [&](auto tag) {
    using F = decltype(tag);
    const F *DY = dy.data<F>(), *G = gate.data<F>(), *U = up.data<F>();
    const F *Wg = w_gate.data<F>(), *Wu = w_up.data<F>(), *Wd = w_down.data<F>();
    F *DG = g.dgate.data<F>(), *DU = g.dup.data<F>(), *DX = g.dx.data<F>();
    // da goes into DG first, then is replaced element-wise by dgate.
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
      if (c == 0) continue;
      gemm(false, false, c, I, H, 1.0, DY + r0 * H, H, Wd + e * H * I, I, 0.0, DG + r0 * I, I);
    }
    dswiglu_in_place(G, U, DG, DU, N * I);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
      if (c == 0) continue;
      gemm(false, false, c, H, I, 1.0, DG + r0 * I, I, Wg + e * I * H, H, 0.0, DX + r0 * H, H);
      gemm(false, false, c, H, I, 1.0, DU + r0 * I, I, Wu + e * I * H, H, 1.0, DX + r0 * H, H);
    }
  });
  return g;
}

// FP8: da from the dequantized dy and Wd^T, dgate and dup as the BF16 op makes them, then
// quantized per 1 x 128 tile before the dx GEMM as on the GPU; f32 products throughout.
SwigluInputGrads grouped_swiglu_backward_input_fp8(const Fp8Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                   const Tensor& up, const Fp8Tensor& w_gate_t,
                                                   const Fp8Tensor& w_up_t, const Fp8Tensor& w_down_t,
                                                   int64_t experts) {
  const int64_t N = dy.q.size(0), H = dy.q.size(1), I = w_down_t.q.size(0) / experts;
  const Tensor dyd = cpu::dequantize_fp8(dy, DType::F32);
  const Tensor wgt = cpu::dequantize_fp8(w_gate_t, DType::F32), wut = cpu::dequantize_fp8(w_up_t, DType::F32);
  const Tensor wdt = cpu::dequantize_fp8(w_down_t, DType::F32);
  const Tensor g = gate.to(DType::F32), u = up.to(DType::F32);
  const std::vector<int64_t> c = counts.to_vector<int64_t>();
  SwigluInputGrads out;
  out.dgate = Tensor::empty({N, I}, DType::F32);
  out.dup = Tensor::empty({N, I}, DType::F32);
  out.dx = Tensor::zeros({N, H}, DType::F32);
  const float *DY = dyd.data<float>(), *WgT = wgt.data<float>(), *WuT = wut.data<float>(), *WdT = wdt.data<float>();
  const float *G = g.data<float>(), *U = u.data<float>();
  float *DG = out.dgate.data<float>(), *DU = out.dup.data<float>();
  int64_t r0 = 0;
  for (int64_t e = 0; e < experts; ++e) {  // da = dy Wd = dy (Wd^T)^T, into DG
    if (c[e] > 0) gemm(false, true, c[e], I, H, 1.0, DY + r0 * H, H, WdT + e * I * H, H, 0.0, DG + r0 * I, I);
    r0 += c[e];
  }
  dswiglu_in_place(G, U, DG, DU, N * I);
  const Tensor dgq = cpu::dequantize_fp8(cpu::quantize_fp8(out.dgate, Fp8Blocks::kRows), DType::F32);
  const Tensor duq = cpu::dequantize_fp8(cpu::quantize_fp8(out.dup, Fp8Blocks::kRows), DType::F32);
  const float *QG = dgq.data<float>(), *QU = duq.data<float>();
  float* DX = out.dx.data<float>();
  r0 = 0;
  for (int64_t e = 0; e < experts; ++e) {  // dx = dgate Wg + dup Wu, Wg = (Wg^T)^T
    if (c[e] > 0) {
      gemm(false, true, c[e], H, I, 1.0, QG + r0 * I, I, WgT + e * H * I, I, 0.0, DX + r0 * H, H);
      gemm(false, true, c[e], H, I, 1.0, QU + r0 * I, I, WuT + e * H * I, I, 1.0, DX + r0 * H, H);
    }
    r0 += c[e];
  }
  return out;
}

void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate,
                                    const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate,
                                    Tensor& dw_up, Tensor& dw_down, bool accumulate, SumSquaresInto squares,
                                    const Tensor& act_in) {
  MT_CHECK(x.defined() && x.ndim() == 2, "grouped_swiglu_backward_weight: x must be [N, H], got {}", x.str());
  const Dims d = check_swiglu("grouped_swiglu_backward_weight", x.size(0), x.size(1), counts, dw_gate, dw_up, dw_down,
                              "dw");
  const int64_t N = d.N, H = d.H, I = d.I;
  check_shape(dy, {N, H}, "grouped_swiglu_backward_weight dy");
  if (!act_in.defined()) {  // gate and up only make act
    check_shape(gate, {N, I}, "grouped_swiglu_backward_weight gate");
    check_shape(up, {N, I}, "grouped_swiglu_backward_weight up");
    check_same_dtype("grouped_swiglu_backward_weight", x.dtype(), {&gate, &up});
  }
  check_shape(dgate, {N, I}, "grouped_swiglu_backward_weight dgate");
  check_shape(dup, {N, I}, "grouped_swiglu_backward_weight dup");
  check_same_dtype("grouped_swiglu_backward_weight", x.dtype(), {&dy, &dgate, &dup, &dw_gate, &dw_up, &dw_down});
  Tensor act = act_in.defined() ? act_in : Tensor::empty({N, I}, x.dtype());
  if (!accumulate) {  // an expert without rows still gets its (zero) gradient written
    dw_gate.zero_();
    dw_up.zero_();
    dw_down.zero_();
  }
  dispatch_float(x.dtype(), "grouped_swiglu_backward_weight", [&](auto tag) {
    using F = decltype(tag);
    const F *DY = dy.data<F>(), *X = x.data<F>(), *DG = dgate.data<F>(), *DU = dup.data<F>();
    const F* A = act.data<F>();
    F *dWg = dw_gate.data<F>(), *dWu = dw_up.data<F>(), *dWd = dw_down.data<F>();
    if (!act_in.defined()) swiglu_act(gate.data<F>(), up.data<F>(), act.data<F>(), N * I);
    for (int64_t e = 0; e < d.E; ++e) {
      const int64_t r0 = d.offsets[e], c = d.offsets[e + 1] - r0;
      if (c == 0) continue;
      gemm(true, false, H, I, c, 1.0, DY + r0 * H, H, A + r0 * I, I, 1.0, dWd + e * H * I, I);
      gemm(true, false, I, H, c, 1.0, DG + r0 * I, I, X + r0 * H, H, 1.0, dWg + e * I * H, H);
      gemm(true, false, I, H, c, 1.0, DU + r0 * I, I, X + r0 * H, H, 1.0, dWu + e * I * H, H);
    }
  });
  if (squares.out) sum_squares_all_into({dw_gate, dw_up, dw_down}, *squares.out, squares.index);
}

}  // namespace moetrain::ops::cpu
