#include "engine/parallel/all_gather_dispatch.h"

#include <algorithm>

#include "core/log.h"
#include "engine/parallel/layout.h"
#include "engine/telemetry/stage_timer.h"

namespace moetrain {
namespace {

// The first `rows` rows of t: t itself when it has no more.
Tensor first_rows(const Tensor& t, int64_t rows) { return t.size(0) == rows ? t : t.slice(0, rows); }

}  // namespace

AllGatherDispatcher::AllGatherDispatcher(Communicator& ep, ExchangeOptions options)
    : GroupDispatcher(ep, std::move(options), " (all-gather)") {}

Tensor AllGatherDispatcher::padded(const Tensor& t, int64_t rows_padded, int32_t fill_id) const {
  if (t.size(0) == rows_padded) return t;
  Tensor out;
  if (fill_id == 0) {
    out = Tensor::zeros({rows_padded, t.size(1)}, t.dtype(), t.device());
  } else {
    const std::vector<int32_t> fill(static_cast<size_t>(rows_padded * t.size(1)), fill_id);
    out = on(t.device(), Tensor::from_vector(fill, {rows_padded, t.size(1)}));
  }
  if (t.size(0) > 0) out.slice(0, t.size(0)).copy_from(t);
  return out;
}

AllGatherDispatcher::~AllGatherDispatcher() {
  for (CountsBuffer& b : counts_buffers_) {
    try {
      if (b.event) cuda::destroy_event(b.event);
    } catch (...) {  // a destructor must not throw
    }
  }
}

void AllGatherDispatcher::choose_transport(const Tensor& t) {
  if (transport_chosen_ || !nccl_ || t.device().is_cpu()) return;
  transport_chosen_ = true;  // every rank reaches its first dispatch at the same call
  if (opt_.peer_copies && PeerArena::usable(ep_)) {
    arena_ = std::make_unique<PeerArena>(ep_);
    if (opt_.comm_stream_backward && opt_.comm_stream) back_arena_ = std::make_unique<PeerArena>(ep_);
  }
  spdlog::info("expert exchange on {}: token rows by {}{}", ep_.name(),
               arena_ ? "copies into the peers' memory (copy engines over NVLink)" : "NCCL",
               back_arena_ ? "; the backward's exchanges on a stream of their own" : "");
}

int AllGatherDispatcher::take_counts_buffer(int64_t entries) {
  size_t i = 0;
  while (i < counts_buffers_.size() && counts_buffers_[i].busy) ++i;
  if (i == counts_buffers_.size()) counts_buffers_.emplace_back();
  CountsBuffer& b = counts_buffers_[i];
  if (!b.host.defined() || b.host.numel() < entries) b.host = Tensor::empty_pinned({entries}, DType::I64);
  if (!b.event) b.event = cuda::create_sync_event();
  b.busy = true;
  return static_cast<int>(i);
}

Tensor AllGatherDispatcher::gather(const Tensor& block, PeerArena* via) {
  const int64_t P = ep_.size();
  stream_of(via).count_bytes(static_cast<double>((P - 1) * block.nbytes()));
  if (via) return via->all_gather(block);
  Tensor out = Tensor::empty({P * block.size(0), block.size(1)}, block.dtype(), block.device());
  collective(block, out, [&](const Tensor& i, Tensor& o, cuda::Stream s) { ep_.all_gather(i, o, s); });
  return out;
}

Tensor AllGatherDispatcher::reduce_scatter(const Tensor& blocks, PeerArena* via) {
  const int64_t P = ep_.size();
  stream_of(via).count_bytes(static_cast<double>(blocks.nbytes() / static_cast<size_t>(P) * static_cast<size_t>(P - 1)));
  if (via) return via->reduce_scatter_sum(blocks);
  Tensor out = Tensor::empty({blocks.size(0) / P, blocks.size(1)}, blocks.dtype(), blocks.device());
  collective(blocks, out, [&](const Tensor& i, Tensor& o, cuda::Stream s) { ep_.reduce_scatter(i, o, ReduceOp::Sum, s); });
  return out;
}

std::vector<int64_t> AllGatherDispatcher::token_counts(int64_t mine, const Device& device) {
  const Device comm_device = nccl_ ? device : Device::cpu();
  return gather(on(comm_device, Tensor::from_vector(std::vector<int64_t>{mine}, {1, 1})), nullptr).to_vector<int64_t>();
}

void AllGatherDispatcher::check_conservation_over_group(const DispatchState& st, const Device& device, int64_t rows,
                                                        int64_t top_k) {
  const int P = ep_.size();
  const std::vector<int64_t> kept = token_counts(rows, device), tokens = token_counts(st.tokens, device);
  int64_t all_kept = 0, all_tokens = 0;
  for (int q = 0; q < P; ++q) {
    all_kept += kept[static_cast<size_t>(q)];
    all_tokens += tokens[static_cast<size_t>(q)];
  }
  MT_CHECK(all_kept == all_tokens * top_k,
           "{}: token conservation violated: the {} ranks' experts took {} (token, expert) copies of the {} tokens' "
           "{} (an expert id out of range?)",
           where(st), P, all_kept, all_tokens, all_tokens * top_k);
}

DispatchOut AllGatherDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts,
                                          DispatchState& st) {
  dispatch_start(x, topk_idx, Tensor(), num_experts, st);
  return dispatch_finish(st);
}

DispatchOut AllGatherDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                          int64_t num_experts, DispatchState& st) {
  MT_CHECK(topk_weight.defined(), "{}: dispatch with routing weights given none", where(st));
  dispatch_start(x, topk_idx, topk_weight, num_experts, st);
  return dispatch_finish(st);
}

void AllGatherDispatcher::dispatch_start(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                         int64_t num_experts, DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  const int64_t E = num_experts, El = num_local_experts(E), first = first_local_expert(E);
  MT_CHECK(x.defined() && x.ndim() == 2 && topk_idx.defined() && topk_idx.ndim() == 2 &&
               topk_idx.size(0) == x.size(0) && topk_idx.device() == x.device(),
           "{}: x must be [T, H] and topk_idx [T, K] on one device, got {} and {}", where(st), x.str(), topk_idx.str());
  MT_CHECK(!topk_weight.defined() ||
               (topk_weight.shape() == topk_idx.shape() && topk_weight.device() == x.device()),
           "{}: topk_weight must be [T, K] like topk_idx {} on {}, got {}", where(st), topk_idx.str(),
           x.device().str(), topk_weight.str());
  MT_CHECK(!st.dispatch_pending, "{}: dispatch_start twice without dispatch_finish", where(st));
  const Device dev = x.device();
  const int64_t T = x.size(0), K = topk_idx.size(1);
  choose_transport(x);
  st.counts_buffer = -1;
  st.perm.rows = -1;
  stream_.run(Collective::kDispatch, dev, st, {x, topk_idx, topk_weight}, [&] {
    // The gathered blocks are padded to max_tokens, or else to the largest count.
    st.tokens = T;
    if (opt_.max_tokens > 0) {
      MT_CHECK(T <= opt_.max_tokens, "{}: {} tokens, more than the {} every rank was said to dispatch at most",
               where(st), T, opt_.max_tokens);
      st.padded_tokens = opt_.max_tokens;
    } else {
      const std::vector<int64_t> counts = token_counts(T, dev);
      st.padded_tokens = *std::max_element(counts.begin(), counts.end());
    }
    const int64_t Tp = st.padded_tokens;
    MT_CHECK(ep_.size() * Tp * K <= INT32_MAX,
             "{}: {} gathered (token, expert) copies exceed the i32 row index range", where(st), ep_.size() * Tp * K);
    Tensor ids;
    const Tensor pad_ids = padded(topk_idx, Tp, static_cast<int32_t>(E));
    if (arena_ && topk_weight.defined()) {  // one exchange for both
      std::vector<Tensor> g = arena_->all_gather({pad_ids, padded(topk_weight, Tp)});
      stream_.count_bytes(static_cast<double>((ep_.size() - 1) * (pad_ids.nbytes() + g[1].nbytes() / ep_.size())));
      ids = g[0];
      st.weight = g[1].clone();  // read at the combine, many exchanges later
    } else {  // NCCL (fresh tensors), or the arena without weights
      ids = gather(pad_ids, arena_.get());
      st.weight = topk_weight.defined() ? gather(padded(topk_weight, Tp), nullptr) : Tensor();
    }
    // This rank's experts' copies of the gathered tokens, sorted first; every other copy
    // (another rank's expert, or a padding row's id E) goes to group El, past the kept rows.
    st.perm = ops::permutation_by_expert(ops::expert_ids_in_range(ids, first, El), El + 1);
    if (!dev.is_cpu()) {  // the counts start for the host; dispatch_finish waits for them
      st.counts_buffer = take_counts_buffer(El + 1);
      CountsBuffer& b = counts_buffers_[static_cast<size_t>(st.counts_buffer)];
      cuda::copy_device_to_host_async(b.host.raw(), st.perm.expert_counts.raw(), st.perm.expert_counts.nbytes());
      cuda::record_event(b.event, cuda::current_stream());
    }
    return st.perm.expert_counts;
  });
  st.pending_x = x;
  st.dispatch_pending = true;
}

DispatchOut AllGatherDispatcher::dispatch_finish(DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  MT_CHECK(st.dispatch_pending, "{}: dispatch_finish without dispatch_start", where(st));
  st.dispatch_pending = false;
  const Tensor x = std::move(st.pending_x);
  const int64_t El = st.perm.expert_counts.numel() - 1, K = st.perm.top_k;
  std::vector<int64_t> counts;
  if (st.counts_buffer >= 0) {  // the one host wait of a dispatch
    CountsBuffer& b = counts_buffers_[static_cast<size_t>(st.counts_buffer)];
    cuda::event_synchronize(b.event);
    const int64_t* h = static_cast<const int64_t*>(b.host.raw());
    counts.assign(h, h + El + 1);
    b.busy = false;
    st.counts_buffer = -1;
  } else {
    counts = st.perm.expert_counts.to_vector<int64_t>();
  }
  int64_t N = 0;
  for (int64_t e = 0; e < El; ++e) N += counts[static_cast<size_t>(e)];
  st.perm.rows = N;
  st.perm.expert_counts = st.perm.expert_counts.slice(0, El);
  // The rows continue the start's work on its stream: nothing new from the caller's.
  return stream_.run(
      Collective::kDispatch, x.device(), st, {x},
      [&] {
        if (opt_.check_conservation) check_conservation_over_group(st, x.device(), N, K);
        // (FP8 experts: each token quantized once, on its own rank; the padding rows' zero
        // bytes are never kept.)
        const Tensor all = gather(padded(tokens_to_send(x, st), st.padded_tokens), arena_.get());
        return received_rows(ops::permute_forward(all, st.perm), st.perm.expert_counts, x, st);
      },
      /*after_compute=*/false);
}

void AllGatherDispatcher::check_dispatched(const DispatchState& st, const Tensor& t, int64_t rows,
                                           const char* what) const {
  MT_CHECK(st.perm.rows >= 0, "{}: {} before dispatch", where(st), what);
  MT_CHECK(t.defined() && t.ndim() == 2 && t.size(0) == rows, "{}: {} takes [{}, H] rows, got {}", where(st), what,
           rows, t.str());
}

// Each gathered token's weighted sum over this rank's experts, then over the ranks.
void AllGatherDispatcher::combine_start(const Tensor& expert_rows, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, expert_rows, st.perm.rows, "combine_start");
  MT_CHECK(st.weight.defined(), "{}: combine_start of a dispatch given no routing weights", where(st));
  st.placed = expert_rows;
  st.order = st.perm.slot_row;
  st.combined = stream_.run(Collective::kCombine, expert_rows.device(), st, {expert_rows}, [&] {
    return reduce_scatter(ops::combine_forward(expert_rows, st.weight, Tensor(), st.order), arena_.get());
  });
}

Tensor AllGatherDispatcher::combine_finish(const Tensor& residual, DispatchState& st) {
  wait(st);
  MT_CHECK(st.combined.defined(), "{}: combine_finish before combine_start", where(st));
  StageScope timer(Stage::kCombine);
  Tensor y = first_rows(st.combined, st.tokens);
  st.combined = Tensor();
  ops::add_(y, residual);
  return y;
}

ExpertDispatcher::CombineGrads AllGatherDispatcher::combine_backward_weighted(const Tensor& dy, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  MT_CHECK(st.placed.defined() && st.weight.defined(), "{}: combine_backward_weighted before combine_start",
           where(st));
  check_dispatched(st, dy, st.tokens, "combine_backward_weighted");
  return back().run(Collective::kCombine, dy.device(), st, {dy}, [&] {
    ops::CombineGrads g =
        ops::combine_backward(gather(padded(dy, st.padded_tokens), back_arena()), st.placed, st.weight, st.order);
    // d weight of a slot is non-zero on its expert's rank only: the sum is that value.
    return CombineGrads{g.dexpert_out, first_rows(reduce_scatter(g.dweight, back_arena()), st.tokens)};
  });
}

Tensor AllGatherDispatcher::combine(const Tensor& expert_rows, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, expert_rows, st.perm.rows, "combine");
  const int64_t K = st.perm.top_k, T = st.tokens;
  return stream_.run(Collective::kCombine, expert_rows.device(), st, {expert_rows}, [&] {
    // [P Tp K, H]: each gathered copy's output where this rank holds its expert, else zero;
    // rank q's block is its tokens' copies in (t, k) order.
    return first_rows(reduce_scatter(ops::unpermute_forward(expert_rows, st.perm), arena_.get()), T * K);
  });
}

Tensor AllGatherDispatcher::combine_backward(const Tensor& dout, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  const int64_t K = st.perm.top_k;
  check_dispatched(st, dout, st.tokens * K, "combine_backward");
  return back().run(Collective::kCombine, dout.device(), st, {dout}, [&] {
    return ops::unpermute_backward(gather(padded(dout, st.padded_tokens * K), back_arena()), st.perm);
  });
}

Tensor AllGatherDispatcher::dispatch_backward(const Tensor& drows, DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  check_dispatched(st, drows, st.perm.rows, "dispatch_backward");
  return back().run(Collective::kDispatch, drows.device(), st, {drows}, [&] {
    return first_rows(reduce_scatter(ops::permute_backward(drows, st.perm), back_arena()), st.tokens);
  });
}

}  // namespace moetrain
