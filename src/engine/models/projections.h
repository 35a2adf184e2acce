// Projections: the matrix products of a decoder layer's projections (attention's q/k/v/o,
// MLA's latents) in BF16 (the ops as they are) or, with [training].fp8, in DeepSeek-V3's
// block-scaled FP8 (docs/fp8.md): the input and the output gradient quantized per 1 x 128
// tile, the weight per 128 x 128 block (W^T's blocks for the input gradient), the weight
// gradient from both operands quantized along the tokens; f32 sums promoted every 128 of K.
// The router, the head, the norms, the attention core and (for now) the experts stay BF16.
// One per model, shared by its layers; the layers call these instead of ops::linear_*.
#pragma once

#include "core/tensor.h"

namespace moetrain {

class Projections {
 public:
  void set_fp8(bool on) { fp8_ = on; }
  bool fp8() const { return fp8_; }
  // y = x W^T (+ residual).
  Tensor forward(const Tensor& x, const Tensor& w, const Tensor& residual = Tensor()) const;
  // dx = dy W, and dx += dy W.
  Tensor backward_input(const Tensor& dy, const Tensor& w) const;
  void backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) const;
  // dW = dy^T x (written, or added when `accumulate`).
  void backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) const;

 private:
  bool fp8_ = false;
};

// BF16 projections, for a layer built without a model (tests, reference layers).
const Projections& bf16_projections();

}  // namespace moetrain
