// Projections: the matrix products of a decoder layer's projections (attention's q/k/v/o,
// MLA's latents) in BF16 (the ops as they are) or, with [training].fp8, in DeepSeek-V3's
// block-scaled FP8 (docs/fp8.md): the input and the output gradient quantized per 1 x 128
// tile, the weight per 128 x 128 block (W^T's blocks for the input gradient), the weight
// gradient from both operands quantized along the tokens; f32 sums promoted every 128 of K.
// The experts' (and dense MLPs') SwiGLU forward and input gradient too, where their widths are
// multiples of 128 (experts_forward, experts_backward_input); their weight gradients, the
// router, the head, the norms and the attention core stay BF16.
// One per model, shared by its layers; the layers call these instead of ops::linear_*.
#pragma once

#include <map>
#include <tuple>

#include "core/tensor.h"
#include "ops/ops.h"

namespace moetrain {

class Projections {
 public:
  void set_fp8(bool on);
  bool fp8() const { return fp8_; }

  // An input that several products read (q, k and v all read the normed input), quantized
  // once under FP8: per 1 x 128 tile along the features for forwards (`rows`), along the
  // tokens for weight gradients (`tokens`). Plain BF16 keeps only x.
  struct Input {
    Tensor x;
    ops::Fp8Tensor q;  // FP8 only
    bool along_tokens = false;
  };
  Input rows(const Tensor& x) const;
  Input tokens(const Tensor& x) const;
  // RMSNorm of x for FP8 products that read its output along the features: under FP8, where
  // the width is whole tiles and `quantize` (the caller's readers are FP8: false for the
  // experts' input where their widths stay BF16), the norm quantizes its output in the same
  // pass (ops::rmsnorm_forward_fp8, y_q), which rows(n) or the dispatch then takes instead of
  // a quantizer's pass.
  ops::RmsNormOut norm(const Tensor& x, const Tensor& w, double eps, bool quantize = true) const;
  // rows() of a norm's output: the codes norm() made (moved out of n: read once), else made now.
  Input rows(ops::RmsNormOut& n) const;

  // y = x W^T (+ residual).
  Tensor forward(const Input& x, const Tensor& w, const Tensor& residual = Tensor()) const;
  Tensor forward(const Tensor& x, const Tensor& w, const Tensor& residual = Tensor()) const {
    return forward(rows(x), w, residual);
  }
  // dx = dy W, and dx += dy W.
  Tensor backward_input(const Tensor& dy, const Tensor& w) const;
  void backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) const;
  // dW = dy^T x (written, or added when `accumulate`).
  void backward_weight(const Tensor& dy, const Input& x, Tensor& dw, bool accumulate) const;
  void backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) const {
    backward_weight(dy, tokens(x), dw, accumulate);
  }

  // ops::grouped_swiglu_forward of x [N, H] over the experts' weights [E, I, H], [E, I, H],
  // [E, H, I]; under FP8, when H and I are multiples of 128 (each expert's weights in whole
  // 128 x 128 blocks), from x per 1 x 128 tile and the weights per block (kept like the
  // projections' weights), act quantized for the down GEMM (ops::grouped_swiglu_forward_fp8).
  // Other widths stay BF16. x_q: x already quantized per 1 x 128 tile (the dispatch's
  // DispatchOut::rows_q), or undefined.
  ops::SwigluOut experts_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up,
                                 const Tensor& w_down, const ops::Fp8Tensor& x_q = {}) const;
  // ops::grouped_swiglu_backward_input, in FP8 where experts_forward is (dy per 1 x 128 tile,
  // each expert's W^T blocks moved from W's, kept like them: ops::grouped_swiglu_backward_input_fp8).
  // dy_q: dy's codes where a producer made them (the combine's backward), else dy is quantized.
  ops::SwigluInputGrads experts_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate,
                                               const Tensor& up, const Tensor& w_gate, const Tensor& w_up,
                                               const Tensor& w_down, const ops::Fp8Tensor& dy_q = {}) const;
  // Whether experts_forward and experts_backward_input run these widths in FP8.
  bool fp8_experts(int64_t hidden, int64_t width) const;
  // Whether the experts' weight gradients run in FP8 too (ops::grouped_swiglu_backward_weight_fp8):
  // where fp8_experts does and the environment sets MOETRAIN_FP8_EXPERTS_WGRAD=1; off by
  // default while its operands' separate quantizations make it slower than BF16 (docs/fp8.md).
  bool fp8_experts_wgrad(int64_t hidden, int64_t width) const;

  // Between keep_weights(true) and keep_weights(false) the caller promises that no weight
  // changes and that each weight stays where it is (one training step's micro-batches with
  // whole weights: not under ZeRO-3, whose gathers reuse memory): a weight's FP8 blocks, and
  // its transpose's, are made at its first use and reused by the later micro-batches. Off
  // (the default, and what keep_weights(false) returns to) every use quantizes afresh, so a
  // caller that never says it loses only speed. keep_weights(false) frees the copies.
  void keep_weights(bool on);
  // How many weights are held quantized now (tests).
  size_t kept_weights() const { return kept_.size(); }
  // How many output gradients' codes along the tokens wait for a weight gradient (tests).
  size_t pending_grads() const { return pending_.size(); }

 private:
  // dy's codes along the features for an input gradient (quantize_fp8 rows mode). Between
  // keep_weights(true) and (false) they are made with its codes along the tokens in one pass
  // (ops::quantize_fp8_both_ways), which wait in pending_ for the weight gradient of the same
  // dy (grad_tokens): the layers hand an output gradient to both products, the weight
  // gradient soon after (in the layer's backward, or a few micro-batches later where a
  // pipeline defers it). A projection's input is not held so: its codes along the tokens would
  // wait from the forward to the backward, activation memory for one pass saved.
  ops::Fp8Tensor grad_rows(const Tensor& dy) const;
  // dy's codes along the tokens for a weight gradient: pending_'s (taken out), else made now.
  ops::Fp8Tensor grad_tokens(const Tensor& dy) const;
  // Drops the pending codes of gradients that nothing but the entry holds any more: no weight
  // gradient can ask for them.
  void prune_pending() const;

  // W's blocks, or W^T's (transposed), made now or taken from the kept copies (a handle). A
  // weight kept is quantized both ways at its first use, in one pass (ops::quantize_fp8_weight).
  ops::Fp8Tensor weight_blocks(const Tensor& w, bool transposed) const;
  // An expert weight [E, n, k]'s blocks (ops::quantize_fp8_experts), or each expert's W^T's
  // (transposed: ops::transpose_fp8_experts of W's), made or kept (as weight_blocks).
  ops::Fp8Tensor expert_blocks(const Tensor& w, bool transposed = false) const;

  bool fp8_ = false;
  bool keep_ = false;
  struct Kept {
    ops::Fp8Tensor w, w_t;  // made together at the weight's first use
  };
  // w's kept entry under the key (w's place, rows, cols), made both ways in one pass
  // (ops::quantize_fp8_weight) at its first use: weight_blocks' and expert_blocks' one store.
  const Kept& kept_both_ways(const Tensor& w, int64_t rows, int64_t cols) const;
  // Keyed by where the weight's elements start and its shape: MLA's kv_a weight is read as
  // two row blocks, views of one tensor.
  mutable std::map<std::tuple<const void*, int64_t, int64_t>, Kept> kept_;
  // An output gradient's codes along the tokens, keyed as kept_ (where its elements start and
  // its shape); dy is held so that its place is not reused while the entry lives. At most
  // kMaxPending wait (the oldest go first): a weight gradient that reads another tensor than
  // its input gradient did (a slice of it, under tensor parallelism) leaves its entry behind,
  // and a view of a buffer that lives all step would keep it.
  struct Pending {
    Tensor dy;
    ops::Fp8Tensor tokens;
    uint64_t made = 0;
  };
  static constexpr size_t kMaxPending = 16;
  mutable std::map<std::tuple<const void*, int64_t, int64_t>, Pending> pending_;
  mutable uint64_t pending_made_ = 0;
};

// BF16 projections, for a layer built without a model (tests, reference layers).
const Projections& bf16_projections();

}  // namespace moetrain
