// The output head as one op over row chunks (see ops.h): a composition of the linear and
// cross-entropy ops of whichever backend the tensors live on, so it needs no kernel of its
// own and the per-op backend tests cover its parts. Per chunk of rows r:
//   logits_r = x_r W^T;  loss += sum CE(logits_r);  dlogits_r = scale (softmax - onehot)
//   dx_r = dlogits_r W;  dW += dlogits_r^T x_r
// With the backward, the loss and dlogits_r come from one op that writes dlogits_r over the
// logits (cross_entropy_forward_backward_: one read of them on the GPU, no second buffer).
// The loss sums stay on the device (one f32 [1] accumulator): no host wait per chunk.
#include "ops/ops.h"

namespace moetrain::ops {

LinearCrossEntropyOut linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& targets, double scale,
                                           Tensor* dx, Tensor* dw, int64_t chunk_rows, bool accumulate_dw) {
  MT_CHECK(x.defined() && w.defined() && targets.defined(), "linear_cross_entropy: x, w and targets must be defined");
  MT_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.size(1) == w.size(1),
           "linear_cross_entropy: x {} and w {} must be [T, H] and [V, H]", x.str(), w.str());
  const int64_t T = x.size(0), V = w.size(0);
  check_shape(targets, {T}, "linear_cross_entropy targets");
  MT_CHECK(dw == nullptr || dx != nullptr, "linear_cross_entropy: dw needs dx (the backward pass)");
  if (dw) check_shape(*dw, w.shape(), "linear_cross_entropy dw");
  // Default: chunks of 256 M logits (512 MB in bf16, as much again for their gradient). The
  // head's dW is added into once per chunk (an f32 read and write of [V, H] each time), so
  // fewer chunks move fewer bytes: at the bench shape (8192 x 32768 logits) one chunk instead
  // of four of 64 M took the loss stage from 5.31-5.40 to 4.89-5.05 ms, peak memory unchanged.
  if (chunk_rows <= 0) chunk_rows = std::max<int64_t>(1, (int64_t{256} << 20) / std::max<int64_t>(V, 1));
  chunk_rows = std::min(chunk_rows, std::max<int64_t>(T, 1));

  LinearCrossEntropyOut out;
  const bool one_chunk = T > 0 && chunk_rows >= T;  // then dx is that chunk's, not a copy of it
  if (dx && !one_chunk) *dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  for (int64_t r0 = 0; r0 < T; r0 += chunk_rows) {
    const int64_t r1 = std::min(T, r0 + chunk_rows);
    const Tensor xr = x.slice(r0, r1), tr = targets.slice(r0, r1);
    Tensor logits = linear_forward(xr, w);
    // With the backward, the logits become their gradient in the same pass (read once).
    CrossEntropyOut ce = dx ? cross_entropy_forward_backward_(logits, tr, scale) : cross_entropy_forward(logits, tr);
    if (out.loss_sum.defined()) {
      add_(out.loss_sum, ce.loss_sum);
    } else {
      out.loss_sum = ce.loss_sum;
    }
    if (!dx) continue;
    const Tensor& dlogits = logits;
    if (one_chunk) {
      *dx = linear_backward_input(dlogits, w);
    } else {
      dx->slice(r0, r1).copy_from(linear_backward_input(dlogits, w));
    }
    if (dw) linear_backward_weight(dlogits, xr, *dw, accumulate_dw || r0 > 0);
  }
  if (!out.loss_sum.defined()) out.loss_sum = Tensor::zeros({1}, DType::F32, x.device());
  return out;
}

}  // namespace moetrain::ops
