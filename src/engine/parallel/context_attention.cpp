#include "engine/parallel/context_attention.h"

#include <memory>
#include <vector>

#include <spdlog/spdlog.h>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "engine/telemetry/collective_timer.h"

namespace moetrain {

namespace {

Tensor like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

// The running sums (the merged output, dq, the key/value gradient sums) stay f32 where the
// kernels give bf16, and are rounded once at the end.
DType sum_dtype(const Tensor& t) { return t.dtype() == DType::BF16 ? DType::F32 : t.dtype(); }
Tensor as_dtype(const Tensor& t, DType d) { return t.dtype() == d ? t : t.to(d); }
Tensor sum_like(const Tensor& t) { return Tensor::empty(t.shape(), sum_dtype(t), t.device()); }

// Tags of the ring's messages: a pass's step s sends its keys and values (and, backward,
// their gradient sums) to the next rank; the tags tell them apart (Gloo matches by tag).
uint32_t tag(int64_t step, int kind) { return static_cast<uint32_t>(step * 4 + kind); }
enum : int { kKeys = 0, kKeyGrads = 2 };  // keys and values: tags kKeys, kKeys + 1; their sums likewise

// Which part of this rank's queries (chunks r and 2cp-1-r, n rows a sequence) sees rank j's
// keys (chunks j and 2cp-1-j), in the zigzag order: its own keys causally; an earlier rank's
// first chunk by every query; a later rank's two chunks by the second chunk's queries only.
// segments: this rank's documents; all_segments: every rank's, back to back (or both undefined).
ops::AttentionPart part_of(int64_t me, int64_t owner, int64_t n, const Tensor& segments, const Tensor& all_segments) {
  const Tensor owners = all_segments.defined()
                            ? all_segments.slice(owner * segments.size(0), (owner + 1) * segments.size(0))
                            : Tensor();
  ops::AttentionPart p;
  if (owner == me) {
    p = {0, n, 0, n, true};
  } else if (owner < me) {
    p = {0, n, 0, n / 2, false};
  } else {
    p = {n / 2, n, 0, n, false};
  }
  p.q_segments = segments;
  p.k_segments = owner == me ? segments : owners;  // the same tensor: the whole causal kernels apply
  return p;
}

}  // namespace

ContextAttention::ContextAttention(Communicator& group) : group_(group), ring_(group, Collective::kContextRing) {}
ContextAttention::~ContextAttention() = default;

Tensor ContextAttention::gathered(const Tensor& x) const {
  Shape s = x.shape();
  s[0] *= group_.size();
  Tensor out = Tensor::empty(s, x.dtype(), x.device());
  group_.all_gather(x, out);
  return out;
}

// Step s attends to the keys of rank r - s, which came round the ring while step s - 1
// attended to the ones before; merged in that order (fixed per rank).
ops::AttentionOut ContextAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& segments, const ops::AttentionShape& shape) const {
  const int n = group_.size(), r = group_.rank();
  const Tensor all_segments = segments.defined() ? gathered(segments) : Tensor();
  Tensor k_now = k, v_now = v;
  ops::AttentionOut acc;
  for (int64_t s = 0; s < n; ++s) {
    Tensor k_next, v_next;
    Ring::Hop hop;
    if (s + 1 < n) {  // the next block under way while this one is attended to
      k_next = like(k);
      v_next = like(v);
      hop = ring_.pass_on({k_now, v_now}, {k_next, v_next}, tag(s, kKeys));
    }
    const int64_t owner = (r - s + n) % n;
    const ops::AttentionPart part = part_of(r, owner, shape.seq, segments, all_segments);
    ops::AttentionOut block = ops::attention_part_forward(q, k_now, v_now, part, shape);
    if (s == 0) {
      acc = {as_dtype(block.out, sum_dtype(block.out)), std::move(block.lse)};
    } else {
      ops::attention_merge(acc, block);
    }
    hop.wait();
    k_now = std::move(k_next);
    v_now = std::move(v_next);
  }
  acc.out = as_dtype(acc.out, q.dtype());
  return acc;
}

// The keys and values go round again; beside each block travels the sum of its gradients
// over the ranks it has visited, so that after n steps and one more hop each rank holds its
// own keys' dk and dv summed over every rank's queries (in ring order from the owner: fixed).
ops::AttentionGrads ContextAttention::backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& segments, const Tensor& out,
                                               const Tensor& lse, const ops::AttentionShape& shape) const {
  const int n = group_.size(), r = group_.rank();
  const Tensor all_segments = segments.defined() ? gathered(segments) : Tensor();
  Tensor k_now = k, v_now = v;
  Tensor dk_sum, dv_sum;  // the gradient sums of the block in hand, as they arrived
  Ring::Hop sums;         // the sums on their way (sent at the end of the step before)
  ops::AttentionGrads g;
  for (int64_t s = 0; s < n; ++s) {
    Tensor k_next, v_next;
    Ring::Hop keys;
    if (s + 1 < n) {
      k_next = like(k);
      v_next = like(v);
      keys = ring_.pass_on({k_now, v_now}, {k_next, v_next}, tag(s, kKeys));
    }
    const int64_t owner = (r - s + n) % n;
    const ops::AttentionPart part = part_of(r, owner, shape.seq, segments, all_segments);
    ops::AttentionGrads block = ops::attention_part_backward(dout, q, k_now, v_now, part, out, lse, shape);
    if (s == 0) {
      g.dq = as_dtype(block.dq, sum_dtype(block.dq));
    } else {
      ops::add_(g.dq, block.dq);
    }
    sums.wait();  // the sums for this block (from the previous rank), and the last ones sent
    Tensor dk_send, dv_send;
    if (s == 0) {
      dk_send = as_dtype(block.dk, sum_dtype(block.dk));
      dv_send = as_dtype(block.dv, sum_dtype(block.dv));
    } else {
      ops::add_(dk_sum, block.dk);
      ops::add_(dv_sum, block.dv);
      dk_send = std::move(dk_sum);
      dv_send = std::move(dv_sum);
    }
    dk_sum = sum_like(block.dk);
    dv_sum = sum_like(block.dv);
    sums = ring_.pass_on({dk_send, dv_send}, {dk_sum, dv_sum}, tag(s, kKeyGrads));
    keys.wait();
    k_now = std::move(k_next);
    v_now = std::move(v_next);
  }
  sums.wait();  // the last hop brings this rank's own keys' sums home
  g.dq = as_dtype(g.dq, q.dtype());
  g.dk = as_dtype(dk_sum, k.dtype());
  g.dv = as_dtype(dv_sum, v.dtype());
  return g;
}

ops::SeqBalanceWhole ContextAttention::whole_sequences(const Tensor& topk_idx, int64_t batch, int64_t seq,
                                                      int64_t experts) const {
  ops::SeqBalanceWhole w{ops::seq_balance_counts(topk_idx, batch, experts), seq * group_.size()};
  group_.all_reduce(w.counts);  // small integers in f64: exact in any order
  return w;
}

ops::AttentionOut attend(const Tensor& q, const Tensor& k, const Tensor& v, const BatchShape& b,
                         const ops::AttentionShape& shape) {
  if (b.context == nullptr) return ops::attention_forward(q, k, v, b.segment_ids, shape);
  return b.context->forward(q, k, v, b.segment_ids, shape);
}

ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape) {
  if (b.context == nullptr) return ops::attention_backward(dout, q, k, v, b.segment_ids, out, lse, shape);
  return b.context->backward(dout, q, k, v, b.segment_ids, out, lse, shape);
}

}  // namespace moetrain
