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

// Every rank's keys, values, places and documents, and rank r's block of them.
struct ContextAttention::Blocks {
  int64_t rows;
  Tensor k, v, index, segments;
  Tensor rows_of(const Tensor& t, int64_t r) const { return t.slice(r * rows, (r + 1) * rows); }
  ops::AttentionPlaces places(int64_t r) const {
    return {rows_of(index, r), segments.defined() ? rows_of(segments, r) : Tensor()};
  }
};

ContextAttention::Blocks ContextAttention::gather(const Tensor& k, const Tensor& v,
                                                  const ops::AttentionPlaces& places) const {
  return {k.size(0), gathered(k), gathered(v), gathered(places.index),
          places.segments.defined() ? gathered(places.segments) : Tensor()};
}

ops::AttentionOut ContextAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const ops::AttentionPlaces& places, const ops::AttentionShape& shape) const {
  const Blocks all = gather(k, v, places);
  ops::AttentionOut acc;
  for (int64_t r = 0; r < group_.size(); ++r) {  // rank r's block of keys
    ops::AttentionOut block = ops::attention_block_forward(q, all.rows_of(all.k, r), all.rows_of(all.v, r), places,
                                                           all.places(r), shape, shape.seq);
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
  const Blocks all = gather(k, v, places);  // gathered again rather than kept from the forward
  Tensor dk_all = Tensor::empty(all.k.shape(), k.dtype(), k.device());
  Tensor dv_all = Tensor::empty(all.v.shape(), v.dtype(), v.device());
  ops::AttentionGrads g;
  for (int64_t r = 0; r < group_.size(); ++r) {
    ops::AttentionGrads block = ops::attention_block_backward(dout, q, all.rows_of(all.k, r), all.rows_of(all.v, r),
                                                              places, all.places(r), out, lse, shape, shape.seq);
    if (r == 0) {
      g.dq = std::move(block.dq);
    } else {
      ops::add_(g.dq, block.dq);
    }
    all.rows_of(dk_all, r).copy_from(block.dk);
    all.rows_of(dv_all, r).copy_from(block.dv);
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
