// Qwen3-MoE: the decoder-only MoE model of Hugging Face's Qwen3MoeForCausalLM, with its
// forward and backward written out by hand.
//
// Per layer: x -> RMSNorm -> attention (q/k per-head RMSNorm, RoPE, causal GQA) -> + x
//   -> RMSNorm -> router (softmax, top-k) -> experts (SwiGLU) -> weighted sum -> + residual.
// A layer is cut into the five stages of DESIGN.md §3; this file implements stages 1
// (attn), 3 (mlp) and 5 (aggregate); an ExpertDispatcher supplies 2 and 4. Backward
// mirrors them, split into backward_input (dgrad, needed at once by the layer below) and
// backward_weight (wgrad, deferrable).
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "engine/data/loader.h"
#include "engine/models/qwen3_moe_config.h"
#include "engine/parallel/expert_dispatch.h"
#include "engine/parameters.h"
#include "ops/ops.h"

namespace moetrain {

// What one decoder layer saves in forward and, during backward_input, the output
// gradients its deferred weight-gradient step needs.
struct Qwen3MoeLayerState {
  // forward, stage 1
  Tensor x;                        // layer input [T, H]
  ops::RmsNormOut ln1;             // input_layernorm
  Tensor q_raw, k_raw, v;          // projections, [T, heads * hd]
  ops::RmsNormOut q_norm, k_norm;  // per-head norms: their rstd (y, with RoPE, is moved into q, k)
  Tensor q, k;                     // after RoPE
  ops::AttentionOut attn;
  Tensor h;                        // x + o_proj(attention): the residual stream after attention
  ops::RmsNormOut ln2;             // post_attention_layernorm: the MLP input
  Tensor router_logits;
  ops::RouterOut route;
  ops::ZLossOut z;                 // router z-loss terms (when its coefficient is set)
  // stage 2-4
  DispatchState dispatch;
  DispatchOut expert_in;           // rows grouped by expert (dense layer: ln2.y, one group)
  ops::SwigluOut mlp;
  Tensor expert_out;               // [T*K, H] (t, k) order, or expert order with expert_order; dense: [T, H]
  Tensor expert_order;             // i32 [T*K]: (t, k)'s row of expert_out (undefined: (t, k) order)
  // backward_input results kept for backward_weight
  Tensor d_mlp_out;                // d mlp.y
  ops::SwigluInputGrads d_mlp;
  Tensor d_router_logits, d_ln2_out, d_h, d_q_raw, d_k_raw, d_v, d_ln1_out;
  Tensor dw_q_norm, dw_k_norm;     // the q/k norm weights' gradients of this micro-batch
};

// Shapes of the current micro-batch that every stage needs.
struct BatchShape {
  int64_t batch = 0, seq = 0;
  Tensor segment_ids;  // i32 [batch * seq]: attention within each packed document; undefined: causal
  int64_t tokens() const { return batch * seq; }
};

// What part of the model this process holds and how its weights are laid out.
struct ModelPlacement {
  // Expert parallelism: this rank holds experts [ep_rank * E/ep_size, (ep_rank+1) * E/ep_size)
  // of every MoE layer, under their global ids (names stay HF names).
  int64_t ep_size = 1, ep_rank = 0;
  // Each parameter bucket is padded to a multiple of this many elements, so the sharded
  // optimizer can cut it into equal shards (the size of the largest sharding group).
  int64_t bucket_pad = 1;
  // Pipeline parallelism: the decoder layers this rank holds (global ids, ascending; empty:
  // all), and whether it holds the embedding (first chunk) and the final norm + head (last).
  std::vector<int64_t> layers;
  bool embed = true, head = true;
};

// A pipeline chunk: decoder layers [first_layer, last_layer) (global ids), after the
// embedding when `embed`, followed by the final norm, head and loss when `head`.
struct ChunkSpec {
  int64_t first_layer = 0, last_layer = 0;
  bool embed = false, head = false;
};

// Router statistics a micro-batch carries from chunk to chunk. HF's load-balancing loss is
// E * sum_e (n_e / R)(P_e / R) over the rows of EVERY MoE layer, which does not split into
// per-layer terms: each chunk adds its layers' picks n_e, probability sums P_e and rows R,
// and the head turns the totals (summed over the data ranks too) into the loss. The
// backward of every MoE layer needs the final n_e and R, so they travel back with the
// gradients. pack()/unpack() give the f64 [2E + 2] message pipeline ranks exchange.
struct RouterTotals {
  Tensor selections, prob_sum;  // [E], the router statistic dtype, on the model's device
  int64_t rows = 0;
  Tensor z_sum;                 // [1] sum over rows of logsumexp(logits)^2 (router z-loss), as selections
  Tensor pack() const;          // f64 [2E + 2] on the CPU
  static RouterTotals unpack(const Tensor& packed, int64_t num_experts, DType stat, Device device);
};

// What one micro-batch's pass through a chunk keeps for its backward.
struct ChunkActivations {
  std::vector<Qwen3MoeLayerState> layers;  // the chunk's decoder layers, in order
  Tensor final_in;                         // head: the final norm's input, its output, and
  ops::RmsNormOut final_norm;              //   the loss gradient at the chunk output,
  Tensor d_out;                            //   computed with the loss in the forward
  Tensor d_embed_out;                      // embed: gradient at the embedding output (for W)
  RouterTotals totals;                     // the micro-batch's final totals (for backward)
  // Per MoE layer of the chunk, tokens routed to each of this rank's experts (i64, on the
  // model's device: read once the pass is queued, see MicroBatchLoss::read_device_values).
  std::vector<Tensor> expert_counts;
};

// How a chunk's forward runs.
struct ChunkPass {
  bool training = true;          // keep state for backward; the head computes its gradient
  double ce_scale = 1.0;         // head: d loss / d (sum of token cross-entropies)
  double aux_scale = 1.0;        // scale of the router losses (1 / micro-batches)
  bool head_accumulate = false;  // head: add to the head's weight gradients (else write)
  bool router_stats = true;      // add the router totals and expert counts (false: logits only)
};

// Told by the model when weights are about to be used and when their gradients are final,
// so a sharded-weight scheme (FsdpContext) can gather weights just in time, drop them after
// use, and reduce gradients as soon as a layer's exist. `layer` -1 is the embedding, final
// norm and head (used at both ends of a pass).
class WeightHooks {
 public:
  virtual ~WeightHooks() = default;
  virtual void before_forward(int64_t layer) = 0;
  // backward_follows: the layer's weights are needed again soon (the last layer of a training pass).
  virtual void after_forward(int64_t layer, bool backward_follows) = 0;
  virtual void before_backward(int64_t layer) = 0;
  virtual void after_backward(int64_t layer) = 0;
  // Where the expert weight-gradient op of `layer` should leave the sum of the squares of
  // the gradients it writes, when it writes them (not adds to them); {} when not wanted.
  virtual ops::SumSquaresInto expert_grad_squares(int64_t /*layer*/) { return {}; }
};

class Qwen3MoeDecoderLayer {
 public:
  Qwen3MoeDecoderLayer(const Qwen3MoeConfig& cfg, int64_t layer_id, DType dtype, Device device,
                       const ModelPlacement& placement = {});

  int64_t layer_id() const { return id_; }
  bool is_moe() const { return moe_; }
  // Global id of this rank's first expert, and how many it holds (1 for a dense MLP).
  int64_t first_expert() const { return first_expert_; }
  int64_t local_experts() const { return w_gate_.size(0); }
  // The layer's flat weight buffers (attention + router (+ dense MLP), and the experts),
  // until the model takes them over.
  std::vector<ParamBucket>& buckets() { return buckets_; }
  // This layer's parameters under canonical names (experts as per-expert views).
  void collect_parameters(ParameterList& out);

  // Stage 1: fills s.h (residual stream) and s.ln2.y (MLP input) and, for an MoE layer,
  // s.route (top-k experts and weights).
  void attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b, Qwen3MoeLayerState& s) const;
  // Stage 3: SwiGLU over s.expert_in (grouped by expert), into s.mlp.
  void mlp_forward(Qwen3MoeLayerState& s) const;
  // Stage 5: returns the layer output h + sum_k w_k * expert_k (or h + mlp for dense).
  Tensor aggregate_forward(Qwen3MoeLayerState& s) const;

  // Backward of stage 5: d expert_out (into s) and d topk_weight; returns d h.
  struct AggregateGrads {
    Tensor d_expert_out;  // [T*K, H] in expert_out's layout, or [T, H] for dense
    Tensor d_topk_weight; // [T, K] (undefined for dense)
  };
  AggregateGrads aggregate_backward(const Tensor& dy, Qwen3MoeLayerState& s) const;
  // Backward of stage 3: d rows -> d expert_in rows.
  Tensor mlp_backward_input(const Tensor& d_rows_out, Qwen3MoeLayerState& s) const;
  // Backward of stage 1: given d h (residual + aggregate), d mlp_in (from dispatch backward;
  // taken over: the router's input gradient is added into it in place), d topk_weight and
  // the router's extra d probs (aux losses, may be undefined), returns d x.
  Tensor attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in, const Tensor& d_topk_weight,
                             const Tensor& d_probs_extra, const Tensor& d_logits_extra, const Tensor& positions,
                             const BatchShape& b, Qwen3MoeLayerState& s) const;
  // Every weight gradient of the layer, from what backward_input saved; added into the
  // gradients, or written over them when !accumulate.
  // squares: passed to the expert weight-gradient op (see WeightHooks::expert_grad_squares).
  // defer_experts (MoE layers): keep the experts' weight-gradient inputs instead, and make
  // them in one pass with those of the next micro-batches, up to the first call that does not
  // defer (ops::grouped_swiglu_backward_weight_group, written or added per the first kept
  // micro-batch's `accumulate`); a call with accumulate false drops any kept from an earlier
  // step.
  void backward_weight(Qwen3MoeLayerState& s, bool accumulate = true, ops::SumSquaresInto squares = {},
                       bool defer_experts = false);
  // Forgets the deferred micro-batches' expert inputs (a step abandoned half-way).
  void drop_deferred_expert_weights() { expert_pending_.clear(); }
  // Whether backward_weight(accumulate, defer_experts) writes the experts' weight gradients
  // (rather than adds to them or defers them): then it can pass on their sum of squares.
  bool writes_expert_grads(bool accumulate, bool defer_experts) const {
    if (moe_ && defer_experts) return false;
    return accumulate && !expert_pending_.empty() ? !expert_pending_accumulate_ : !accumulate;
  }

  // The plain path used to validate every layout: no dispatcher, each token's experts
  // evaluated directly. Returns the layer output.
  Tensor reference_forward(const Tensor& x, const Tensor& positions, const BatchShape& b) const;

 private:
  Qwen3MoeConfig cfg_;
  int64_t id_;
  bool moe_;
  int64_t inter_;  // FFN width of this layer's MLP
  int64_t first_expert_ = 0;
  std::vector<ParamBucket> buckets_;
  ops::AttentionShape attn_shape(const BatchShape& b) const;
  // weights (HF names in collect_parameters) and their gradients
  Tensor ln1_w_, ln2_w_, wq_, wk_, wv_, wo_, q_norm_w_, k_norm_w_, gate_w_;
  Tensor w_gate_, w_up_, w_down_;  // [E, I, H], [E, I, H], [E, H, I]; E = 1 for dense
  Tensor g_ln1_w_, g_ln2_w_, g_wq_, g_wk_, g_wv_, g_wo_, g_q_norm_w_, g_k_norm_w_, g_gate_w_;
  Tensor g_w_gate_, g_w_up_, g_w_down_;
  // Deferred micro-batches' expert weight-gradient inputs (backward_weight's defer_experts)
  // and whether the first one's gradients were to be added (else written).
  std::vector<ops::SwigluWgradRows> expert_pending_;
  bool expert_pending_accumulate_ = false;
};

// Loss terms of one micro-batch, as sums the trainer normalises.
//
// The model leaves the terms computed on the GPU in `on_device` and fills the fields from
// them in read_device_values(), one host wait once the micro-batch's forward and backward
// are queued: the host never waits for the device inside a pass (a wait per layer would
// drain the launch queue, and with pipeline parallelism stall the other micro-batch's work).
// forward_loss and forward_backward return the terms read; a pipeline's head reads them.
struct MicroBatchLoss {
  double ce_sum = 0;      // sum of token cross-entropies
  int64_t targets = 0;    // tokens with a target
  double aux_loss = 0;    // load-balancing loss (already times its coefficient)
  double z_loss = 0;      // router z-loss (already times its coefficient)
  std::vector<std::vector<int64_t>> expert_counts;  // per MoE layer, tokens routed to each expert

  struct OnDevice {
    Tensor ce_sum;                      // [1]
    Tensor selections, prob_sum;        // [E] router totals: aux_loss = aux_factor * their dot product
    double aux_factor = 0;
    Tensor z_sum;                       // [1] router totals: z_loss = z_factor * z_sum
    double z_factor = 0;
    std::vector<Tensor> expert_counts;  // per MoE layer, [local experts]
  } on_device;
  // Moves what on_device holds into the fields above (adds nothing twice: on_device is emptied).
  void read_device_values();
};

class Qwen3MoeModel {
 public:
  Qwen3MoeModel(Qwen3MoeConfig cfg, DType dtype, Device device = Device::cpu(), ModelPlacement placement = {});

  const Qwen3MoeConfig& config() const { return cfg_; }
  const ModelPlacement& placement() const { return placement_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  ParameterList& parameters() { return params_; }
  // Every parameter lies in exactly one bucket (members indexed into parameters()).
  std::vector<ParamBucket>& buckets() { return buckets_; }
  // Data parallelism: the group over which the ranks hold different tokens of one global
  // batch. The load-balancing loss needs the batch's global expert statistics, so they are
  // summed over it (nullptr: one process).
  void set_data_group(Communicator* group) { data_group_ = group; }
  // nullptr: every weight is always whole (one process, or weights replicated).
  void set_weight_hooks(WeightHooks* hooks) { hooks_ = hooks; }
  WeightHooks* weight_hooks() const { return hooks_; }
  // Draws every parameter from the stream keyed by (seed, canonical name).
  void init_weights(uint64_t seed) { init_parameters(params_, seed); }

  // Forward and backward of one micro-batch. Gradients ACCUMULATE into the parameters'
  // grads, or, with accumulate_grads false (a step's first micro-batch), overwrite them, so
  // they need no zeroing first. The cross-entropy sum is scaled by ce_scale (1 / targets of
  // the whole step) and the auxiliary losses by aux_scale (1 / micro-batches), so
  // accumulated micro-batches give the gradient of the step's mean loss.
  // defer_expert_weights: the MoE layers keep their experts' weight-gradient inputs and make
  // them together with those of the following micro-batches, in the first call that does not
  // defer (one pass over the experts' f32 dW for the group); a step's last micro-batch must
  // not defer. Not with hooks that need every micro-batch's gradients complete (FSDP with
  // sharded weights).
  MicroBatchLoss forward_backward(const Batch& batch, ExpertDispatcher& dispatcher, double ce_scale,
                                  double aux_scale, bool accumulate_grads = true, bool defer_expert_weights = false);
  // How many micro-batches the trainer groups for one pass of the experts' weight gradients
  // (the run config's [training].expert_wgrad_group; 1: none).
  int64_t expert_wgrad_group() const { return expert_wgrad_group_; }
  void set_expert_wgrad_group(int64_t n) { expert_wgrad_group_ = n; }
  // Forward only: loss terms without touching gradients.
  MicroBatchLoss forward_loss(const Batch& batch, ExpertDispatcher& dispatcher);
  // Logits [T, V] for ids/positions, through the staged path.
  Tensor forward_logits(const Tensor& ids, const Tensor& positions, const BatchShape& b, ExpertDispatcher& dispatcher);
  // Logits through each layer's reference_forward (no dispatcher, no saved state).
  Tensor reference_forward(const Tensor& ids, const Tensor& positions, const BatchShape& b) const;

  // ---- pipeline pieces: a chunk's F, B (input gradient) and W (weight gradient) ----
  // The chunk of everything this rank holds.
  ChunkSpec whole() const;
  // Empty totals to start a micro-batch's first chunk with.
  RouterTotals new_totals() const;
  // F. `x`: the chunk input [T, H] (ignored by an embed chunk, which reads batch.inputs).
  // Adds the chunk's router statistics to `totals`. Returns the chunk output; a head chunk
  // instead fills *loss (its router losses use the totals summed over the data group) and,
  // when training, a.d_out and the head's weight gradients, and returns an undefined tensor.
  Tensor forward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& x, ExpertDispatcher& d,
                       ChunkActivations& a, RouterTotals& totals, const ChunkPass& pass, MicroBatchLoss* loss);
  // B: the gradient at the chunk input from `dy`, the gradient at its output (a head chunk
  // starts from a.d_out); a.totals must hold the micro-batch's final totals. With
  // `weights_now`, each layer's weight gradients follow its input gradient at once (written
  // or added per `accumulate`) and its state is dropped; otherwise backward_chunk_weight does
  // them later. An embed chunk returns an undefined tensor.
  Tensor backward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ExpertDispatcher& d,
                        ChunkActivations& a, double aux_scale, bool weights_now, bool accumulate);
  // W: every weight gradient of the chunk from what its B kept.
  void backward_chunk_weight(const ChunkSpec& c, const Batch& batch, ChunkActivations& a, bool accumulate);
  // F of chunk `fc` and B of chunk `bc` (another micro-batch), interleaved at the
  // dispatch / combine boundaries: with a dispatcher that defers its waits (AllToAllOptions:
  // a communication stream), one pass's all-to-all is in flight while the other computes.
  // The same results as forward_chunk then backward_chunk (B without weights); returns
  // {F's output, B's input gradient}.
  std::pair<Tensor, Tensor> forward_backward_overlapped(const ChunkSpec& fc, const Batch& fbatch, const Tensor& x,
                                                        ChunkActivations& fa, RouterTotals& totals,
                                                        const ChunkPass& pass, MicroBatchLoss* loss,
                                                        const ChunkSpec& bc, const Batch& bbatch, const Tensor& dy,
                                                        ChunkActivations& ba, ExpertDispatcher& d);

  // Training FLOPs per token: 6 * active matmul parameters + 12 * layers * heads * head_dim * seq
  // (of the whole model, whatever part this rank holds).
  double flops_per_token(int64_t seq) const;
  int64_t active_matmul_params() const;

 private:
  // The local index of global layer `id` (an Error when this rank does not hold it).
  size_t local_layer(int64_t id) const;
  // What layer `id`'s weight gradients should do with their sum of squares (the hooks').
  ops::SumSquaresInto expert_squares(int64_t id, bool accumulate) const {
    return hooks_ && !accumulate ? hooks_->expert_grad_squares(id) : ops::SumSquaresInto{};
  }
  // A dense layer's "expert counts" (one expert taking all `tokens` rows), i64 [1] on the
  // model's device: made once per token count, not copied over from the host every pass.
  const Tensor& dense_counts(int64_t tokens) const;
  // The head's router losses from the micro-batch's totals (summed over the data group).
  void router_losses(RouterTotals& totals, MicroBatchLoss& out) const;
  // Chunk passes in pieces cut at the expert exchanges (qwen3_moe.cpp).
  struct ForwardCursor;
  struct BackwardCursor;
  ForwardCursor begin_forward(const ChunkSpec& c, const Batch& batch, const Tensor& x, ChunkActivations& a,
                              RouterTotals& totals, const ChunkPass& pass);
  bool forward_piece(ForwardCursor& f, ExpertDispatcher& d) const;  // false when no layer is left
  Tensor end_forward(ForwardCursor& f, const ChunkPass& pass, MicroBatchLoss* loss);
  BackwardCursor begin_backward(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ChunkActivations& a,
                                double aux_scale, bool weights_now, bool accumulate);
  bool backward_piece(BackwardCursor& g, ExpertDispatcher& d);
  Tensor end_backward(BackwardCursor& g);

  Qwen3MoeConfig cfg_;
  DType dtype_;
  Device device_;
  ModelPlacement placement_;
  Communicator* data_group_ = nullptr;
  WeightHooks* hooks_ = nullptr;
  int64_t expert_wgrad_group_ = 1;
  bool defer_expert_weights_ = false;  // during a forward_backward that defers them
  std::vector<ParamBucket> buckets_;
  Tensor embed_, final_norm_w_, lm_head_;  // lm_head_ aliases embed_ when tied
  Tensor g_embed_, g_final_norm_w_, g_lm_head_;
  std::vector<std::unique_ptr<Qwen3MoeDecoderLayer>> layers_;  // the layers held, ascending id
  ParameterList params_;
  mutable std::map<int64_t, Tensor> dense_counts_;  // dense_counts(), by token count
};

}  // namespace moetrain
