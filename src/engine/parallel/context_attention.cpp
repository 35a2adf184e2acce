#include "engine/parallel/context_attention.h"

#include <memory>
#include <vector>

#include "core/error.h"
#include "engine/data/loader.h"

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

// Row maps between this rank's rows ([B n]: n of each sequence at its zigzag places), the
// gathered rows ([cp B n]: every rank's, in rank order) and the whole sequences ([B S]),
// for ops::take_rows (an index outside the source gives a zero row).
struct ContextAttention::WholeMaps {
  int64_t batch, seq;
  Tensor whole_from_gathered;  // [B S]: the gathered row at each whole place
  Tensor gathered_from_whole;  // [cp B n]: the whole place of each gathered row
  Tensor own_in_whole;         // [B S]: this rank's row at each whole place, or B n (outside: zero)
  Tensor whole_of_own;         // [B n]: the whole place of each of this rank's rows
};

ContextAttention::ContextAttention(Communicator& group, Form form) : group_(group), form_(form) {}
ContextAttention::~ContextAttention() = default;

bool ContextAttention::whole_form(const Tensor& q) const {
  return form_ == Form::kWhole || (form_ == Form::kAuto && !q.device().is_cpu());
}

const ContextAttention::WholeMaps& ContextAttention::maps(int64_t batch, int64_t seq, Device device) const {
  for (const auto& m : maps_) {
    if (m->batch == batch && m->seq == seq) return *m;
  }
  const int64_t cp = group_.size(), me = group_.rank(), S = seq * cp, n = seq, B = batch;
  std::vector<int32_t> whole_from(static_cast<size_t>(B * S)), gathered_from(static_cast<size_t>(cp * B * n)),
      own_in(static_cast<size_t>(B * S), static_cast<int32_t>(B * n)), whole_of(static_cast<size_t>(B * n));
  for (int64_t j = 0; j < cp; ++j) {
    const std::vector<int32_t> places = zigzag_places(S, cp, j);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t whole = b * S + places[static_cast<size_t>(i)], g = j * B * n + b * n + i;
        whole_from[static_cast<size_t>(whole)] = static_cast<int32_t>(g);
        gathered_from[static_cast<size_t>(g)] = static_cast<int32_t>(whole);
        if (j == me) {
          own_in[static_cast<size_t>(whole)] = static_cast<int32_t>(b * n + i);
          whole_of[static_cast<size_t>(b * n + i)] = static_cast<int32_t>(whole);
        }
      }
    }
  }
  auto m = std::make_unique<WholeMaps>();
  m->batch = batch;
  m->seq = seq;
  m->whole_from_gathered = Tensor::from_vector(whole_from, {B * S}).to(device);
  m->gathered_from_whole = Tensor::from_vector(gathered_from, {cp * B * n}).to(device);
  m->own_in_whole = Tensor::from_vector(own_in, {B * S}).to(device);
  m->whole_of_own = Tensor::from_vector(whole_of, {B * n}).to(device);
  maps_.push_back(std::move(m));
  return *maps_.back();
}

// Every rank's keys, values and documents in whole-sequence order, with the maps and shape.
struct ContextAttention::WholeKeys {
  const WholeMaps& maps;
  ops::AttentionShape shape;
  Tensor k, v, segments;
};

ContextAttention::WholeKeys ContextAttention::whole_keys(const Tensor& k, const Tensor& v,
                                                         const ops::AttentionPlaces& places,
                                                         const ops::AttentionShape& shape) const {
  const WholeMaps& m = maps(shape.batch, shape.seq, k.device());
  ops::AttentionShape whole = shape;
  whole.seq = shape.seq * group_.size();
  return {m, whole, ops::take_rows(gathered(k), m.whole_from_gathered),
          ops::take_rows(gathered(v), m.whole_from_gathered),
          places.segments.defined() ? ops::take_rows(gathered(places.segments), m.whole_from_gathered) : Tensor()};
}

// The whole sequences' attention with only this rank's queries in them (the others zero:
// their outputs are not read, and in the backward their zero output gradients add nothing
// to the keys' and values' gradients).
ops::AttentionOut ContextAttention::whole_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const ops::AttentionPlaces& places,
                                                  const ops::AttentionShape& shape) const {
  const WholeKeys w = whole_keys(k, v, places, shape);
  ops::AttentionOut o =
      ops::attention_forward(ops::take_rows(q, w.maps.own_in_whole), w.k, w.v, w.segments, w.shape);
  return {ops::take_rows(o.out, w.maps.whole_of_own), std::move(o.lse)};  // lse: the whole sequences' [B, Hq, S]
}

ops::AttentionGrads ContextAttention::whole_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const ops::AttentionPlaces& places,
                                                     const Tensor& out, const Tensor& lse,
                                                     const ops::AttentionShape& shape) const {
  const WholeKeys w = whole_keys(k, v, places, shape);
  const Tensor& own = w.maps.own_in_whole;
  ops::AttentionGrads d = ops::attention_backward(ops::take_rows(dout, own), ops::take_rows(q, own), w.k, w.v,
                                                  w.segments, ops::take_rows(out, own), lse, w.shape);
  ops::AttentionGrads g;
  g.dq = ops::take_rows(d.dq, w.maps.whole_of_own);
  g.dk = Tensor::empty(k.shape(), d.dk.dtype(), k.device());
  g.dv = Tensor::empty(v.shape(), d.dv.dtype(), v.device());
  group_.reduce_scatter(ops::take_rows(d.dk, w.maps.gathered_from_whole), g.dk);  // each rank's keys, over every query
  group_.reduce_scatter(ops::take_rows(d.dv, w.maps.gathered_from_whole), g.dv);
  return g;
}

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
  if (whole_form(q)) return whole_forward(q, k, v, places, shape);
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
  if (whole_form(q)) return whole_backward(dout, q, k, v, places, out, lse, shape);
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
