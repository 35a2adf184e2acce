#include "engine/models/projections.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/error.h"

namespace moetrain {

const Projections& bf16_projections() {
  static const Projections plain;
  return plain;
}

void Projections::set_fp8(bool on) {
  fp8_ = on;
  kept_.clear();
  pending_.clear();
}

void Projections::keep_weights(bool on) {
  keep_ = on;
  if (!on) {
    kept_.clear();
    pending_.clear();
  }
}

ops::Fp8Tensor Projections::grad_rows(const Tensor& dy) const {
  // A view of part of a buffer (a slice of the gradient under tensor parallelism, a chunk of a
  // gather's buffer) is not what the weight gradient asks for, and the buffer's other views
  // would keep its entry: quantized here alone.
  if (!keep_ || dy.ndim() != 2 || !dy.whole_storage()) return ops::quantize_fp8(dy, ops::Fp8Blocks::kRows);
  prune_pending();
  ops::Fp8BothWays both = ops::quantize_fp8_both_ways(dy);
  pending_[{dy.raw(), dy.size(0), dy.size(1)}] = Pending{dy, std::move(both.tokens), ++pending_made_};
  if (pending_.size() > kMaxPending) {  // the oldest: a weight gradient that reads another tensor
    pending_.erase(std::min_element(pending_.begin(), pending_.end(), [](const auto& a, const auto& b) {
      return a.second.made < b.second.made;
    }));
  }
  return std::move(both.rows);
}

ops::Fp8Tensor Projections::grad_tokens(const Tensor& dy) const {
  const auto it = dy.ndim() == 2 ? pending_.find({dy.raw(), dy.size(0), dy.size(1)}) : pending_.end();
  if (it == pending_.end()) return ops::quantize_fp8_transposed(dy);
  ops::Fp8Tensor codes = std::move(it->second.tokens);
  pending_.erase(it);  // taken once: a second weight gradient of the same dy quantizes it again
  return codes;
}

void Projections::prune_pending() const {
  std::erase_if(pending_, [](const auto& entry) { return !entry.second.dy.storage_shared(); });
}

ops::Fp8Tensor Projections::weight_blocks(const Tensor& w, bool transposed) const {
  if (!keep_) {
    return transposed ? ops::quantize_fp8_transposed(w, ops::Fp8Blocks::kBlocks)
                      : ops::quantize_fp8(w, ops::Fp8Blocks::kBlocks);
  }
  MT_CHECK(w.shape().size() == 2, "Projections: weight of shape {} is not a matrix", shape_str(w.shape()));
  const Kept& k = kept_both_ways(w, w.shape()[0], w.shape()[1]);
  return transposed ? k.w_t : k.w;
}

const Projections::Kept& Projections::kept_both_ways(const Tensor& w, int64_t rows, int64_t cols) const {
  Kept& k = kept_[{w.raw(), rows, cols}];
  if (!k.w.q.defined()) {  // a step's products read both: one pass for both
    ops::Fp8WeightBlocks both = ops::quantize_fp8_weight(w);
    k.w = std::move(both.w);
    k.w_t = std::move(both.w_t);
  }
  return k;
}

ops::Fp8Tensor Projections::expert_blocks(const Tensor& w, bool transposed) const {
  if (!keep_) {
    ops::Fp8Tensor blocks = ops::quantize_fp8_experts(w);
    return transposed ? ops::transpose_fp8_experts(blocks, w.size(0)) : blocks;
  }
  const Kept& k = kept_both_ways(w, w.size(0) * w.size(1), w.size(2));  // the [E n, k] view's place
  return transposed ? k.w_t : k.w;
}

bool Projections::fp8_experts(int64_t hidden, int64_t width) const {
  return fp8_ && hidden % 128 == 0 && width % 128 == 0;
}

bool Projections::fp8_experts_wgrad(int64_t hidden, int64_t width) const {
  const char* v = std::getenv("MOETRAIN_FP8_EXPERTS_WGRAD");  // read at each call: tests switch it
  return fp8_experts(hidden, width) && v != nullptr && std::string(v) == "1";
}

ops::SwigluOut Projections::experts_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate,
                                            const Tensor& w_up, const Tensor& w_down, const ops::Fp8Tensor& x_q) const {
  if (!fp8_experts(x.size(1), w_gate.size(1))) return ops::grouped_swiglu_forward(x, counts, w_gate, w_up, w_down);
  ops::SwigluOut out =
      ops::grouped_swiglu_forward_fp8(x_q.q.defined() ? x_q : ops::quantize_fp8(x, ops::Fp8Blocks::kRows), counts,
                                      expert_blocks(w_gate), expert_blocks(w_up), expert_blocks(w_down), w_gate.size(0));
  out.act_q = {};  // the down GEMM's input only: not kept for the backward
  return out;
}

ops::SwigluInputGrads Projections::experts_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                          const Tensor& up, const Tensor& w_gate, const Tensor& w_up,
                                                          const Tensor& w_down, const ops::Fp8Tensor& dy_q) const {
  // A/B switch until the FP8 input gradient is measured against the BF16 one (temporary).
  static const bool bf16_input_grad = std::getenv("MOETRAIN_FP8_EXPERTS_BF16_DGRAD") != nullptr;
  if (!fp8_experts(dy.size(1), w_gate.size(1)) || bf16_input_grad) {
    return ops::grouped_swiglu_backward_input(dy, counts, gate, up, w_gate, w_up, w_down);
  }
  return ops::grouped_swiglu_backward_input_fp8(dy_q.q.defined() ? dy_q : ops::quantize_fp8(dy, ops::Fp8Blocks::kRows),
                                                counts, gate, up,
                                                expert_blocks(w_gate, true), expert_blocks(w_up, true),
                                                expert_blocks(w_down, true), w_gate.size(0));
}

Projections::Input Projections::rows(const Tensor& x) const {
  Input in{x, {}, false};
  if (fp8_) in.q = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
  return in;
}

ops::RmsNormOut Projections::norm(const Tensor& x, const Tensor& w, double eps, bool quantize) const {
  if (quantize && fp8_ && w.numel() % 128 == 0) return ops::rmsnorm_forward_fp8(x, w, eps);
  return ops::rmsnorm_forward(x, w, eps);
}

Projections::Input Projections::rows(ops::RmsNormOut& n) const {
  if (!fp8_ || !n.y_q.q.defined()) return rows(n.y);
  return Input{n.y, std::exchange(n.y_q, {}), false};
}

Projections::Input Projections::tokens(const Tensor& x) const {
  Input in{x, {}, true};
  if (fp8_) in.q = ops::quantize_fp8_transposed(x);
  return in;
}

Tensor Projections::forward(const Input& x, const Tensor& w, const Tensor& residual) const {
  MT_CHECK(!x.along_tokens, "Projections::forward: the input was quantized along the tokens (tokens()), "
                            "a forward reads it along the features (rows())");
  if (!fp8_) return ops::linear_forward(x.x, w, residual);
  MT_CHECK(x.q.q.defined(), "Projections::forward: the input was prepared before FP8 was switched on");
  const ops::Fp8Tensor wq = weight_blocks(w, /*transposed=*/false);
  if (!residual.defined()) return ops::linear_fp8(x.q, wq, x.x.dtype());
  Tensor y = residual.clone();  // the residual added in the GEMM's epilogue
  ops::linear_fp8_into(x.q, wq, y, /*accumulate=*/true);
  return y;
}

Tensor Projections::backward_input(const Tensor& dy, const Tensor& w) const {
  if (!fp8_) return ops::linear_backward_input(dy, w);
  return ops::linear_fp8(grad_rows(dy), weight_blocks(w, /*transposed=*/true), dy.dtype());
}

void Projections::backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) const {
  if (!fp8_) return ops::linear_backward_input_add(dy, w, dx);
  ops::linear_fp8_into(grad_rows(dy), weight_blocks(w, /*transposed=*/true), dx, /*accumulate=*/true);
}

void Projections::backward_weight(const Tensor& dy, const Input& x, Tensor& dw, bool accumulate) const {
  MT_CHECK(x.along_tokens || !fp8_, "Projections::backward_weight: the input was quantized along the features "
                                    "(rows()), a weight gradient reads it along the tokens (tokens())");
  if (!fp8_) return ops::linear_backward_weight(dy, x.x, dw, accumulate);
  MT_CHECK(x.q.q.defined(), "Projections::backward_weight: the input was prepared before FP8 was switched on");
  ops::linear_fp8_into(grad_tokens(dy), x.q, dw, accumulate);
}

}  // namespace moetrain
