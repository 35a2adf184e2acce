// Pipeline parallelism: cutting the model into chunks, placing them on pipeline ranks, and
// running a PipelineSchedule (schedule.h) over one rank's chunks.
//
// The executor walks this rank's list of F / B / W / FB steps. A chunk's input comes from
// the previous chunk, on this rank (handed over in memory) or on another (received); its
// output goes to the next chunk the same way. Activations travel forward and gradients
// back, each with the micro-batch's router totals (RouterTotals: HF's load-balancing loss
// needs every MoE layer's statistics, so they ride along with the hidden states and come
// back with the gradients). Sends are non-blocking and awaited at the end of the step; a
// receive is awaited when its step runs. So any order that validate() accepts runs without
// deadlock: that check simulates exactly these rules. On Gloo messages are matched by tag;
// on GPUs of one host each has its own slot in the receiver's memory (PeerTransport,
// peer_transport.h); on NCCL they are matched by order, through OrderedTransport
// (nccl_transport.h), in the one order of the step's messages that
// pipeline_message_order() gives (which also names the peer transport's slots).
//
// Gradients: the first W of a chunk in a step writes its weight gradients, later ones add
// (no zeroing pass); the head writes in its first F and adds after. The experts' weight
// gradients of a chunk's W steps go in groups of the model's expert_wgrad_group (their
// inputs kept until the group's last W makes them in one pass).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "engine/models/model.h"
#include "engine/pipeline/nccl_transport.h"
#include "engine/pipeline/schedule.h"

namespace moetrain {

// The model cut into `num_chunks` chunks of consecutive decoder layers. Every chunk gets at
// least one layer (an Error names the numbers when there are fewer layers than chunks); the
// head weighs `head_layers` layers in the last chunk (head_weight_in_layers), the embedding
// lookup nothing; each remaining layer goes to the cheapest chunk (ties: fewer layers, then
// the middle). So the
// edge chunks get fewer decoder layers. The `mtp_layers` multi-token prediction modules
// (models/mtp.h: layers num_layers ..) end the last chunk, a layer and a head each.
std::vector<ChunkSpec> partition_layers(int64_t num_layers, int num_chunks, int64_t mtp_layers = 0,
                                        double head_layers = 1.0);
// The head's work in mean decoder layers: its vocabulary x hidden weight against each layer's
// weights that a token multiplies (attention, router, shared experts, its top-k routed
// experts), the FLOPs of both being 6 per weight a token. It leaves out the attention core
// (at 4K tokens about a fifth of a Qwen3-30B-A3B layer), so it weighs the head a little high
// for long sequences. Qwen3-30B-A3B: 5.5; the bench model (32K vocabulary): 1.2.
double head_weight_in_layers(const ModelConfig& model);

// The head helper for a training schedule over `chunks` (schedule.h, add_head_helper): the
// rank whose layers weigh least besides the head's, the share of the head's rows that evens
// their work (each layer's F + B + W against the head's `head_layers`), and the head's cost in
// units of one chunk's F. `setting`: [parallel].head_share (-1 auto: DualPipeV only, off
// under 5%; 0 off; else that share). share 0: no helper.
struct HeadHelp {
  int helper = -1;
  double share = 0, head_cost = 0;
};
HeadHelp choose_head_helper(const std::vector<ChunkSpec>& chunks, const PipelineSchedule& schedule,
                            double head_layers, double setting);

// What pipeline rank `rank` of `schedule` holds: its chunks' layers, and the embedding /
// head when it holds the first / last chunk. Expert placement and padding are left as given.
ModelPlacement pipeline_placement(const std::vector<ChunkSpec>& chunks, const PipelineSchedule& schedule, int rank,
                                  ModelPlacement base);

// Rank `rank`'s messages in one run of `s`, in the one order all ranks follow over NCCL
// (nccl_transport.h): every message of the step sorted by the unit-cost finish time of the
// op that sends it (finish_times), then by sending rank and op; an FB sends its forward
// output before its backward output. `rows[m]`: rows of micro-batch m's hidden states.
std::vector<OrderedTransport::Message> pipeline_message_order(const PipelineSchedule& s, int rank,
                                                              const std::vector<int64_t>& rows);
// The tag of the hidden state that chunk `chunk` of micro-batch `mb` receives: its input
// activation, or (gradient) the gradient of its output.
uint32_t pipeline_message_tag(bool gradient, int chunk, int mb);

class PipelineExecutor {
 public:
  // `pp_group`: the pipeline group (rank r of it is pipeline rank r); nullptr for pp = 1.
  PipelineExecutor(Model& model, ExpertDispatcher& dispatcher, Communicator* pp_group,
                   std::vector<ChunkSpec> chunks);

  // Loss terms of the head chunks this rank ran (zero on ranks without the head).
  struct Result {
    bool has_head = false;
    double ce_sum = 0;     // sum of token cross-entropies over the micro-batches
    LossTerms terms;       // the model's other loss terms, summed over micro-batches
    // Per MoE layer this rank holds (ascending id), tokens routed to each local expert,
    // summed over the micro-batches.
    std::vector<std::vector<int64_t>> expert_counts;
    std::vector<double> router_entropy;  // per MoE layer as expert_counts: sum over the tokens
  };

  // One optimizer step's forward and backward: `batches[m]` is micro-batch m. The head
  // scales the cross-entropy by ce_scale (1 / targets of the step) and the router losses by
  // aux_scale (1 / micro-batches).
  Result train(const PipelineSchedule& schedule, const std::vector<Batch>& batches, double ce_scale,
               double aux_scale);
  // Forward only (validation): `schedule` from make_forward_only.
  Result forward(const PipelineSchedule& schedule, const std::vector<Batch>& batches);
  // Paired steps (FB, FF, BB): interleave the pair's pieces (the default; the point of
  // DualPipeV), or run one half then the other (same results; for comparison).
  void set_overlap(bool on) { overlap_ = on; }
  // Timing of each step's ops (bench): compute time per op kind on this rank and the step's
  // wall time, so busy / wall gives the rank's measured bubble. Host clock on the CPU, CUDA
  // events on the compute stream on a GPU (one synchronisation at the end of a step).
  struct Timing {
    double step_ms = 0;
    double f_ms = 0, b_ms = 0, w_ms = 0, fb_ms = 0, h_ms = 0;  // summed over the step's ops
    int f = 0, b = 0, w = 0, fb = 0, h = 0;  // how many of each (an FF is two F, a BB two B)
    double busy_ms() const { return f_ms + b_ms + w_ms + fb_ms + h_ms; }
  };
  void set_timing(bool on) { timing_on_ = on; }
  const Timing& last_timing() const { return timing_; }
  // The messages the last run sent to other ranks, in order: (pipeline rank, tag).
  const std::vector<std::pair<int, uint32_t>>& sent() const { return sent_; }

 private:
  using Key = std::pair<int, int>;  // (chunk, micro-batch)
  struct Handoff {                  // a chunk's input (forward) or output gradient (backward)
    Tensor hidden;
    RouterTotals totals;
  };
  Result run(const PipelineSchedule& s, const std::vector<Batch>& batches, const ChunkPass& pass);
  void add_time(PipeOpKind kind, double ms);
  void mark_inputs_in();
  void forward_step(int chunk, int mb, const Batch& batch, ChunkPass pass, Result& r);
  void input_grad_step(int chunk, int mb, const Batch& batch, double aux_scale);
  void overlapped_step(const PipeOp& op, const std::vector<Batch>& batches, ChunkPass pass, Result& r);
  void forwards_overlapped_step(const PipeOp& op, const std::vector<Batch>& batches, ChunkPass pass, Result& r);
  void backwards_overlapped_step(const PipeOp& op, const std::vector<Batch>& batches, double aux_scale);
  // The halves of F and B around the model's work: taking the input, handing on the output.
  Handoff forward_input(int chunk, int mb, const Batch& batch);
  void forward_output(int chunk, int mb, Handoff out, const MicroBatchLoss& loss, bool training, Result& r);
  // The step's expert counts and losses, read from the device once every step is queued.
  void read_results(Result& r);
  Tensor backward_input(int chunk, int mb, const Batch& batch, ChunkActivations*& a);
  void backward_output(int chunk, int mb, Tensor dx, const ChunkActivations& a);
  void weight_step(int chunk, int mb, const Batch& batch);
  // The head helper (PipelineSchedule::head_helper): H on the helper; the head's weights
  // copied to it at a step's start and its weight gradient added into the head's at the end.
  void head_help_step(int mb, const Batch& batch, double ce_scale);
  void sync_head_weights();
  void add_helper_gradient();
  bool helped() const { return schedule_ != nullptr && schedule_->head_helper >= 0; }
  int64_t head_rows(const Batch& batch) const;  // ChunkPass::head_rows for this micro-batch
  // A micro-batch's token rows on this rank (under tensor parallelism its sequence-parallel slice).
  int64_t token_rows(const Batch& batch) const { return batch.batch * batch.seq / model_.placement().tp_size; }
  // The helper's rows: sent (hidden only) and received, through the transport or Gloo.
  void send_rows(int to, uint32_t tag, const Tensor& rows);
  Tensor receive_rows(int from, uint32_t tag, int64_t rows);
  // The forward input / backward output gradient of (chunk, mb): from this rank's own
  // hand-over, or received from `peer`.
  Handoff take(std::map<Key, Handoff>& local, Key key, bool backward, const Batch& batch);
  void give(std::map<Key, Handoff>& local, Key key, bool backward, Handoff h);
  int rank_of(int chunk) const { return schedule_->rank_of_chunk(chunk); }
  Tensor for_comm(const Tensor& t) const;  // where the pipeline group's backend reads tensors

  Model& model_;
  ExpertDispatcher& dispatcher_;
  Communicator* pp_;
  std::vector<ChunkSpec> chunks_;
  const PipelineSchedule* schedule_ = nullptr;
  int rank_ = 0;
  std::map<Key, ChunkActivations> acts_;
  std::map<Key, Handoff> inputs_, grads_;
  std::vector<std::unique_ptr<P2pRequest>> sends_;
  std::unique_ptr<PipelineTransport> transport_;  // GPUs: peer copies or NCCL
  std::vector<std::pair<int, uint32_t>> sent_;
  std::vector<bool> weights_written_;  // per chunk: a W of this step already wrote its grads
  std::vector<int> weights_done_;      // per chunk: W steps run this step
  bool head_written_ = false;
  bool norm_written_ = false;   // the final norm's gradient (written by the first finish_head)
  Tensor helper_w_, helper_g_;  // the helper's copy of the head and its gradient
  bool helper_written_ = false;
  std::vector<Tensor> helper_ce_;  // the helper's cross-entropy sums, read at the step's end
  bool overlap_ = true;
  bool timing_on_ = false;
  Timing timing_;
  std::chrono::steady_clock::time_point inputs_in_;
  cuda::Event inputs_in_event_ = nullptr;
  std::map<int, std::vector<std::vector<int64_t>>> counts_;  // per chunk, summed over mbs
  std::map<int, std::vector<double>> entropy_;                // per chunk, summed over mbs
  struct Unread {  // a forward's expert counts and (head) losses, still on the device
    int chunk = -1;
    MicroBatchLoss loss;
  };
  std::vector<Unread> unread_;
};

}  // namespace moetrain
