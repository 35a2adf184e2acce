// The model contract (DESIGN.md section 3): what the trainer, the pipeline executor, FSDP,
// the optimizers, checkpoints, `score` and `bench` know of a model, whatever its family.
//
// A model is a for-loop over decoder layers between an optional embedding (first pipeline
// chunk) and an optional final norm + head (last chunk). Each decoder layer is cut into the
// five stages of the contract at the expert exchanges; the family implements stages 1, 3
// and 5 (DecoderLayer), the engine owns 2 and 4 (ExpertDispatcher). What every family
// shares (batch shapes, placement, chunk specs, router totals, loss terms, the pieces a chunk
// pass is cut into) lives here and in decoder_model.h, once; a family is its own
// models/<family>.{h,cpp} plus its config (docs/howto/add-a-model.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "engine/data/loader.h"
#include "engine/models/model_config.h"
#include "engine/parallel/expert_dispatch.h"
#include "engine/parallel/replica_bridge.h"
#include "engine/parameters.h"
#include "ops/ops.h"

namespace moetrain {

struct MtpState;  // models/mtp.h

// Shapes of the current micro-batch that every stage needs.
class ContextAttention;
class TensorParallel;
struct BatchShape {
  int64_t batch = 0, seq = 0;
  Tensor segment_ids;  // i32 [batch * seq]: attention within each packed document; undefined: causal
  // Context parallelism: the tokens' places in their sequences and the group's attention
  // (engine/parallel/context_attention.h); undefined / null: the rows are whole sequences.
  Tensor places;
  const ContextAttention* context = nullptr;
  // Tensor parallelism (engine/parallel/tensor_parallel.h): the layers' hidden state is this
  // rank's slice of the tokens (sequence parallelism); null: every row.
  const TensorParallel* tensor = nullptr;
  int64_t tokens() const { return batch * seq; }
  // The token rows of the hidden state between layers: tokens(), or this tp rank's slice.
  int64_t rows() const;
};

// What part of the model this process holds and how its weights are laid out.
struct ModelPlacement {
  // Expert parallelism: this rank holds experts [ep_rank * E/ep_size, (ep_rank+1) * E/ep_size)
  // of every MoE layer, under their global ids (names stay HF names). Under tensor
  // parallelism these are the folded expert ranks: ep_size = tp x ep.
  int64_t ep_size = 1, ep_rank = 0;
  // Each parameter bucket is padded to a multiple of this many elements, so the sharded
  // optimizer can cut it into equal shards (the size of the largest sharding group).
  int64_t bucket_pad = 1;
  // Pipeline parallelism: the decoder layers this rank holds (global ids, ascending; empty:
  // all), and whether it holds the embedding (first chunk) and the final norm + head (last).
  std::vector<int64_t> layers;
  bool embed = true, head = true;
  // Tensor parallelism: this rank holds piece tp_rank of tp_size of every split weight
  // (heads, MLP columns, vocabulary rows) and slice tp_rank of every micro-batch's tokens
  // between the split layers (sequence parallelism).
  int64_t tp_size = 1, tp_rank = 0;
  // Tensor parallelism without folding ([parallel].fold_experts = false): every tp rank holds
  // the same experts (whole copies, their gradients summed over tp).
  bool experts_over_tp = false;
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
// gradients. The pipeline carries them as the model's opaque message (Model::pack_totals).
struct RouterTotals {
  Tensor selections, prob_sum;  // [E], the router statistic dtype, on the model's device
  int64_t rows = 0;
  Tensor z_sum;                 // [1] sum over rows of logsumexp(logits)^2 (router z-loss), as selections
  // DeepSeek-V3's sequence-wise balance loss: sum over MoE layers and sequences of
  // sum_i f_i P_i ([1], as selections), and the micro-batch's sequences (every data rank's,
  // once reduced): the loss sums over layers, as each of DeepSeek's gates adds its own.
  Tensor seq_sum;
  int64_t seq_count = 0;
  Tensor pack() const;          // f64 [2E + 4] on the CPU
  static RouterTotals unpack(const Tensor& packed, int64_t num_experts, DType stat, Device device);
};

// How a chunk's forward runs.
struct ChunkPass {
  bool training = true;          // keep state for backward; the head computes its gradient
  double ce_scale = 1.0;         // head: d loss / d (sum of token cross-entropies)
  double aux_scale = 1.0;        // scale of the router losses (1 / micro-batches)
  bool head_accumulate = false;  // head: add to the head's weight gradients (else write)
  bool router_stats = true;      // add the router totals and expert counts (false: logits only)
  // Training with a pipeline's head helper: the head takes the loss of the first head_rows
  // token rows only and leaves the final norm's output of the others in
  // ChunkActivations::head_tail for the helper (whose gradient finish_head takes); -1: all.
  int64_t head_rows = -1;
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

// A loss term besides the cross-entropy (load balancing, z-loss, ...), already times its
// coefficient. The trainer, the executor and the metrics carry terms by name without
// knowing them. `global`: every data rank holds the whole batch's value (a loss of batch
// totals summed over the data group), so ranks must not add theirs up; otherwise the value
// is this rank's share and the step's term is the sum over the data ranks.
struct LossTerm {
  std::string name;
  double value = 0;
  bool global = false;
};
using LossTerms = std::vector<LossTerm>;
// Adds t.value / divisor into the term of the same name in `into` (appended when new).
void add_loss_term(LossTerms& into, const LossTerm& t, double divisor = 1.0);
// The sum of the terms' values (the metrics' aux_loss).
double total_of(const LossTerms& terms);
// The value of the term called `name` (0 when absent).
double term_value(const LossTerms& terms, const std::string& name);

// Loss terms of one micro-batch, as sums the trainer normalises.
//
// The model leaves what it computed on the device in `on_device` and fills the fields from
// it in read_device_values(), one host wait once the micro-batch's forward and backward are
// queued: the host never waits for the device inside a pass (a wait per layer would drain
// the launch queue, and with pipeline parallelism stall the other micro-batch's work).
struct MicroBatchLoss {
  double ce_sum = 0;      // sum of token cross-entropies
  int64_t targets = 0;    // tokens with a target
  LossTerms terms;        // the model's other loss terms (RouterTotals for Qwen3-MoE: aux, z)
  std::vector<std::vector<int64_t>> expert_counts;  // per MoE layer, tokens routed to each expert
  std::vector<double> router_entropy;  // per MoE layer, sum over the tokens of the router's entropy (nats)

  // A term still on the device: its value is value(host copies of inputs), once read.
  struct DeviceTerm {
    std::string name;
    bool global = false;
    std::vector<Tensor> inputs;
    std::function<double(const std::vector<Tensor>& host)> value;
  };
  struct OnDevice {
    Tensor ce_sum;                      // [1]
    std::vector<DeviceTerm> terms;
    std::vector<Tensor> expert_counts;  // per MoE layer, [local experts]
    std::vector<Tensor> router_entropy; // per MoE layer, [1]
  } on_device;
  // Moves what on_device holds into the fields above (adds nothing twice: on_device is emptied).
  void read_device_values();
  // The value of the term called `name` (0 when absent).
  double term(const std::string& name) const;
};

// Activation recomputation ([training].recompute, docs/memory.md).
enum class RecomputeMode { kNone, kSelective, kFull };

// What one decoder layer's stages leave at the expert-exchange boundaries: the engine's part
// of a layer's saved state (the cursors in decoder_model.cpp read and write these); a
// family's layer state derives from it and adds what its own math saves.
struct LayerState {
  virtual ~LayerState() = default;
  Tensor mlp_in;            // stage 1's output the experts take, [T, H]
  // FP8 experts (experts_read_fp8): mlp_in per 1 x 128 tile, quantized by its norm in the same
  // pass; handed to the dispatch (DispatchState::tokens_q), not kept. Undefined otherwise.
  ops::Fp8Tensor mlp_in_q;
  Tensor residual;          // stage 1's residual stream, which stage 5 adds the MLP's output to
  ops::RouterOut route;     // MoE layers: top-k experts and weights, router probabilities
  Tensor router_logits;
  ops::ZLossOut z;          // router z-loss terms (when its coefficient is set)
  DispatchState dispatch;   // stages 2-4 (MoE layers: the routing weights and the placed outputs too)
  DispatchOut expert_in;    // rows grouped by expert (dense layer: mlp_in, one group)
  Tensor mlp_out;           // dense layers: the MLP's output [T, H]
  std::shared_ptr<MtpState> mtp;  // a multi-token prediction module's layer: the module's part
  // Recomputation ([training].recompute): the layer's input, all a dropped state keeps; the
  // backward redoes the forward from it.
  Tensor recompute_input;
  // Selective recomputation: the family's cheap tensors were dropped (made again before the
  // backward), and the expert input rows too where they are a local permutation of mlp_in.
  bool selective_dropped = false, rows_dropped = false;
};

// Rows [first, first + n) of a dense layer's MLP rows, counts: {n} (one group) on their
// device. n < 0: every row.
struct RowPart {
  int64_t first = 0, n = -1;
  Tensor counts;
  bool whole() const { return n < 0; }
  Tensor of(const Tensor& rows) const { return whole() ? rows : rows.slice(first, first + n); }
};

// One decoder layer of a family: its weights and the math of stages 1, 3 and 5, forward and
// backward (backward_input now, backward_weight deferrable), per DESIGN.md section 3.
class DecoderLayer {
 public:
  virtual ~DecoderLayer() = default;
  virtual int64_t layer_id() const = 0;
  virtual bool is_moe() const = 0;
  // A fresh state of this family's kind for one micro-batch's pass.
  virtual std::unique_ptr<LayerState> new_state() const = 0;
  // The layer's flat weight buffers until the model takes them over.
  virtual std::vector<ParamBucket>& buckets() = 0;
  // This layer's parameters under canonical names (experts as per-expert views).
  virtual void collect_parameters(ParameterList& out) = 0;

  // Stage 1: fills s.mlp_in, s.residual and, for an MoE layer, s.route (and s.router_logits).
  virtual void attn_forward(const Tensor& x, const Tensor& positions, const BatchShape& b, LayerState& s) const = 0;
  // Stage 3: the MLP over s.expert_in (grouped by expert); returns its output rows. With a
  // part (a dense layer under tensor parallelism, made slice by slice as the slices come
  // round: TensorParallel::gather_map_reduce_rows), only those rows of s.expert_in.rows,
  // which hold them by then; what the backward reads is kept for every row.
  virtual Tensor mlp_forward(LayerState& s, const RowPart& part = {}) const = 0;
  // Whether stage 3 reads the routed experts' rows in FP8, per 1 x 128 tile: a dispatcher
  // that can then hands them over quantized (DispatchState::fp8_rows).
  virtual bool experts_read_fp8() const { return false; }
  // Stage 5 is residual + MLP output: for an MoE layer the dispatcher's weighted combine adds
  // into s.residual (ExpertDispatcher::combine_finish), for a dense one the engine adds
  // s.mlp_out; d residual is the layer output's gradient either way. No family code.
  // Backward of stage 3: d rows out -> d expert_in rows (with a part: those rows' of d_rows_out,
  // the whole tensor kept for the weight gradients, complete by then).
  virtual Tensor mlp_backward_input(const Tensor& d_rows_out, LayerState& s, const RowPart& part = {}) const = 0;
  // Backward of stage 1: given d h (residual), d mlp_in (taken over), d topk_weight and the
  // router's extra d probs / d logits (aux losses, may be undefined), returns d x.
  virtual Tensor attn_backward_input(const Tensor& dy_residual, Tensor d_mlp_in, const Tensor& d_topk_weight,
                                     const Tensor& d_probs_extra, const Tensor& d_logits_extra,
                                     const Tensor& positions, const BatchShape& b, LayerState& s) const = 0;
  // Every weight gradient of the layer from what backward_input saved; added, or written
  // over when !accumulate. squares: see WeightHooks::expert_grad_squares. defer_experts
  // (MoE layers): keep the experts' weight-gradient inputs and make them in one pass with
  // those of the next micro-batches, up to the first call that does not defer.
  virtual void backward_weight(LayerState& s, bool accumulate, ops::SumSquaresInto squares,
                               bool defer_experts) = 0;
  // Forgets deferred micro-batches' expert inputs (a step abandoned half-way).
  virtual void drop_deferred_expert_weights() = 0;
  // Whether backward_weight(accumulate, defer_experts) writes the experts' weight gradients
  // (rather than adds to them or defers them): then it can pass on their sum of squares.
  virtual bool writes_expert_grads(bool accumulate, bool defer_experts) const = 0;
  // The plain path used to validate every layout (no dispatcher); returns the layer output.
  virtual Tensor reference_forward(const Tensor& x, const Tensor& positions, const BatchShape& b) const = 0;
  // Selective recomputation: at the end of a training forward, drop what is cheap to make
  // again from what stays (norm outputs, rotary outputs: no GEMM, no exchange); just before
  // the backward, make it again with the same kernels (the same bits). Defaults: nothing.
  virtual void drop_recomputable(LayerState& s) const { (void)s; }
  virtual void recompute_dropped(LayerState& s, const Tensor& positions) const {
    (void)s;
    (void)positions;
  }
  // The router's selection bias (f32 [num_experts], every expert's, on the layer's device),
  // which aux-loss-free balancing moves after each step; nullptr when the layer has none.
  virtual Tensor* routing_bias() { return nullptr; }
};

// What one micro-batch's pass through a chunk keeps for its backward.
struct ChunkActivations {
  std::vector<std::unique_ptr<LayerState>> layers;  // the chunk's decoder layers, in order
  Tensor final_in;                                  // head: the final norm's input, its output, and
  ops::RmsNormOut final_norm;                       //   the loss gradient at the chunk output,
  Tensor d_out;                                     //   computed with the loss in the forward
  Tensor d_embed_out;                               // embed: gradient at the embedding output (for W)
  Tensor head_tail;    // head with a helper: the final norm's output of the helper's rows
  Tensor d_norm;       //   and the final norm's output gradient, its first head_rows rows made
  RouterTotals totals;                              // the micro-batch's final totals (for backward)
  // Per MoE layer of the chunk, tokens routed to each of this rank's experts (i64, on the
  // model's device: read once the pass is queued, see MicroBatchLoss::read_device_values).
  std::vector<Tensor> expert_counts;
  std::vector<Tensor> router_entropy;  // per MoE layer, [1]: sum over the tokens (telemetry)
};

// A non-gradient tensor of the model's state (e.g. a routing bias), checkpointed by name
// with the weights and sent whole to a recovering replica.
struct NamedBuffer {
  std::string name;
  Tensor value;
};

// The engine's view of a model of any family.
class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& model_config() const = 0;
  virtual const ModelPlacement& placement() const = 0;
  virtual DType dtype() const = 0;
  virtual Device device() const = 0;
  virtual ParameterList& parameters() = 0;
  // Every parameter lies in exactly one bucket (members indexed into parameters()).
  virtual std::vector<ParamBucket>& buckets() = 0;
  // Non-gradient state by canonical name (the routers' selection biases, where balanced
  // without an auxiliary loss).
  virtual std::vector<NamedBuffer> buffers() { return {}; }
  // After a committed optimizer step: aux-loss-free balancing moves each routing bias by
  // the step's expert loads (tokens per expert of the MoE layers this rank holds, in order,
  // summed over the step and every data rank, so that all ranks move it alike). Nothing
  // when the model has no routing bias.
  virtual void balance_experts(const std::vector<std::vector<int64_t>>& expert_counts) { (void)expert_counts; }
  // Whether passes also measure what only telemetry reads (the router entropy; [metrics].detailed).
  virtual void set_detailed_telemetry(bool on) { (void)on; }
  // [training].fp8: the layers' projections in block-scaled FP8 (docs/fp8.md).
  virtual void set_fp8(bool on) { (void)on; }
  // Under FP8: true while the weights neither change nor move (one step's micro-batches with
  // whole weights), so each is quantized at its first use and reused; false frees the copies
  // (engine/models/projections.h).
  virtual void keep_quantized_weights(bool on) { (void)on; }
  // [training].recompute: these decoder layers (ids), in a training pass, keep only their
  // input and redo their forward just before their backward (kFull), or drop what is cheap to
  // make again and make it then (kSelective: DecoderLayer::drop_recomputable).
  // Context parallelism: the group that splits every sequence (nullptr: none); batches that
  // carry places then attend over it.
  virtual void set_context_group(Communicator* group) { (void)group; }
  // Tensor parallelism: the tp group whose ranks hold the pieces of the split weights and the
  // slices of the tokens (nullptr: none). Built with the placement's tp_size / tp_rank.
  virtual void set_tensor_group(Communicator* group) { (void)group; }
  virtual void set_recompute(const std::vector<int64_t>& layers, RecomputeMode mode) {
    (void)layers;
    (void)mode;
  }
  // Data parallelism: the ranks of this replica group that hold different tokens of one
  // global batch, and the bridge to the other replica groups; losses of batch totals are
  // summed over both (nullptr: one process, one replica group).
  virtual void set_data_group(Communicator* group, ReplicaBridge* bridge = nullptr) = 0;
  // nullptr: every weight is always whole (one process, or weights replicated).
  virtual void set_weight_hooks(WeightHooks* hooks) = 0;
  virtual WeightHooks* weight_hooks() const = 0;
  // Draws every parameter from the stream keyed by (seed, canonical name).
  void init_weights(uint64_t seed) { init_parameters(parameters(), seed); }

  // Forward and backward of one micro-batch. Gradients ACCUMULATE into the parameters'
  // grads, or, with accumulate_grads false (a step's first micro-batch), overwrite them. The
  // cross-entropy sum is scaled by ce_scale (1 / targets of the whole step) and the other
  // loss terms by aux_scale (1 / micro-batches). defer_expert_weights: see DecoderLayer.
  virtual MicroBatchLoss forward_backward(const Batch& batch, ExpertDispatcher& dispatcher, double ce_scale,
                                          double aux_scale, bool accumulate_grads = true,
                                          bool defer_expert_weights = false) = 0;
  // How many micro-batches the trainer groups for one pass of the experts' weight gradients
  // (the run config's [training].expert_wgrad_group; 1: none).
  virtual int64_t expert_wgrad_group() const = 0;
  virtual void set_expert_wgrad_group(int64_t n) = 0;
  // Forgets every layer's deferred expert weight-gradient inputs (a step abandoned half-way).
  virtual void drop_deferred_expert_weights() = 0;
  // Forward only: loss terms without touching gradients.
  virtual MicroBatchLoss forward_loss(const Batch& batch, ExpertDispatcher& dispatcher) = 0;
  // Logits [T, V] for ids/positions, through the staged path.
  virtual Tensor forward_logits(const Tensor& ids, const Tensor& positions, const BatchShape& b,
                                ExpertDispatcher& dispatcher) = 0;
  // Logits through each layer's reference_forward (no dispatcher, no saved state).
  virtual Tensor reference_forward(const Tensor& ids, const Tensor& positions, const BatchShape& b) const = 0;

  // ---- pipeline pieces: a chunk's F, B (input gradient) and W (weight gradient) ----
  virtual ChunkSpec whole() const = 0;  // the chunk of everything this rank holds
  // A head chunk's forward run with ChunkPass::head_rows: the helper's rows' gradient of the
  // final norm's output (d_tail) completes a.d_norm, and the final norm's backward makes
  // a.d_out (and the norm's weight gradient: written, or added per `accumulate`).
  virtual void finish_head(ChunkActivations& a, const Tensor& d_tail, bool accumulate) {
    (void)a, (void)d_tail, (void)accumulate;
    MT_THROW("this model has no pipeline head helper");
  }
  // The head's weight [V, H] and its gradient (the embedding's when tied), on a rank that
  // holds the head: what a head helper copies and adds to.
  virtual Tensor head_weight() { MT_THROW("this model has no pipeline head helper"); }
  virtual Tensor head_weight_grad() { MT_THROW("this model has no pipeline head helper"); }
  virtual RouterTotals new_totals() const = 0;
  // The totals as the f64 message pipeline ranks exchange, its length, and back.
  virtual int64_t totals_message_size() const = 0;
  virtual Tensor pack_totals(const RouterTotals& t) const = 0;
  virtual RouterTotals unpack_totals(const Tensor& packed) const = 0;
  virtual Tensor forward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& x, ExpertDispatcher& d,
                               ChunkActivations& a, RouterTotals& totals, const ChunkPass& pass,
                               MicroBatchLoss* loss) = 0;
  virtual Tensor backward_chunk(const ChunkSpec& c, const Batch& batch, const Tensor& dy, ExpertDispatcher& d,
                                ChunkActivations& a, double aux_scale, bool weights_now, bool accumulate) = 0;
  // defer_experts: the MoE layers keep their experts' weight-gradient inputs for a later
  // call's one pass (ExpertWeightGrads; the expert_wgrad_group of a pipeline's W steps).
  virtual void backward_chunk_weight(const ChunkSpec& c, const Batch& batch, ChunkActivations& a, bool accumulate,
                                     bool defer_experts = false) = 0;
  virtual std::pair<Tensor, Tensor> forward_backward_overlapped(const ChunkSpec& fc, const Batch& fbatch,
                                                                const Tensor& x, ChunkActivations& fa,
                                                                RouterTotals& totals, const ChunkPass& pass,
                                                                MicroBatchLoss* loss, const ChunkSpec& bc,
                                                                const Batch& bbatch, const Tensor& dy,
                                                                ChunkActivations& ba, ExpertDispatcher& d) = 0;
  // Two forwards (of different micro-batches), and two input gradients, interleaved the same
  // way: {first's output, second's output}. At most one of the forwards holds the head.
  virtual std::pair<Tensor, Tensor> forwards_overlapped(const ChunkSpec& c1, const Batch& b1, const Tensor& x1,
                                                        ChunkActivations& a1, RouterTotals& t1, MicroBatchLoss* loss1,
                                                        const ChunkSpec& c2, const Batch& b2, const Tensor& x2,
                                                        ChunkActivations& a2, RouterTotals& t2, MicroBatchLoss* loss2,
                                                        const ChunkPass& pass, ExpertDispatcher& d) = 0;
  virtual std::pair<Tensor, Tensor> backwards_overlapped(const ChunkSpec& c1, const Batch& b1, const Tensor& dy1,
                                                         ChunkActivations& a1, const ChunkSpec& c2, const Batch& b2,
                                                         const Tensor& dy2, ChunkActivations& a2, double aux_scale,
                                                         ExpertDispatcher& d) = 0;

  // The loss terms this model reports besides the cross-entropy, zero-valued, in the one
  // order every rank uses to sum them (whether or not it holds the head).
  virtual LossTerms loss_terms() const = 0;

  // Training FLOPs per token of the whole model (whatever part this rank holds).
  virtual double flops_per_token(int64_t seq) const = 0;
  virtual int64_t active_matmul_params() const = 0;
};

// The model of `cfg`'s family (models/factory.cpp): this rank's part, weights uninitialised.
std::unique_ptr<Model> build_model(const ModelConfig& cfg, DType dtype, Device device, ModelPlacement placement);

}  // namespace moetrain
