#include "engine/models/projections.h"

#include "ops/ops.h"

namespace moetrain {

// The weights are quantized on every use (per micro-batch): once per optimizer step, reused
// by the step's micro-batches, is the next step (docs/fp8.md), which needs to know when a
// weight changed (optimizer steps, loads, recoveries, ZeRO-3's gathers).

const Projections& bf16_projections() {
  static const Projections plain;
  return plain;
}

Tensor Projections::forward(const Tensor& x, const Tensor& w, const Tensor& residual) const {
  if (!fp8_) return ops::linear_forward(x, w, residual);
  const ops::Fp8Tensor xq = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor wq = ops::quantize_fp8(w, ops::Fp8Blocks::kBlocks);
  if (!residual.defined()) return ops::linear_fp8(xq, wq, x.dtype());
  Tensor y = residual.clone();  // the residual added in the GEMM's epilogue
  ops::linear_fp8_into(xq, wq, y, /*accumulate=*/true);
  return y;
}

Tensor Projections::backward_input(const Tensor& dy, const Tensor& w) const {
  if (!fp8_) return ops::linear_backward_input(dy, w);
  return ops::linear_fp8(ops::quantize_fp8(dy, ops::Fp8Blocks::kRows),
                         ops::quantize_fp8_transposed(w, ops::Fp8Blocks::kBlocks), dy.dtype());
}

void Projections::backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) const {
  if (!fp8_) return ops::linear_backward_input_add(dy, w, dx);
  ops::linear_fp8_into(ops::quantize_fp8(dy, ops::Fp8Blocks::kRows),
                       ops::quantize_fp8_transposed(w, ops::Fp8Blocks::kBlocks), dx, /*accumulate=*/true);
}

void Projections::backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) const {
  if (!fp8_) return ops::linear_backward_weight(dy, x, dw, accumulate);
  ops::linear_fp8_into(ops::quantize_fp8_transposed(dy), ops::quantize_fp8_transposed(x), dw, accumulate);
}

}  // namespace moetrain
