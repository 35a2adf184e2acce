// AllGatherDispatcher: expert parallelism that sends each token once to every EP rank
// instead of once per routed expert.
//
// dispatch all-gathers the tokens, their top-k ids and routing weights over the EP group
// (P ranks), and each rank permutes, out of the gathered batch, the (token, slot) copies of
// its own experts (a partial permutation: the other copies are absent, ops/ops.h). The
// weighted combine then runs on the experts' side: each rank sums the weighted outputs of
// its experts per gathered token (ops::combine_forward with absent slots left out) and one
// reduce-scatter brings every token's sum of partial sums home. The backward mirrors it:
// all-gather dy, combine_backward on the experts' side (d weight reduce-scattered home: a
// slot's is non-zero on one rank only), permute_backward into partial dx, reduce-scatter.
//
// Bytes: each exchange moves (P - 1) rows per token per rank where the all-to-all moves
// K (P - 1) / P (top-K routing, experts spread evenly), so it sends K / P times less: 4x at
// ep2, 2x at ep4 with top-8; from P = K on the all-to-all is the cheaper one
// ([parallel].ep_dispatch = "auto" picks by that). No exchange needs a count exchange
// first: the sizes are the token counts.
//
// Order contract: as AllToAllDispatcher's (the rows of local expert e are every source
// rank's copies in rank order, each in (t, k) order: the one-process order of the batch
// concatenated in rank order), so the experts see exactly the rows one process would. The
// combine's and dx's sums differ from one process's in rounding only: partial sums per rank,
// then added over the ranks. Ranks may have different token counts: the gathered blocks are
// padded to ExchangeOptions::max_tokens, or where that is not given to the largest count
// (one more collective and host sync a dispatch to learn it).
//
// Transport: NCCL's all-gather and reduce-scatter, or, among the GPUs of one host
// (ExchangeOptions::peer_copies), copies straight into the peers' memory on the copy
// engines (PeerArena) for every exchange (the ids and weights in one): no NCCL kernel then
// runs beside the compute, and the backward's exchanges run on a second stream with their
// own arena (ExchangeOptions::comm_stream_backward). Only the counts of the optional checks
// (and of a dispatch without max_tokens) go by NCCL, on the forward's stream.
//
// dispatch_start gathers the ids and weights and sorts this rank's copies, and starts the
// per-expert counts to the host; dispatch_finish waits for them (the one host wait of a
// dispatch: the rows' count sizes the rows) and gathers the token rows. Between the two the
// caller enqueues other work (a paired micro-batch's), so the host wait finds the GPU busy.
#pragma once

#include <memory>

#include "engine/parallel/expert_dispatch.h"
#include "engine/parallel/peer_arena.h"

namespace moetrain {

class AllGatherDispatcher final : public GroupDispatcher {
 public:
  explicit AllGatherDispatcher(Communicator& ep, ExchangeOptions options = {});
  AllGatherDispatcher(const AllGatherDispatcher&) = delete;
  AllGatherDispatcher& operator=(const AllGatherDispatcher&) = delete;

  DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) override;
  DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight, int64_t num_experts,
                       DispatchState& st) override;
  void dispatch_start(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight, int64_t num_experts,
                      DispatchState& st) override;
  DispatchOut dispatch_finish(DispatchState& st) override;

  // The weighted combine on the experts' side (see above).
  void combine_start(const Tensor& expert_rows, DispatchState& st) override;
  Tensor combine_finish(const Tensor& residual, DispatchState& st) override;
  CombineGrads combine_backward_weighted(const Tensor& dy, DispatchState& st) override;

  // The routes, for the same contract as the other dispatchers: combine gives each copy its
  // expert's output at home ([T*K, H], (t, k) order: the expert side scatters its rows into
  // the gathered pairs, zero elsewhere, and a reduce-scatter brings each rank its own);
  // combine_backward all-gathers the gradient and keeps the local copies'.
  Tensor combine(const Tensor& expert_rows, DispatchState& st) override;
  Tensor combine_backward(const Tensor& dout, DispatchState& st) override;
  Tensor dispatch_backward(const Tensor& drows, DispatchState& st) override;

  // Whether token rows move by copies into the peers' memory (known after the first dispatch).
  bool uses_peer_copies() const { return arena_ != nullptr; }

 private:
  // [rows, C] -> [rows_padded, C] (padding rows filled with `fill`: 0, or an id of no expert).
  Tensor padded(const Tensor& t, int64_t rows_padded, int32_t fill_id = 0) const;
  // [n, C] on every rank -> [P n, C] in rank order; [P n, C] -> this rank's sum [n, C].
  // Through `via` where given (the result of a gather through an arena must be consumed
  // before that arena's exchange after next: peer_arena.h), else NCCL.
  Tensor gather(const Tensor& block, PeerArena* via);
  Tensor reduce_scatter(const Tensor& blocks, PeerArena* via);
  // At the first dispatch (all ranks together): whether the exchanges go through peer
  // arenas (ExchangeOptions::peer_copies and every rank can), and then whether the backward
  // gets its own stream and arena.
  void choose_transport(const Tensor& t);
  // Where the backward's exchanges run: their own stream and arena where there are two.
  ExchangeStream& back() { return back_arena_ ? back_stream_ : stream_; }
  PeerArena* back_arena() { return back_arena_ ? back_arena_.get() : arena_.get(); }
  // The stream whose exchange goes through `via` (for the bytes' count).
  ExchangeStream& stream_of(const PeerArena* via) { return via && via == back_arena_.get() ? back_stream_ : stream_; }
  // A pinned host buffer for a dispatch's counts (and its event), held until dispatch_finish.
  int take_counts_buffer(int64_t entries);
  // The group-wide check that every (token, slot) copy found exactly one rank's expert.
  void check_conservation_over_group(const DispatchState& st, const Device& device, int64_t rows, int64_t top_k);
  // Every rank's token count (a collective and a host sync).
  std::vector<int64_t> token_counts(int64_t mine, const Device& device);
  void check_dispatched(const DispatchState& st, const Tensor& t, int64_t rows, const char* what) const;

  std::unique_ptr<PeerArena> arena_, back_arena_;
  bool transport_chosen_ = false;
  struct CountsBuffer {
    Tensor host;  // pinned
    void* event = nullptr;
    bool busy = false;
  };
  std::vector<CountsBuffer> counts_buffers_;

 public:
  ~AllGatherDispatcher() override;
};

}  // namespace moetrain
