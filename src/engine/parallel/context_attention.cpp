#include "engine/parallel/context_attention.h"

#include <vector>

#include "core/error.h"

namespace moetrain {

Tensor ContextAttention::gathered(const Tensor& x) const {
  Shape s = x.shape();
  s[0] *= group_.size();
  Tensor out = Tensor::empty(s, x.dtype(), x.device());
  group_.all_gather(x, out);
  return out;
}

ops::AttentionOut ContextAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const ops::AttentionPlaces& places, const ops::AttentionShape& shape) const {
  const int64_t rows = k.size(0), P = group_.size();
  const Tensor ks = gathered(k), vs = gathered(v), index = gathered(places.index);
  const Tensor segs = places.segments.defined() ? gathered(places.segments) : Tensor();
  ops::AttentionOut acc;
  for (int64_t r = 0; r < P; ++r) {  // rank r's block of keys
    const ops::AttentionPlaces kp{index.slice(r * rows, (r + 1) * rows),
                                  segs.defined() ? segs.slice(r * rows, (r + 1) * rows) : Tensor()};
    ops::AttentionOut block = ops::attention_block_forward(q, ks.slice(r * rows, (r + 1) * rows),
                                                           vs.slice(r * rows, (r + 1) * rows), places, kp, shape,
                                                           shape.seq);
    if (r == 0) {
      acc = std::move(block);
    } else {
      ops::attention_merge(acc, block);
    }
  }
  return acc;
}

ops::AttentionGrads ContextAttention::backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const ops::AttentionPlaces& places, const Tensor& out,
                                               const Tensor& lse, const ops::AttentionShape& shape) const {
  const int64_t rows = k.size(0), P = group_.size();
  const Tensor ks = gathered(k), vs = gathered(v), index = gathered(places.index);
  const Tensor segs = places.segments.defined() ? gathered(places.segments) : Tensor();
  Shape ksh = k.shape(), vsh = v.shape();
  ksh[0] *= P;
  vsh[0] *= P;
  Tensor dk_all = Tensor::empty(ksh, k.dtype(), k.device()), dv_all = Tensor::empty(vsh, v.dtype(), v.device());
  ops::AttentionGrads g;
  for (int64_t r = 0; r < P; ++r) {
    const ops::AttentionPlaces kp{index.slice(r * rows, (r + 1) * rows),
                                  segs.defined() ? segs.slice(r * rows, (r + 1) * rows) : Tensor()};
    ops::AttentionGrads block =
        ops::attention_block_backward(dout, q, ks.slice(r * rows, (r + 1) * rows), vs.slice(r * rows, (r + 1) * rows),
                                      places, kp, out, lse, shape, shape.seq);
    if (r == 0) {
      g.dq = std::move(block.dq);
    } else {
      ops::add_(g.dq, block.dq);
    }
    dk_all.slice(r * rows, (r + 1) * rows).copy_from(block.dk);
    dv_all.slice(r * rows, (r + 1) * rows).copy_from(block.dv);
  }
  g.dk = Tensor::empty(k.shape(), k.dtype(), k.device());
  g.dv = Tensor::empty(v.shape(), v.dtype(), v.device());
  group_.reduce_scatter(dk_all, g.dk);  // each rank's keys: the sum over every rank's queries
  group_.reduce_scatter(dv_all, g.dv);
  return g;
}

ops::AttentionOut attend(const Tensor& q, const Tensor& k, const Tensor& v, const BatchShape& b,
                         const ops::AttentionShape& shape) {
  if (b.context == nullptr) return ops::attention_forward(q, k, v, b.segment_ids, shape);
  return b.context->forward(q, k, v, {b.places, b.segment_ids}, shape);
}

ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape) {
  if (b.context == nullptr) return ops::attention_backward(dout, q, k, v, b.segment_ids, out, lse, shape);
  return b.context->backward(dout, q, k, v, {b.places, b.segment_ids}, out, lse, shape);
}

}  // namespace moetrain
