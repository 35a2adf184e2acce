// ExpertDispatcher: stages 2 (dispatch) and 4 (combine) of the decoder layer contract.
//
// Dispatch sends every routed (token, slot) copy to the rank holding its expert, grouped
// by expert; combine brings the expert outputs back and sums each token's copies weighted
// by its routing weights (the exchange owns the weighted combine, so that a dispatcher may
// weight and sum on the experts' side and send back one row per token instead of K). The
// engine owns these stages so a schedule can run them on a communication stream while
// another micro-batch computes. With one process they are local permutations
// (LocalDispatcher); with expert parallelism, all-to-alls over the EP group
// (AllToAllDispatcher) or an all-gather of the tokens and a reduce-scatter of the
// expert-side sums (AllGatherDispatcher, engine/parallel/all_gather_dispatch.h). Below the
// weighted combine are the routes it is made of (combine, combine_in_place and their
// backwards), which tests check one by one.
#pragma once

#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "ops/ops.h"
#include "engine/telemetry/collective_timer.h"

namespace moetrain {

struct DispatchOut {
  Tensor rows;    // [N, H] token copies grouped by local expert
  Tensor counts;  // i64 [local experts], rows per expert
  // FP8 experts (DispatchState::fp8_rows): each token quantized once per 1 x 128 tile on its
  // own rank (the same bits as quantizing its copies), the codes and scales moved between
  // ranks in one packed row (ops::pack_fp8_rows: about half the bytes of bf16) and gathered
  // into the rows; `rows` is then their values (code * scale, as x's dtype), so that the
  // experts' weight gradient reads what their forward multiplied and every layout hands the
  // experts the same rows as one process. Undefined otherwise. Read by the experts' forward
  // only, which drops it.
  ops::Fp8Tensor rows_q;
};

// What a dispatch remembers for its combine and for both backwards.
struct DispatchState {
  ops::Permutation perm;  // this rank's (token, slot) copies -> rows grouped by global expert
  int64_t layer = -1;     // set by the caller to name the layer in errors; -1: unnamed
  bool fp8_rows = false;  // set by the caller: the experts read their rows in FP8 (DispatchOut::rows_q)
  // With fp8_rows, optionally: x already quantized per 1 x 128 tile (its norm's fused codes,
  // LayerState::mlp_in_q), taken by the dispatch in place of quantizing x.
  ops::Fp8Tensor tokens_q;
  // With fp8_rows, where the rows' gradient stays where the combine's backward wrote it (no
  // exchange): its e4m3 codes per 1 x 128 tile, made by that kernel (combine_backward_weighted
  // sets them, undefined otherwise), taken by the experts' input gradient in place of
  // quantizing the gradient (the same bits).
  ops::Fp8Tensor d_rows_q;

  // Expert parallelism (AllToAllDispatcher).
  std::vector<int64_t> send_rows, recv_rows;  // rows to / from each EP peer
  // Arrival order (peer-major) <-> local-expert-major order: grouped row r is arrived row
  // regroup.source_token[r]; arrived row i is grouped row regroup.slot_row[i] (top_k 1).
  // Unused when the two orders coincide (one local expert, one peer sending).
  ops::Permutation regroup;
  bool regroup_identity = true;
  // The weighted combine: the routing weights [T, K] given to dispatch (AllGatherDispatcher:
  // every EP rank's, gathered), and the expert outputs as combine_start placed them (rows,
  // and the order to read them through).
  Tensor weight;
  Tensor placed, order;
  // AllGatherDispatcher: this rank's token count, the rows every rank's block is padded to
  // in the gathered batch, and the reduce-scattered sums combine_start started home.
  int64_t tokens = 0, padded_tokens = 0;
  Tensor combined;
  // Between dispatch_start and dispatch_finish: the result where a dispatcher does all of it
  // at the start (the default), else (AllGatherDispatcher) the rows still to send and the
  // pinned buffer the per-expert counts are on their way into (-1: none, read them directly).
  DispatchOut started;
  bool dispatch_pending = false;
  Tensor pending_x;
  int counts_buffer = -1;
  // CUDA, communication stream, deferred waits: the event after this state's last exchange
  // and the caller's tensors the communication stream may still read (see wait()).
  std::shared_ptr<void> ready;
  Collective kind = Collective::kDispatch;  // of the last exchange on this state (for its wait's timing)
  std::vector<Tensor> in_flight;
};

// What a multi-rank dispatcher moves for the tokens x [T, H]: x itself or, for FP8 experts
// (st.fp8_rows), each token quantized once (st.tokens_q where the caller gave it, taken out of
// st) with its codes and scales packed in one row (ops::pack_fp8_rows).
Tensor tokens_to_send(const Tensor& x, DispatchState& st);
// The experts' input from such rows, arrived and grouped by local expert: the rows themselves,
// or (FP8) the packed rows' codes and scales (rows_q) with their values in x's dtype (rows).
DispatchOut received_rows(const Tensor& rows, const Tensor& counts, const Tensor& x, const DispatchState& st);

class ExpertDispatcher {
 public:
  virtual ~ExpertDispatcher() = default;
  virtual int64_t num_local_experts(int64_t num_experts) const = 0;
  // x [T, H], topk_idx i32 [T, K] -> rows grouped by expert.
  virtual DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) = 0;

  // ---- the layer's exchange: dispatch with the routing weights, the weighted combine ----
  // dispatch(), keeping topk_weight [T, K] in `st` for the combine.
  virtual DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                               int64_t num_experts, DispatchState& st);
  // The same dispatch in two calls, so that the caller can enqueue other work in between:
  // dispatch_start starts what needs no host wait, dispatch_finish (where the host waits for
  // the row count, if it must) sends the rows and returns what dispatch() returns (with
  // deferred waits, still in flight). The default does it all at the start.
  virtual void dispatch_start(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight,
                              int64_t num_experts, DispatchState& st);
  virtual DispatchOut dispatch_finish(DispatchState& st);
  // Starts the expert outputs [N, H] on their way home (with deferred waits, still in flight
  // when this returns). These three default to the routes below: the rows go home and the
  // token's rank sums them; a dispatcher may sum on the experts' side instead.
  virtual void combine_start(const Tensor& expert_rows, DispatchState& st);
  // Waits for them and returns residual + sum_k w[t,k] * out[t,k] ([T, H]; the residual add
  // fused into the weighted sum: stage 5 hands its residual stream in).
  virtual Tensor combine_finish(const Tensor& residual, DispatchState& st);
  // Backward of combine_finish and combine_start: d topk_weight [T, K] and the expert rows'
  // gradient [N, H] started on its way back to the experts (wait(st) before reading it), and
  // st.d_rows_q.
  struct CombineGrads {
    Tensor d_rows, d_weight;
  };
  virtual CombineGrads combine_backward_weighted(const Tensor& dy, DispatchState& st);

  // ---- the routes ----
  // Expert outputs [N, H] -> [T*K, H] in (t, k) order.
  virtual Tensor combine(const Tensor& expert_rows, DispatchState& st) = 0;
  // The same rows where the weighted combine can read them: `rows` in (t, k) order with
  // `order` undefined (combine()'s result), or rows in the dispatcher's own order with
  // `order` (i32 [T*K]) giving (t, k)'s row, so that no gather is made (ops::combine_forward
  // / combine_backward take the order): the expert outputs themselves in one process, the
  // rows as the exchange brings them home under expert parallelism. With an order, the
  // gradient of the rows comes in that same order and goes through
  // combine_in_place_backward, not combine_backward.
  struct PlacedRows {
    Tensor rows, order;
  };
  virtual PlacedRows combine_in_place(const Tensor& expert_rows, DispatchState& st) {
    return {combine(expert_rows, st), Tensor()};
  }
  // Gradient of combine_in_place's rows when it gave an order (the gradient in the order of
  // those rows) -> d rows [N, H], as combine_backward returns them. Identity where the rows
  // handed over were the expert outputs themselves (LocalDispatcher).
  virtual Tensor combine_in_place_backward(const Tensor& d_placed, DispatchState& st) { return d_placed; }
  // Whether combine_in_place_backward returns its input (no exchange): then the combine's
  // backward makes the FP8 codes of the rows' gradient too (DispatchState::d_rows_q).
  virtual bool in_place_backward_is_identity() const { return true; }
  // Gradient of combine: d[T*K, H] in (t, k) order -> d rows [N, H].
  virtual Tensor combine_backward(const Tensor& dout, DispatchState& st) = 0;
  // Gradient of dispatch: d rows [N, H] -> dx [T, H].
  virtual Tensor dispatch_backward(const Tensor& drows, DispatchState& st) = 0;
  // Makes the caller's current stream wait for the last call on `st` to finish. Needed only
  // with a dispatcher that defers waits (ExchangeOptions::defer_wait); a no-op otherwise.
  virtual void wait(DispatchState& st) {}
};

// One process: every expert is local; dispatch and combine are permutations.
class LocalDispatcher final : public ExpertDispatcher {
 public:
  using ExpertDispatcher::dispatch;
  int64_t num_local_experts(int64_t num_experts) const override { return num_experts; }
  DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) override;
  Tensor combine(const Tensor& expert_rows, DispatchState& st) override;
  // The expert outputs untouched, with the permutation's slot_row as their order.
  PlacedRows combine_in_place(const Tensor& expert_rows, DispatchState& st) override;
  Tensor combine_backward(const Tensor& dout, DispatchState& st) override;
  Tensor dispatch_backward(const Tensor& drows, DispatchState& st) override;
};

struct ExchangeOptions {
  // At every dispatch, check over the EP group that every (token, slot) copy goes to
  // exactly one expert (all-to-all: that each rank expects from each peer exactly the rows
  // that peer sends it): one all_gather of a few counts per rank (on CUDA one more host
  // sync). Off (training, unless [parallel].check_exchange): only what a rank can check
  // alone (all-to-all: that its counts add up to T*K).
  bool check_conservation = false;
  // CUDA: the stream the dispatcher's work runs on, so that it can overlap compute. Each call
  // makes it wait for the caller's current (compute) stream, runs there, and then makes
  // the compute stream wait for it. nullptr: everything on the current stream. Ignored for
  // CPU tensors (Gloo collectives finish before they return). Not owned: it must outlive
  // the dispatcher's work.
  cuda::Stream comm_stream = nullptr;
  // CUDA: a second stream for the backward's exchanges (combine_backward*, dispatch_backward),
  // used where the transport allows two streams at once (AllGatherDispatcher through the peer
  // arenas, one per stream, no NCCL kernel on either), so that under paired micro-batches
  // one's forward exchange never queues behind the other's backward exchange. nullptr, or
  // another transport: comm_stream for all.
  cuda::Stream comm_stream_backward = nullptr;
  // With comm_stream: calls return without making the compute stream wait; the caller
  // calls wait(st) before it uses a call's result, so compute enqueued in between (another
  // micro-batch's) overlaps the exchange. Until then `st` keeps the call's inputs and
  // results alive (the compute stream must not reuse their memory): wait before dropping it.
  bool defer_wait = false;
  // AllGatherDispatcher on GPUs of one host: move the token rows with copies straight into
  // the peers' memory over NVLink (PeerArena: copy engines, no SMs) instead of NCCL's
  // kernels, when every rank of the group can (decided once, by all together).
  bool peer_copies = false;
  // AllGatherDispatcher: no rank dispatches more tokens than this (a micro-batch's B x S,
  // the same config on every rank), so every rank's gathered block is padded to it without
  // first asking the others for their counts (a collective and a host wait a dispatch).
  // 0: ask at every dispatch.
  int64_t max_tokens = 0;
  // Tests: edits the row counts received in the count exchange ([peer][local expert])
  // before they are checked, to provoke a conservation violation (all-to-all only).
  std::function<void(std::vector<int64_t>& received_counts)> tamper_received_counts;
};

// Where a multi-rank dispatcher's exchanges run (ExchangeOptions::comm_stream and
// defer_wait), timed on the active CollectiveTimer (telemetry/collective_timer.h) as the
// dispatch's or the combine's: the part AllToAllDispatcher and AllGatherDispatcher share.
class ExchangeStream {
 public:
  ExchangeStream(cuda::Stream comm_stream, bool defer_wait) : comm_(comm_stream), defer_(defer_wait) {}
  ~ExchangeStream();
  ExchangeStream(const ExchangeStream&) = delete;
  ExchangeStream& operator=(const ExchangeStream&) = delete;

  // Runs `body` where the dispatcher's work goes: on the communication stream after the
  // caller's stream (the inputs are ready there), then either making the caller's stream
  // wait for it or, deferred, keeping `inputs` and the result alive in `st` until wait().
  // On the CPU, or with no communication stream, `body` runs in place. `kind`: the
  // dispatch's collectives (forward and backward) or the combine's.
  // after_compute = false: the body continues this stream's last call (the rest of one
  // exchange), needing nothing the caller's stream made since, so the communication stream
  // does not wait for the caller's stream again, and the timer counts no new exchange.
  template <typename F>
  auto run(Collective kind, const Device& device, DispatchState& st, std::initializer_list<Tensor> inputs, F&& body,
           bool after_compute = true);
  // The caller's stream waits for the last deferred call on `st`.
  void wait(DispatchState& st);

  // A collective of the running body about to send `bytes` to other ranks.
  void count_bytes(double bytes) {
    CollectiveTimer::count_bytes(kind_, bytes);
  }

 private:
  // Returns the event after the work just enqueued on the communication stream.
  void* before(cuda::Stream compute);
  void* after(DispatchState& st, std::initializer_list<Tensor> inputs);
  void keep(DispatchState& st, const Tensor& t) { st.in_flight.push_back(t); }
  void keep(DispatchState& st, const DispatchOut& o);
  void keep(DispatchState& st, const ExpertDispatcher::CombineGrads& g);
  void keep(DispatchState& st, const ExpertDispatcher::PlacedRows& p);

  cuda::Stream comm_;
  bool defer_;
  void* ready_event_ = nullptr;  // cuda::Event, created on first use
  void* done_event_ = nullptr;
  Collective kind_ = Collective::kDispatch;  // of the body running
};

// What the multi-rank dispatchers share: the EP group and its options, the stream their
// exchanges run on (with the deferred waits and timing), and which experts this rank holds.
class GroupDispatcher : public ExpertDispatcher {
 public:
  // E / P; an Error naming both numbers when P does not divide E.
  int64_t num_local_experts(int64_t num_experts) const override;
  // The first global expert this rank holds (parallel/layout.h's split).
  int64_t first_local_expert(int64_t num_experts) const;
  void wait(DispatchState& st) override { stream_.wait(st); }

 protected:
  // `kind` names the dispatcher in errors ("" or " (all-gather)").
  GroupDispatcher(Communicator& ep, ExchangeOptions options, const char* kind);
  // "expert dispatch[ (kind)] of layer L on <group>", for errors.
  std::string where(const DispatchState& st) const;
  // A host tensor moved to `device` (no copy when that is the host).
  static Tensor on(const Device& device, Tensor host) { return device.is_cpu() ? host : host.to(device); }
  // Runs a collective of the EP group, call(in, out, stream), into `out`: on the tensors
  // themselves where the backend moves them (CPU tensors; NCCL on the current stream, the
  // communication stream inside ExchangeStream::run, never the communicator's own default,
  // which is not ordered after the kernels that made `in`), else (Gloo with device tensors)
  // through host copies.
  template <typename F>
  void collective(const Tensor& in, Tensor& out, F&& call) {
    if (in.device().is_cpu() || nccl_) {
      call(in, out, in.device().is_cpu() ? nullptr : cuda::current_stream());
      return;
    }
    Tensor host_out = Tensor::empty(out.shape(), out.dtype());
    call(in.to(Device::cpu()), host_out, nullptr);
    out.copy_from(host_out);
  }

  Communicator& ep_;
  ExchangeOptions opt_;
  bool nccl_;  // the backend moves device tensors
  ExchangeStream stream_;
  ExchangeStream back_stream_;  // on comm_stream_backward (used only where a dispatcher says so)

 private:
  const char* kind_;
};

// Expert parallelism over the EP group `ep` (size P, rank r; E experts, E divisible by P):
// rank r holds global experts [r E/P, (r+1) E/P).
//
// dispatch: sorts this rank's (token, slot) copies by global expert (the copies for peer
// p's experts are then one contiguous block), exchanges the per-(peer, local expert) row
// counts with one all-to-all of E/P i64 per peer (the host must know them to size the row
// exchange: the one host synchronisation a dispatch needs; combine and the backwards
// need none), sends the rows with one all-to-all-v, and regroups what arrives
// (peer-major) into local-expert-major order with one device gather.
//
// Order contract: the rows of local expert e are those of every source rank in rank
// order, each source's in its (t, k) order. That is exactly the order LocalDispatcher
// gives expert r E/P + e for the batch made of all EP ranks' tokens concatenated in rank
// order, so an EP layer sees the same rows, in the same order, as one process would.
//
// combine is the inverse route, ending in this rank's (t, k) order (combine_in_place stops
// one gather short of it, leaving the weighted combine to read the rows through an order);
// combine_backward routes gradients as dispatch does and dispatch_backward as combine, then
// sums each token's K copies (in k order, as LocalDispatcher does). Every rank of `ep` calls the same methods
// in the same order (they are collectives).
class AllToAllDispatcher final : public GroupDispatcher {
 public:
  explicit AllToAllDispatcher(Communicator& ep, ExchangeOptions options = {});
  AllToAllDispatcher(const AllToAllDispatcher&) = delete;
  AllToAllDispatcher& operator=(const AllToAllDispatcher&) = delete;

  using ExpertDispatcher::dispatch;
  DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) override;
  Tensor combine(const Tensor& expert_rows, DispatchState& st) override;
  // The rows back from the experts' ranks as they arrive (this rank's copies grouped by
  // global expert), with the permutation's slot_row as their order: combine() without its
  // last gather.
  PlacedRows combine_in_place(const Tensor& expert_rows, DispatchState& st) override;
  Tensor combine_in_place_backward(const Tensor& d_placed, DispatchState& st) override;
  bool in_place_backward_is_identity() const override { return false; }
  Tensor combine_backward(const Tensor& dout, DispatchState& st) override;
  Tensor dispatch_backward(const Tensor& drows, DispatchState& st) override;

 private:
  // The all-to-all-v of `in` (send[p] rows for peer p, back to back) into `out`.
  void all_to_all(const Tensor& in, const std::vector<int64_t>& send, Tensor& out, const std::vector<int64_t>& recv);
  // rows -> a new tensor with what the peers send back.
  Tensor exchange(const Tensor& rows, const std::vector<int64_t>& send, const std::vector<int64_t>& recv);
  // Expert outputs (local-expert-major) -> this rank's copies grouped by global expert, and
  // the gradient of those back (the two routes of combine and its backward).
  Tensor rows_home(const Tensor& expert_rows, DispatchState& st);
  Tensor rows_back_to_experts(const Tensor& d_home, DispatchState& st);
  // The group-wide token conservation check (ExchangeOptions::check_conservation).
  void check_conservation_over_group(const DispatchState& st, const Device& device, int64_t pairs);
  // That `st` holds a dispatch and `t` has `rows` rows.
  void check_dispatched(const DispatchState& st, const Tensor& t, int64_t rows, const char* what) const;
};

// ---- ExchangeStream::run ----

template <typename F>
auto ExchangeStream::run(Collective kind, const Device& device, DispatchState& st, std::initializer_list<Tensor> inputs,
                         F&& body, bool after_compute) {
  kind_ = kind;
  st.kind = kind;
  if (device.is_cpu() || comm_ == nullptr) {  // in place: on the compute stream, or synchronous (Gloo)
    CollectiveScope timed(kind, /*continues=*/!after_compute);
    return body();
  }
  if (after_compute) before(cuda::current_stream());
  auto out = [&] {
    // Allocations and copies inside go to the communication stream, and the temporaries
    // are freed there, after their last use.
    cuda::CurrentStreamScope scope(comm_);
    CollectiveScope timed(kind, comm_, /*on_compute=*/false, /*continues=*/!after_compute);
    return body();
  }();
  if (defer_) keep(st, out);
  after(st, inputs);
  return out;
}

}  // namespace moetrain
