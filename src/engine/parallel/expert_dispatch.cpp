#include "engine/parallel/expert_dispatch.h"

#include <utility>

#include "engine/parallel/layout.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {

namespace {

// FP8 experts: the tokens x per 1 x 128 tile: st.tokens_q where the caller gave it (taken out
// of st), else quantized now.
ops::Fp8Tensor take_tokens_q(const Tensor& x, DispatchState& st) {
  if (!st.tokens_q.q.defined()) return ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
  MT_CHECK(st.tokens_q.q.shape() == x.shape() && st.tokens_q.blocks == ops::Fp8Blocks::kRows,
           "expert dispatch of layer {}: the tokens' codes {} are not x {} per 1 x 128 tile", st.layer,
           st.tokens_q.q.str(), x.str());
  return std::exchange(st.tokens_q, {});
}

}  // namespace

Tensor tokens_to_send(const Tensor& x, DispatchState& st) {
  return st.fp8_rows ? ops::pack_fp8_rows(take_tokens_q(x, st)) : x;
}

DispatchOut received_rows(const Tensor& rows, const Tensor& counts, const Tensor& x, const DispatchState& st) {
  if (!st.fp8_rows) return DispatchOut{rows, counts, {}};
  ops::UnpackedFp8Rows u = ops::unpack_fp8_rows(rows, x.size(1), x.dtype());
  return DispatchOut{std::move(u.values), counts, std::move(u.q)};
}

DispatchOut ExpertDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                       int64_t num_experts, DispatchState& st) {
  st.weight = topk_weight;
  return dispatch(x, topk_idx, num_experts, st);
}

void ExpertDispatcher::dispatch_start(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                      int64_t num_experts, DispatchState& st) {
  st.started = topk_weight.defined() ? dispatch(x, topk_idx, topk_weight, num_experts, st)
                                     : dispatch(x, topk_idx, num_experts, st);
  st.dispatch_pending = true;
}

DispatchOut ExpertDispatcher::dispatch_finish(DispatchState& st) {
  MT_CHECK(st.dispatch_pending, "dispatch_finish of layer {} without dispatch_start", st.layer);
  st.dispatch_pending = false;
  return std::move(st.started);
}

void ExpertDispatcher::combine_start(const Tensor& expert_rows, DispatchState& st) {
  PlacedRows placed = combine_in_place(expert_rows, st);
  st.placed = std::move(placed.rows);
  st.order = std::move(placed.order);
}

// y = residual + sum_k w[t,k] * out[t,k], out read through the order where combine_in_place
// left the rows in its own order.
Tensor ExpertDispatcher::combine_finish(const Tensor& residual, DispatchState& st) {
  wait(st);
  MT_CHECK(st.weight.defined(), "combine_finish of layer {}: the dispatch was given no routing weights", st.layer);
  StageScope t(Stage::kCombine);
  return ops::combine_forward(st.placed, st.weight, residual, st.order);
}

ExpertDispatcher::CombineGrads ExpertDispatcher::combine_backward_weighted(const Tensor& dy, DispatchState& st) {
  ops::CombineGrads g;
  {
    StageScope t(Stage::kCombine);
    const bool codes = st.fp8_rows && st.order.defined() && in_place_backward_is_identity();
    g = ops::combine_backward(dy, st.placed, st.weight, st.order, /*quantize_rows=*/codes);
  }
  // The gradient is in the placed rows' order already when they came with one.
  Tensor d_rows = st.order.defined() ? combine_in_place_backward(g.dexpert_out, st) : combine_backward(g.dexpert_out, st);
  st.d_rows_q = std::move(g.dexpert_out_q);
  return {std::move(d_rows), std::move(g.dweight)};
}

DispatchOut LocalDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts,
                                      DispatchState& st) {
  StageScope t(Stage::kRouterPermute);
  st.perm = ops::permutation_by_expert(topk_idx, num_experts);
  if (!st.fp8_rows) return {ops::permute_forward(x, st.perm), st.perm.expert_counts, {}};
  // Each token quantized once rather than each of its top_k copies: the same bits.
  ops::UnpackedFp8Rows u = ops::permute_forward_fp8_values(take_tokens_q(x, st), st.perm, x.dtype());
  return {std::move(u.values), st.perm.expert_counts, std::move(u.q)};
}

Tensor LocalDispatcher::combine(const Tensor& expert_rows, DispatchState& st) {
  StageScope t(Stage::kCombine);
  return ops::unpermute_forward(expert_rows, st.perm);
}

ExpertDispatcher::PlacedRows LocalDispatcher::combine_in_place(const Tensor& expert_rows, DispatchState& st) {
  return {expert_rows, st.perm.slot_row};
}

Tensor LocalDispatcher::combine_backward(const Tensor& dout, DispatchState& st) {
  StageScope t(Stage::kCombine);
  return ops::unpermute_backward(dout, st.perm);
}

Tensor LocalDispatcher::dispatch_backward(const Tensor& drows, DispatchState& st) {
  StageScope t(Stage::kRouterPermute);
  return ops::permute_backward(drows, st.perm);
}

}  // namespace moetrain

// ---- expert parallelism ----------------------------------------------------------------

namespace moetrain {
namespace {

int64_t sum(const std::vector<int64_t>& v, size_t begin, size_t end) {
  int64_t s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s;
}
int64_t sum(const std::vector<int64_t>& v) { return sum(v, 0, v.size()); }

void destroy_event_quietly(void* e) {
  try {
    cuda::destroy_event(e);
  } catch (...) {  // a destructor must not throw
  }
}

}  // namespace

// ---- ExchangeStream ----

ExchangeStream::~ExchangeStream() {
  if (ready_event_) destroy_event_quietly(ready_event_);
  if (done_event_) destroy_event_quietly(done_event_);
}

void* ExchangeStream::before(cuda::Stream compute) {
  if (!ready_event_) ready_event_ = cuda::create_sync_event();
  cuda::record_event(ready_event_, compute);  // the inputs are ready here
  cuda::stream_wait_event(comm_, ready_event_);
  return ready_event_;
}

void* ExchangeStream::after(DispatchState& st, std::initializer_list<Tensor> inputs) {
  void* done;
  if (defer_) {
    // Until wait() the caller's stream may free or reuse what the communication stream still
    // reads or writes: the state keeps those tensors alive.
    if (!st.ready) st.ready = std::shared_ptr<void>(cuda::create_sync_event(), destroy_event_quietly);
    done = st.ready.get();
    for (const Tensor& t : inputs) keep(st, t);
  } else {
    if (!done_event_) done_event_ = cuda::create_sync_event();
    done = done_event_;
  }
  cuda::record_event(done, comm_);
  // From here the compute stream may use the results and free the inputs (stream order).
  if (!defer_) CollectiveTimer::wait(kind_, cuda::current_stream(), done);
  return done;
}

void ExchangeStream::keep(DispatchState& st, const DispatchOut& o) {
  keep(st, o.rows);
  keep(st, o.counts);
  if (o.rows_q.q.defined()) {
    keep(st, o.rows_q.q);
    keep(st, o.rows_q.scale);
  }
}
void ExchangeStream::keep(DispatchState& st, const ExpertDispatcher::CombineGrads& g) {
  keep(st, g.d_rows);
  keep(st, g.d_weight);
}
void ExchangeStream::keep(DispatchState& st, const ExpertDispatcher::PlacedRows& p) {
  keep(st, p.rows);
  keep(st, p.order);
}

void ExchangeStream::wait(DispatchState& st) {
  if (st.ready) CollectiveTimer::wait(st.kind, cuda::current_stream(), st.ready.get());
  st.in_flight.clear();  // freed on the current stream, after the wait
}

// ---- GroupDispatcher, AllToAllDispatcher ----

GroupDispatcher::GroupDispatcher(Communicator& ep, ExchangeOptions options, const char* kind)
    : ep_(ep),
      opt_(std::move(options)),
      nccl_(ep.backend() == "nccl"),
      stream_(opt_.comm_stream, opt_.defer_wait),
      back_stream_(opt_.comm_stream_backward, opt_.defer_wait),
      kind_(kind) {}

int64_t GroupDispatcher::first_local_expert(int64_t num_experts) const {
  return expert_range(num_experts, ep_.size(), ep_.rank()).first;
}

int64_t GroupDispatcher::num_local_experts(int64_t num_experts) const {
  MT_CHECK(num_experts > 0, "expert parallelism on {}: no experts to split", ep_.name());
  return expert_range(num_experts, ep_.size(), ep_.rank()).count;
}

std::string GroupDispatcher::where(const DispatchState& st) const {
  if (st.layer >= 0) return fmt::format("expert dispatch{} of layer {} on {}", kind_, st.layer, ep_.name());
  return fmt::format("expert dispatch{} on {}", kind_, ep_.name());
}

AllToAllDispatcher::AllToAllDispatcher(Communicator& ep, ExchangeOptions options)
    : GroupDispatcher(ep, std::move(options), "") {}

void AllToAllDispatcher::all_to_all(const Tensor& in, const std::vector<int64_t>& send, Tensor& out,
                                    const std::vector<int64_t>& recv) {
  const double row_bytes = in.numel() == 0 ? 0.0 : static_cast<double>(in.nbytes()) / static_cast<double>(in.size(0));
  stream_.count_bytes(static_cast<double>(sum(send) - send[static_cast<size_t>(ep_.rank())]) * row_bytes);
  collective(in, out, [&](const Tensor& i, Tensor& o, cuda::Stream s) { ep_.all_to_all_v(i, send, o, recv, s); });
}

Tensor AllToAllDispatcher::exchange(const Tensor& rows, const std::vector<int64_t>& send,
                                    const std::vector<int64_t>& recv) {
  Tensor out = Tensor::empty({sum(recv), rows.size(1)}, rows.dtype(), rows.device());
  all_to_all(rows, send, out, recv);
  return out;
}

void AllToAllDispatcher::check_conservation_over_group(const DispatchState& st, const Device& device,
                                                       int64_t pairs) {
  // Every rank publishes [rows to each peer, rows expected from each peer, its (token,
  // slot) copies]; every rank then checks the whole matrix, so all of them stop together
  // instead of some entering a row exchange that others left.
  const int P = ep_.size();
  const int64_t W = 2 * P + 1;
  std::vector<int64_t> mine(st.send_rows);
  mine.insert(mine.end(), st.recv_rows.begin(), st.recv_rows.end());
  mine.push_back(pairs);
  const Device comm_device = nccl_ ? device : Device::cpu();
  Tensor in = on(comm_device, Tensor::from_vector(mine, {W}));
  Tensor all = Tensor::empty({P * W}, DType::I64, comm_device);
  ep_.all_gather(in, all, comm_device.is_cpu() ? nullptr : cuda::current_stream());
  const std::vector<int64_t> a = all.to_vector<int64_t>();  // host sync (CUDA)
  int64_t sent = 0, expected = 0;
  for (int q = 0; q < P; ++q) {
    sent += sum(a, q * W, q * W + P);
    expected += sum(a, q * W + P, q * W + 2 * P);
  }
  for (int q = 0; q < P; ++q) {
    const int64_t q_sends = sum(a, q * W, q * W + P), q_pairs = a[q * W + 2 * P];
    MT_CHECK(q_sends == q_pairs,
             "{}: token conservation violated: rank {} routed {} (token, expert) copies but sends {} rows (an "
             "expert id out of range?); in all {} rows sent, {} expected",
             where(st), q, q_pairs, q_sends, sent, expected);
    for (int p = 0; p < P; ++p) {
      const int64_t s = a[q * W + p], r = a[p * W + P + q];
      MT_CHECK(s == r,
               "{}: token conservation violated: rank {} sends {} rows to rank {}, which expects {} from it; in "
               "all {} rows sent, {} expected",
               where(st), q, s, p, r, sent, expected);
    }
  }
}

DispatchOut AllToAllDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts,
                                         DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  const int P = ep_.size();
  const int64_t E = num_experts, El = num_local_experts(E);
  MT_CHECK(x.defined() && x.ndim() == 2 && topk_idx.defined() && topk_idx.ndim() == 2 &&
               topk_idx.size(0) == x.size(0) && topk_idx.device() == x.device(),
           "{}: x must be [T, H] and topk_idx [T, K] on one device, got {} and {}", where(st), x.str(), topk_idx.str());
  const Device dev = x.device();
  const int64_t pairs = topk_idx.numel();
  return stream_.run(Collective::kDispatch, dev, st, {x, topk_idx}, [&] {
    st.perm = ops::permutation_by_expert(topk_idx, E);  // grouped by global expert: peer p's experts are one block
    // The counts this rank sends (E, peer-major) and those it receives ([peer][local expert])
    // share one buffer, so one copy brings both to the host.
    const Device comm_device = nccl_ ? dev : Device::cpu();
    Tensor counts = Tensor::empty({2 * E, 1}, DType::I64, comm_device);
    Tensor sent = counts.slice(0, E), received = counts.slice(E, 2 * E);
    sent.copy_from(st.perm.expert_counts);
    const std::vector<int64_t> per_peer(P, El);
    all_to_all(sent, per_peer, received, per_peer);
    Tensor rows = ops::permute_forward(tokens_to_send(x, st), st.perm);  // enqueued before the sync below
    // The dispatch's one necessary host sync: the row exchange is sized by these counts.
    const std::vector<int64_t> c = counts.to_vector<int64_t>();
    std::vector<int64_t> got(c.begin() + E, c.end());
    if (opt_.tamper_received_counts) opt_.tamper_received_counts(got);
    st.send_rows.assign(P, 0);
    st.recv_rows.assign(P, 0);
    for (int p = 0; p < P; ++p) {
      st.send_rows[p] = sum(c, p * El, (p + 1) * El);
      st.recv_rows[p] = sum(got, p * El, (p + 1) * El);
    }
    if (opt_.check_conservation) {
      check_conservation_over_group(st, dev, pairs);
    } else {
      // Still free to check here; a failure stops only this rank, and its peers then time
      // out in their next collective.
      MT_CHECK(sum(st.send_rows) == pairs,
               "{}: token conservation violated: rank {} routed {} (token, expert) copies but sends {} rows (an "
               "expert id out of range?)",
               where(st), ep_.rank(), pairs, sum(st.send_rows));
    }
    const int64_t N = sum(st.recv_rows);
    MT_CHECK(N <= INT32_MAX, "{}: rank {} would receive {} rows, beyond the i32 row index range", where(st),
             ep_.rank(), N);

    // Rows arrive peer-major (peer 0's blocks for local experts 0..El-1, then peer 1's,
    // ...); grouped order is expert-major. Block (p, e) starts at `arrive` in the first and
    // at next[e] in the second.
    std::vector<int64_t> local_counts(El, 0), next(El, 0);
    for (int p = 0; p < P; ++p)
      for (int64_t e = 0; e < El; ++e) local_counts[e] += got[p * El + e];
    for (int64_t e = 1; e < El; ++e) next[e] = next[e - 1] + local_counts[e - 1];
    std::vector<int32_t> index;  // [source_token (N) | slot_row (N)] when not the identity
    st.regroup_identity = true;
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<int64_t> at(next);
      int64_t arrive = 0;
      for (int p = 0; p < P; ++p) {
        for (int64_t e = 0; e < El; ++e) {
          const int64_t n = got[p * El + e];
          if (pass == 0 && n > 0 && at[e] != arrive) st.regroup_identity = false;
          if (pass == 1) {
            for (int64_t i = 0; i < n; ++i) {
              index[at[e] + i] = static_cast<int32_t>(arrive + i);
              index[N + arrive + i] = static_cast<int32_t>(at[e] + i);
            }
          }
          at[e] += n;
          arrive += n;
        }
      }
      if (st.regroup_identity) break;
      if (pass == 0) index.resize(2 * N);
    }
    // Uploads before the row exchange is enqueued, so their syncs wait for nothing.
    Tensor expert_counts = on(dev, Tensor::from_vector(local_counts, {El}));
    st.regroup = {};
    if (!st.regroup_identity) {
      Tensor idx = on(dev, Tensor::from_vector(index, {2 * N}));
      st.regroup.expert_counts = expert_counts;
      st.regroup.source_token = idx.slice(0, N);
      st.regroup.slot_row = idx.slice(N, 2 * N);
      st.regroup.num_tokens = N;
      st.regroup.top_k = 1;
    }
    Tensor arrived = exchange(rows, st.send_rows, st.recv_rows);
    Tensor grouped = st.regroup_identity ? arrived : ops::permute_forward(arrived, st.regroup);  // device gather
    return received_rows(grouped, expert_counts, x, st);
  });
}

void AllToAllDispatcher::check_dispatched(const DispatchState& st, const Tensor& t, int64_t rows,
                                          const char* what) const {
  MT_CHECK(static_cast<int>(st.send_rows.size()) == ep_.size(), "{}: {} before dispatch", where(st), what);
  MT_CHECK(t.defined() && t.ndim() == 2 && t.size(0) == rows, "{}: {} takes [{}, H] rows, got {}", where(st), what,
           rows, t.str());
}

Tensor AllToAllDispatcher::rows_home(const Tensor& expert_rows, DispatchState& st) {
  Tensor arrived = st.regroup_identity ? expert_rows : ops::unpermute_forward(expert_rows, st.regroup);
  return exchange(arrived, st.recv_rows, st.send_rows);  // grouped by global expert
}

Tensor AllToAllDispatcher::rows_back_to_experts(const Tensor& d_home, DispatchState& st) {
  Tensor arrived = exchange(d_home, st.send_rows, st.recv_rows);
  return st.regroup_identity ? arrived : ops::permute_forward(arrived, st.regroup);
}

Tensor AllToAllDispatcher::combine(const Tensor& expert_rows, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, expert_rows, sum(st.recv_rows), "combine");
  return stream_.run(Collective::kCombine, expert_rows.device(), st, {expert_rows},
                        [&] { return ops::unpermute_forward(rows_home(expert_rows, st), st.perm); });
}

ExpertDispatcher::PlacedRows AllToAllDispatcher::combine_in_place(const Tensor& expert_rows, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, expert_rows, sum(st.recv_rows), "combine_in_place");
  Tensor home = stream_.run(Collective::kCombine, expert_rows.device(), st, {expert_rows}, [&] { return rows_home(expert_rows, st); });
  return {home, st.perm.slot_row};
}

Tensor AllToAllDispatcher::combine_in_place_backward(const Tensor& d_home, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, d_home, st.perm.num_tokens * st.perm.top_k, "combine_in_place_backward");
  return stream_.run(Collective::kCombine, d_home.device(), st, {d_home}, [&] { return rows_back_to_experts(d_home, st); });
}

Tensor AllToAllDispatcher::combine_backward(const Tensor& dout, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, dout, st.perm.num_tokens * st.perm.top_k, "combine_backward");
  return stream_.run(Collective::kCombine, dout.device(), st, {dout},
                        [&] { return rows_back_to_experts(ops::unpermute_backward(dout, st.perm), st); });
}

Tensor AllToAllDispatcher::dispatch_backward(const Tensor& drows, DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  check_dispatched(st, drows, sum(st.recv_rows), "dispatch_backward");
  return stream_.run(Collective::kDispatch, drows.device(), st, {drows}, [&] {
    Tensor arrived = st.regroup_identity ? drows : ops::unpermute_forward(drows, st.regroup);
    Tensor mine = exchange(arrived, st.recv_rows, st.send_rows);
    return ops::permute_backward(mine, st.perm);  // sums each token's K copies, in k order
  });
}

}  // namespace moetrain
