#include "engine/parallel/context_attention.h"

#include <memory>
#include <vector>

#include "core/error.h"

namespace moetrain {

namespace {

Tensor like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

// Tags of the ring's messages: a pass's step s sends its keys and values (and, backward,
// their gradient sums) to the next rank; the tags tell them apart (Gloo matches by tag).
uint32_t tag(int64_t step, int kind) { return static_cast<uint32_t>(step * 4 + kind); }
enum : int { kKeys = 0, kValues = 1, kKeyGrads = 2, kValueGrads = 3 };

}  // namespace

// Every rank's places and documents (a few bytes a token, gathered once a pass), and rank r's.
struct ContextAttention::Places {
  int64_t rows;
  Tensor index, segments;
  Tensor rows_of(const Tensor& t, int64_t r) const { return t.slice(r * rows, (r + 1) * rows); }
  ops::AttentionPlaces of(int64_t r) const {
    return {rows_of(index, r), segments.defined() ? rows_of(segments, r) : Tensor()};
  }
};

// A pair of tensors on their way from the previous rank, and the one leaving for the next.
struct ContextAttention::Hop {
  std::vector<std::unique_ptr<P2pRequest>> requests;
  void wait() {
    for (auto& r : requests) r->wait();
    requests.clear();
  }
};

Tensor ContextAttention::gathered(const Tensor& x) const {
  Shape s = x.shape();
  s[0] *= group_.size();
  Tensor out = Tensor::empty(s, x.dtype(), x.device());
  group_.all_gather(x, out);
  return out;
}

ContextAttention::Places ContextAttention::gather_places(const Tensor& rows, const ops::AttentionPlaces& places) const {
  return {rows.size(0), gathered(places.index), places.segments.defined() ? gathered(places.segments) : Tensor()};
}

// Sends a and b to the next rank and receives the previous rank's into a_in, b_in.
ContextAttention::Hop ContextAttention::pass_on(const Tensor& a, const Tensor& b, Tensor& a_in, Tensor& b_in,
                                                int64_t step, int kind_a, int kind_b) const {
  const int n = group_.size(), r = group_.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Hop h;
  h.requests.push_back(group_.isend(a, next, tag(step, kind_a)));
  h.requests.push_back(group_.isend(b, next, tag(step, kind_b)));
  h.requests.push_back(group_.irecv(a_in, prev, tag(step, kind_a)));
  h.requests.push_back(group_.irecv(b_in, prev, tag(step, kind_b)));
  return h;
}

// Step s attends to the keys of rank r - s, which came round the ring while step s - 1
// attended to the ones before; merged in that order (fixed per rank).
ops::AttentionOut ContextAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const ops::AttentionPlaces& places, const ops::AttentionShape& shape) const {
  const int n = group_.size(), r = group_.rank();
  const Places all = gather_places(k, places);
  Tensor k_now = k, v_now = v;
  ops::AttentionOut acc;
  for (int64_t s = 0; s < n; ++s) {
    Tensor k_next, v_next;
    Hop hop;
    if (s + 1 < n) {  // the next block under way while this one is attended to
      k_next = like(k);
      v_next = like(v);
      hop = pass_on(k_now, v_now, k_next, v_next, s, kKeys, kValues);
    }
    const int64_t owner = (r - s + n) % n;
    ops::AttentionOut block = ops::attention_block_forward(q, k_now, v_now, places, all.of(owner), shape, shape.seq);
    if (s == 0) {
      acc = std::move(block);
    } else {
      ops::attention_merge(acc, block);
    }
    hop.wait();
    k_now = std::move(k_next);
    v_now = std::move(v_next);
  }
  return acc;
}

// The keys and values go round again; beside each block travels the sum of its gradients
// over the ranks it has visited, so that after n steps and one more hop each rank holds its
// own keys' dk and dv summed over every rank's queries (in ring order from the owner: fixed).
ops::AttentionGrads ContextAttention::backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const ops::AttentionPlaces& places, const Tensor& out,
                                               const Tensor& lse, const ops::AttentionShape& shape) const {
  const int n = group_.size(), r = group_.rank();
  const Places all = gather_places(k, places);
  Tensor k_now = k, v_now = v;
  Tensor dk_sum, dv_sum;          // the gradient sums of the block in hand, as they arrived
  Tensor dk_sent, dv_sent;        // kept alive until their sends complete
  Hop sums;                       // the sums on their way (sent at the end of the step before)
  ops::AttentionGrads g;
  for (int64_t s = 0; s < n; ++s) {
    Tensor k_next, v_next;
    Hop keys;
    if (s + 1 < n) {
      k_next = like(k);
      v_next = like(v);
      keys = pass_on(k_now, v_now, k_next, v_next, s, kKeys, kValues);
    }
    const int64_t owner = (r - s + n) % n;
    ops::AttentionGrads block =
        ops::attention_block_backward(dout, q, k_now, v_now, places, all.of(owner), out, lse, shape, shape.seq);
    if (s == 0) {
      g.dq = std::move(block.dq);
    } else {
      ops::add_(g.dq, block.dq);
    }
    sums.wait();  // the sums for this block (from the previous rank), and the last ones sent
    if (s == 0) {
      dk_sent = std::move(block.dk);
      dv_sent = std::move(block.dv);
    } else {
      ops::add_(dk_sum, block.dk);
      ops::add_(dv_sum, block.dv);
      dk_sent = std::move(dk_sum);
      dv_sent = std::move(dv_sum);
    }
    dk_sum = like(k);
    dv_sum = like(v);
    sums = pass_on(dk_sent, dv_sent, dk_sum, dv_sum, s, kKeyGrads, kValueGrads);
    keys.wait();
    k_now = std::move(k_next);
    v_now = std::move(v_next);
  }
  sums.wait();  // the last hop brings this rank's own keys' sums home
  g.dk = std::move(dk_sum);
  g.dv = std::move(dv_sum);
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
  return b.context->forward(q, k, v, {b.places, b.segment_ids}, shape);
}

ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape) {
  if (b.context == nullptr) return ops::attention_backward(dout, q, k, v, b.segment_ids, out, lse, shape);
  return b.context->backward(dout, q, k, v, {b.places, b.segment_ids}, out, lse, shape);
}

}  // namespace moetrain
