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

PeerArena* AllGatherDispatcher::arena(const Tensor& t) {
  if (!arena_decided_ && nccl_ && !t.device().is_cpu()) {
    arena_decided_ = true;  // every rank reaches its first exchange of rows at the same call
    if (opt_.peer_copies && PeerArena::usable(ep_)) arena_ = std::make_unique<PeerArena>(ep_);
    spdlog::info("expert exchange on {}: token rows by {}", ep_.name(),
                 arena_ ? "copies into the peers' memory (copy engines over NVLink)" : "NCCL");
  }
  return arena_.get();
}

Tensor AllGatherDispatcher::gather(const Tensor& block, bool rows) {
  const int64_t P = ep_.size();
  stream_.count_bytes(static_cast<double>((P - 1) * block.nbytes()));
  if (rows && arena(block)) return arena_->all_gather(block);
  Tensor out = Tensor::empty({P * block.size(0), block.size(1)}, block.dtype(), block.device());
  collective(block, out, [&](const Tensor& i, Tensor& o, cuda::Stream s) { ep_.all_gather(i, o, s); });
  return out;
}

Tensor AllGatherDispatcher::reduce_scatter(const Tensor& blocks, bool rows) {
  const int64_t P = ep_.size();
  stream_.count_bytes(static_cast<double>(blocks.nbytes() / static_cast<size_t>(P) * static_cast<size_t>(P - 1)));
  if (rows && arena(blocks)) return arena_->reduce_scatter_sum(blocks);
  Tensor out = Tensor::empty({blocks.size(0) / P, blocks.size(1)}, blocks.dtype(), blocks.device());
  collective(blocks, out, [&](const Tensor& i, Tensor& o, cuda::Stream s) { ep_.reduce_scatter(i, o, ReduceOp::Sum, s); });
  return out;
}

std::vector<int64_t> AllGatherDispatcher::token_counts(int64_t mine, const Device& device) {
  const Device comm_device = nccl_ ? device : Device::cpu();
  return gather(on(comm_device, Tensor::from_vector(std::vector<int64_t>{mine}, {1, 1}))).to_vector<int64_t>();
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
  return dispatch_rows(x, topk_idx, Tensor(), num_experts, st);
}

DispatchOut AllGatherDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                          int64_t num_experts, DispatchState& st) {
  MT_CHECK(topk_weight.defined() && topk_weight.shape() == topk_idx.shape() && topk_weight.device() == x.device(),
           "{}: topk_weight must be [T, K] like topk_idx {} on {}, got {}", where(st), topk_idx.str(),
           x.device().str(), topk_weight.str());
  return dispatch_rows(x, topk_idx, topk_weight, num_experts, st);
}

DispatchOut AllGatherDispatcher::dispatch_rows(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                                               int64_t num_experts, DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  const int P = ep_.size();
  const int64_t E = num_experts, El = num_local_experts(E), first = first_local_expert(E);
  MT_CHECK(x.defined() && x.ndim() == 2 && topk_idx.defined() && topk_idx.ndim() == 2 &&
               topk_idx.size(0) == x.size(0) && topk_idx.device() == x.device(),
           "{}: x must be [T, H] and topk_idx [T, K] on one device, got {} and {}", where(st), x.str(), topk_idx.str());
  const Device dev = x.device();
  const int64_t T = x.size(0), K = topk_idx.size(1);
  return stream_.run(Collective::kDispatch, dev, st, {x, topk_idx, topk_weight}, [&] {
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
    MT_CHECK(P * Tp * K <= INT32_MAX, "{}: {} gathered (token, expert) copies exceed the i32 row index range",
             where(st), P * Tp * K);
    // This rank's experts' copies of the gathered tokens, sorted first; every other copy
    // (another rank's expert, or a padding row's id E) goes to group El, past the kept rows.
    Tensor ids = ops::expert_ids_in_range(gather(padded(topk_idx, Tp, static_cast<int32_t>(E))), first, El);
    st.perm = ops::permutation_by_expert(ids, El + 1);
    const std::vector<int64_t> counts = st.perm.expert_counts.to_vector<int64_t>();  // the one host sync for rows
    int64_t N = 0;
    for (int64_t e = 0; e < El; ++e) N += counts[static_cast<size_t>(e)];
    st.perm.rows = N;
    st.perm.expert_counts = st.perm.expert_counts.slice(0, El);
    if (opt_.check_conservation) check_conservation_over_group(st, dev, N, K);
    st.weight = topk_weight.defined() ? gather(padded(topk_weight, Tp)) : Tensor();
    Tensor rows = ops::permute_forward(gather(padded(x, Tp), /*rows=*/true), st.perm);
    return DispatchOut{rows, st.perm.expert_counts};
  });
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
    return reduce_scatter(ops::combine_forward(expert_rows, st.weight, Tensor(), st.order), /*rows=*/true);
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
  return stream_.run(Collective::kCombine, dy.device(), st, {dy}, [&] {
    ops::CombineGrads g =
        ops::combine_backward(gather(padded(dy, st.padded_tokens), /*rows=*/true), st.placed, st.weight, st.order);
    // d weight of a slot is non-zero on its expert's rank only: the sum is that value.
    return CombineGrads{g.dexpert_out, first_rows(reduce_scatter(g.dweight), st.tokens)};
  });
}

Tensor AllGatherDispatcher::combine(const Tensor& expert_rows, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  check_dispatched(st, expert_rows, st.perm.rows, "combine");
  const int64_t K = st.perm.top_k, T = st.tokens;
  return stream_.run(Collective::kCombine, expert_rows.device(), st, {expert_rows}, [&] {
    // [P Tp K, H]: each gathered copy's output where this rank holds its expert, else zero;
    // rank q's block is its tokens' copies in (t, k) order.
    return first_rows(reduce_scatter(ops::unpermute_forward(expert_rows, st.perm), /*rows=*/true), T * K);
  });
}

Tensor AllGatherDispatcher::combine_backward(const Tensor& dout, DispatchState& st) {
  StageScope timer(Stage::kCombine);
  const int64_t K = st.perm.top_k;
  check_dispatched(st, dout, st.tokens * K, "combine_backward");
  return stream_.run(Collective::kCombine, dout.device(), st, {dout}, [&] {
    return ops::unpermute_backward(gather(padded(dout, st.padded_tokens * K), /*rows=*/true), st.perm);
  });
}

Tensor AllGatherDispatcher::dispatch_backward(const Tensor& drows, DispatchState& st) {
  StageScope timer(Stage::kRouterPermute);
  check_dispatched(st, drows, st.perm.rows, "dispatch_backward");
  return stream_.run(Collective::kDispatch, drows.device(), st, {drows}, [&] {
    return first_rows(reduce_scatter(ops::permute_backward(drows, st.perm), /*rows=*/true), st.tokens);
  });
}

}  // namespace moetrain
