// MoeDecoderModel: what every decoder-only MoE family shares, written once: the embedding,
// the final RMSNorm and the LM head (Hugging Face's model.embed_tokens, model.norm, lm_head),
// the for-loop over the decoder layers this rank holds, and the chunk passes of the pipeline
// cut into pieces at the expert exchanges (so that one micro-batch's exchange runs while
// another computes). A family derives from it, builds its DecoderLayers in its constructor
// and says what its FLOPs are; its router losses default to Hugging Face's load-balancing
// loss over all MoE layers (+ the optional z-loss), which a family may replace.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/models/model.h"
#include "engine/models/mtp.h"
#include "engine/models/projections.h"
#include "engine/parallel/context_attention.h"
#include "engine/parallel/tensor_parallel.h"

namespace moetrain {

// The parts of a family's config that the shared skeleton reads.
struct DecoderSpec {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0;
  int64_t num_experts = 0;  // routed experts per MoE layer (the router totals' length)
  int64_t experts_per_token = 0;  // top-k: each routed row selects this many
  double rms_norm_eps = 1e-6;
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  double router_aux_loss_coef = 0;  // HF load-balancing loss
  double router_z_loss_coef = 0;    // ST-MoE router z-loss
  // DeepSeek-V3's sequence-wise balance loss (ops::seq_balance_loss_sum): each MoE layer's,
  // a mean over the sequences, summed over the layers (DeepSeek's gates each add theirs). 0: off.
  double seq_aux_loss_coef = 0;
  // Aux-loss-free balancing (DeepSeek-V3): after each step every routing bias moves by this
  // times sign(mean load - expert's load). 0: off.
  double router_bias_update_speed = 0;
  // Multi-token prediction (models/mtp.h): modules after the last layer, each around a
  // decoder layer of id num_layers + depth - 1 held with the head; the weight of their loss.
  int64_t mtp_layers = 0;
  double mtp_loss_weight = 0;
};

// The SwiGLU weight gradients of one micro-batch's rows, written or added (squares as
// ops::grouped_swiglu_backward_weight's): in FP8 (ops::grouped_swiglu_backward_weight_fp8)
// where fp8 and the forward's act is kept, else in BF16.
void swiglu_weight_grads(const ops::SwigluWgradRows& rows, Tensor& g_gate, Tensor& g_up, Tensor& g_down,
                         bool accumulate, ops::SumSquaresInto squares, bool fp8);

// A layer's SwiGLU experts' weight gradients (the routed experts, or a dense MLP held as one
// expert), from what its backward saved: made at once or, for an MoE layer that defers them
// (DecoderLayer::backward_weight's defer_experts), kept and made in one pass with the next
// micro-batches' (ops::grouped_swiglu_backward_weight_group), written or added per the first
// kept micro-batch's `accumulate`. A call with accumulate false drops what an earlier step
// kept.
class ExpertWeightGrads {
 public:
  // fp8: the products in FP8 (ops::grouped_swiglu_backward_weight_fp8, kept micro-batches
  // four at a time).
  void backward_weight(ops::SwigluWgradRows rows, bool moe, bool accumulate, ops::SumSquaresInto squares,
                       bool defer, int64_t layer_id, Tensor& g_gate, Tensor& g_up, Tensor& g_down, bool fp8 = false);
  void drop() { pending_.clear(); }
  // Whether backward_weight(accumulate, defer) writes the gradients (rather than adds or defers).
  bool writes(bool moe, bool accumulate, bool defer) const {
    if (moe && defer) return false;
    return accumulate && !pending_.empty() ? !pending_accumulate_ : !accumulate;
  }

 private:
  std::vector<ops::SwigluWgradRows> pending_;
  bool pending_accumulate_ = false;
};

// i64 [1] tensors holding a row count, on one device: the one group of a grouped SwiGLU
// that takes every row (a dense MLP, DeepSeek-V3's shared experts), made once per count, not
// copied over from the host every pass.
class RowCounts {
 public:
  const Tensor& of(int64_t rows, Device device) const {
    Tensor& t = by_rows_[rows];
    if (!t.defined()) t = Tensor::full({1}, static_cast<double>(rows), DType::I64, device);
    return t;
  }

 private:
  mutable std::map<int64_t, Tensor> by_rows_;
};

// One row through one SwiGLU expert, plainly (reference_forward's path): x [1, H] ->
// W_down (silu(W_gate x) * W_up x), the activation formed in double.
Tensor swiglu_expert_reference(const Tensor& x, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down);

// Stage 3 of both families: the SwiGLU MLP over a layer's grouped rows `in` (every row, or a
// RowPart of them), its forward activations kept in `out` (a part's in its rows of the
// whole; in.rows_q, read once, is dropped); and its input gradient, dgate and dup kept in
// `grads` the same way.
Tensor swiglu_mlp_forward(const Projections& proj, DispatchOut& in, const Tensor& w_gate, const Tensor& w_up,
                          const Tensor& w_down, const RowPart& part, ops::SwigluOut& out);
// d_rows_q: d_rows_out's FP8 codes where the combine's backward made them (DispatchState::
// d_rows_q), used when the rows are whole, else quantized here as needed.
Tensor swiglu_mlp_backward_input(const Projections& proj, const Tensor& d_rows_out, const ops::Fp8Tensor& d_rows_q,
                                 const DispatchOut& in, const ops::SwigluOut& fwd, const Tensor& w_gate,
                                 const Tensor& w_up, const Tensor& w_down, const RowPart& part,
                                 ops::SwigluInputGrads& grads);

// A layer's attention output through o_proj plus the residual x: attn_out Wo^T + x; under
// tensor parallelism (b.tensor) this rank's heads' part of every row, summed over the tp ranks
// into this rank's rows, a slice's GEMM under the transfer of the sum before it.
Tensor attention_output(const Projections& proj, const Tensor& attn_out, const Tensor& wo, const Tensor& x,
                        const BatchShape& b);
// Its input gradient: d attn_out = d_h Wo; under tensor parallelism every row's (d_h gathered
// over the tp ranks into *d_h_all, which the weight gradient reads), slice by slice.
Tensor attention_output_backward(const Projections& proj, const Tensor& d_h, const Tensor& wo, const BatchShape& b,
                                 Tensor* d_h_all);

class MoeDecoderModel : public Model {
 public:
  const ModelPlacement& placement() const override { return placement_; }
  DType dtype() const override { return dtype_; }
  Device device() const override { return device_; }
  ParameterList& parameters() override { return params_; }
  std::vector<ParamBucket>& buckets() override { return buckets_; }
  void set_data_group(Communicator* group, ReplicaBridge* bridge = nullptr) override {
    data_group_ = group;
    bridge_ = bridge;
  }
  void set_weight_hooks(WeightHooks* hooks) override { hooks_ = hooks; }
  WeightHooks* weight_hooks() const override { return hooks_; }

  MicroBatchLoss forward_backward(const Batch& batch, ExpertDispatcher& dispatcher, double ce_scale,
                                  double aux_scale, bool accumulate_grads = true,
                                  bool defer_expert_weights = false) override;
  int64_t expert_wgrad_group() const override { return expert_wgrad_group_; }
  void set_expert_wgrad_group(int64_t n) override { expert_wgrad_group_ = n; }
  void drop_deferred_expert_weights() override;
  void finish_head(ChunkActivations& a, const Tensor& d_tail, bool accumulate) override;
  Tensor head_weight() override;
  Tensor head_weight_grad() override;
  MicroBatchLoss forward_loss(const Batch& batch, ExpertDispatcher& dispatcher) override;
  Tensor forward_logits(const Tensor& ids, const Tensor& positions, const BatchShape& b,
                        ExpertDispatcher& dispatcher) override;
  Tensor reference_forward(const Tensor& ids, const Tensor& positions, const BatchShape& b) const override;
  // aux_loss (HF load balancing, global: a loss of batch totals), z_loss when its
  // coefficient is set (this rank's rows: a share).
  LossTerms loss_terms() const override;
  // Each held MoE layer's routing bias as model.layers.<id>.mlp.gate.e_score_correction_bias
  // (DeepSeek-V3's Hugging Face name).
  std::vector<NamedBuffer> buffers() override;
  // b_e += speed * sign(mean load - load_e), per held MoE layer with a routing bias.
  void balance_experts(const std::vector<std::vector<int64_t>>& expert_counts) override;
  void set_detailed_telemetry(bool on) override { router_entropy_ = on; }
  void set_fp8(bool on) override { projections_.set_fp8(on); }
  void keep_quantized_weights(bool on) override { projections_.keep_weights(on); }
  void set_recompute(const std::vector<int64_t>& layers, RecomputeMode mode) override;
  void set_context_group(Communicator* group) override;
  void set_tensor_group(Communicator* group) override;

  ChunkSpec whole() const override;
  RouterTotals new_totals() const override;
  int64_t totals_message_size() const override { return 2 * spec_.num_experts + 4; }
  Tensor pack_totals(const RouterTotals& t) const override { return t.pack(); }
  RouterTotals unpack_totals(const Tensor& packed) const override;
  // F. `x`: the chunk input [T, H] (ignored by an embed chunk, which reads batch.inputs).
  // Adds the chunk's router statistics to `totals`. Returns the chunk output; a head chunk
  // instead fills *loss (its router losses use the totals summed over the data group) and,
  // when training, a.d_out and the head's weight gradients, and returns an undefined tensor.
  Tensor forward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& x, ExpertDispatcher& d,
                       ChunkActivations& a, RouterTotals& totals, const ChunkPass& pass,
                       MicroBatchLoss* loss) override;
  // B: the gradient at the chunk input from `dy`, the gradient at its output (a head chunk
  // starts from a.d_out); a.totals must hold the micro-batch's final totals. With
  // `weights_now`, each layer's weight gradients follow its input gradient at once (written
  // or added per `accumulate`) and its state is dropped; otherwise backward_chunk_weight does
  // them later. An embed chunk returns an undefined tensor.
  Tensor backward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ExpertDispatcher& d,
                        ChunkActivations& a, double aux_scale, bool weights_now, bool accumulate) override;
  // W: every weight gradient of the chunk from what its B kept (the experts' kept for a
  // later W's one pass with `defer_experts`).
  void backward_chunk_weight(const ChunkSpec& c, const Batch& batch, ChunkActivations& a, bool accumulate,
                             bool defer_experts = false) override;
  // F of chunk `fc` and B of chunk `bc` (another micro-batch), interleaved at the
  // dispatch / combine boundaries: with a dispatcher that defers its waits (ExchangeOptions:
  // a communication stream), one pass's all-to-all is in flight while the other computes.
  // The same results as forward_chunk then backward_chunk (B without weights); returns
  // {F's output, B's input gradient}.
  std::pair<Tensor, Tensor> forward_backward_overlapped(const ChunkSpec& fc, const Batch& fbatch, const Tensor& x,
                                                        ChunkActivations& fa, RouterTotals& totals,
                                                        const ChunkPass& pass, MicroBatchLoss* loss,
                                                        const ChunkSpec& bc, const Batch& bbatch, const Tensor& dy,
                                                        ChunkActivations& ba, ExpertDispatcher& d) override;
  // Two forwards, and two input gradients (B without weights), interleaved the same way.
  std::pair<Tensor, Tensor> forwards_overlapped(const ChunkSpec& c1, const Batch& b1, const Tensor& x1,
                                                ChunkActivations& a1, RouterTotals& t1, MicroBatchLoss* loss1,
                                                const ChunkSpec& c2, const Batch& b2, const Tensor& x2,
                                                ChunkActivations& a2, RouterTotals& t2, MicroBatchLoss* loss2,
                                                const ChunkPass& pass, ExpertDispatcher& d) override;
  std::pair<Tensor, Tensor> backwards_overlapped(const ChunkSpec& c1, const Batch& b1, const Tensor& dy1,
                                                 ChunkActivations& a1, const ChunkSpec& c2, const Batch& b2,
                                                 const Tensor& dy2, ChunkActivations& a2, double aux_scale,
                                                 ExpertDispatcher& d) override;

 protected:
  MoeDecoderModel(DecoderSpec spec, DType dtype, Device device, ModelPlacement placement);
  // Called once by the family's constructor: makes the embedding, final norm and head this
  // rank holds, and the layers it holds (make_layer(global id)), and indexes every parameter.
  void build(const std::function<std::unique_ptr<DecoderLayer>(int64_t id)>& make_layer);
  const DecoderSpec& spec() const { return spec_; }
  // What the layers compute their projections with (BF16 or FP8), shared by all.
  const Projections& projections() const { return projections_; }
  DecoderLayer& layer(int64_t id) const { return *layers_[local_layer(id)]; }

 private:
  // The local index of global layer `id` (an Error when this rank does not hold it).
  size_t local_layer(int64_t id) const;
  // The multi-token prediction module around layer `id`; nullptr for a main-model layer.
  MtpModule* mtp_of(int64_t id) const;
  // Where a pass through chunk `c` stops: a head chunk's modules run only when training
  // (what scores and validates is the main model's loss).
  int64_t run_end(const ChunkSpec& c, bool training) const {
    return c.head && training ? c.last_layer : std::min(c.last_layer, spec_.num_layers);
  }
  // What layer `id`'s weight gradients should do with their sum of squares (the hooks').
  ops::SumSquaresInto expert_squares(int64_t id, bool accumulate) const {
    return hooks_ && !accumulate ? hooks_->expert_grad_squares(id) : ops::SumSquaresInto{};
  }
  // A dense layer's "expert counts" (one expert taking all `tokens` rows) on the model's device.
  const Tensor& dense_counts(int64_t tokens) const { return dense_counts_.of(tokens, device_); }
  // The head's router losses from the micro-batch's totals (summed over the data group).
  void router_losses(RouterTotals& totals, MicroBatchLoss& out) const;
  // Chunk passes in pieces cut at the expert exchanges (decoder_model.cpp).
  struct ForwardCursor;
  struct BackwardCursor;
  ForwardCursor begin_forward(const ChunkSpec& c, const Batch& batch, const Tensor& x, ChunkActivations& a,
                              RouterTotals& totals, const ChunkPass& pass, MicroBatchLoss* loss);
  bool forward_piece(ForwardCursor& f, ExpertDispatcher& d);  // false when no layer is left
  // The final norm, the head and the cross-entropy (and with training their gradients).
  void main_head(ForwardCursor& f);
  // Tensor parallelism's head: this rank's vocabulary columns of every row's logits and the
  // vocabulary-parallel cross-entropy; returns d h (this rank's rows) when training.
  Tensor vocab_parallel_head(ForwardCursor& f, const Tensor& h);
  // A dense MLP layer's rows and its output under tensor parallelism: every token row
  // gathered for the column-parallel gate/up, the row-parallel down's partial sums
  // reduce-scattered back to this rank's rows (and the same the other way in the backward).
  // Without tensor parallelism, the rows themselves.
  Tensor dense_rows(const Tensor& mine) const { return tensor_ ? tensor_->gather_rows(mine) : mine; }
  // A dense layer's MLP over this rank's rows s.mlp_in (under tp every row, gathered and
  // reduce-scattered round the ring beside the GEMMs), and its input gradient from g.d_rows.
  Tensor dense_mlp_forward(const DecoderLayer& layer, LayerState& s, const BatchShape& b) const;
  Tensor dense_mlp_backward_input(const DecoderLayer& layer, LayerState& s, BackwardCursor& g) const;
  // A module's loss after its layer (its part of the step's mtp_loss term).
  void mtp_loss(ForwardCursor& f, MtpModule& m, MtpState& s);
  Tensor end_forward(ForwardCursor& f);
  BackwardCursor begin_backward(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ChunkActivations& a,
                                double aux_scale, bool weights_now, bool accumulate);
  bool backward_piece(BackwardCursor& g, ExpertDispatcher& d);
  // [training].recompute of layer `id` (multi-token prediction modules' layers none: the
  // module's input is made from the hidden state before it).
  RecomputeMode recompute_mode(int64_t id) const {
    return id < static_cast<int64_t>(recompute_.size()) ? recompute_[static_cast<size_t>(id)] : RecomputeMode::kNone;
  }
  void recompute_before_backward(const DecoderLayer& layer, BackwardCursor& g, ExpertDispatcher& d);
  Tensor end_backward(BackwardCursor& g);
  // A paired pass's step: pieces up to the next one that starts an exchange (false when the
  // pass has no layer left); see forward_backward_overlapped.
  bool forward_step(ForwardCursor& f, ExpertDispatcher& d);
  bool backward_step(BackwardCursor& g, ExpertDispatcher& d);

  DecoderSpec spec_;
  DType dtype_;
  Device device_;
  ModelPlacement placement_;
  Communicator* data_group_ = nullptr;
  ReplicaBridge* bridge_ = nullptr;
  WeightHooks* hooks_ = nullptr;
  int64_t expert_wgrad_group_ = 1;
  bool defer_expert_weights_ = false;  // during a forward_backward that defers them
  std::vector<RecomputeMode> recompute_;  // by layer id ([training].recompute)
  std::unique_ptr<ContextAttention> context_;  // [parallel].cp > 1
  std::unique_ptr<TensorParallel> tensor_;     // [parallel].tp > 1
  // A batch's shape for the layers (with the CP group's attention when it carries places).
  BatchShape shape_of(const Batch& batch) const;
  // The sequence-wise balance loss's whole sequences under context parallelism (none else).
  ops::SeqBalanceWhole whole_sequences(const Tensor& topk_idx, const BatchShape& b) const;
  bool router_entropy_ = true;         // measure each MoE layer's router entropy (set_detailed_telemetry)
  std::vector<ParamBucket> buckets_;
  Tensor embed_, final_norm_w_, lm_head_;  // lm_head_ aliases embed_ when tied
  Tensor g_embed_, g_final_norm_w_, g_lm_head_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;  // the layers held, ascending id
  std::vector<std::unique_ptr<MtpModule>> mtp_;         // the modules held (with the head), ascending depth
  ParameterList params_;
  RowCounts dense_counts_;
  Projections projections_;
};

}  // namespace moetrain
