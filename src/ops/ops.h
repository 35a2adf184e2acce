// The numeric operators of moetrain, forward and backward, on Tensors.
//
// Each op runs where its inputs live: CPU tensors go to the reference in ops/cpu/, CUDA
// tensors to ops/cuda/. On the CPU, floating tensors are f32 (training) or f64 (gradient
// checks) and all floating inputs of one call share that dtype; index tensors are i32 and
// per-expert counts i64.
//
// On CUDA (mixed precision): activations, their gradients and weights are bf16, with f32
// accumulation inside every kernel; saved statistics (rmsnorm rstd, attention and
// cross-entropy lse), router probabilities and top-k weights, loss sums and load-balancing
// tallies are f32; weight gradients (dw, accumulated +=) are f32; AdamW state is f32. No
// op waits for the host: counts stay on the device.
//
// Layout: activations are token-major, [T, features] with T = batch * seq. Linear weights
// follow Hugging Face: [out_features, in_features]. Weight gradients ACCUMULATE (+=) into
// the tensor given, so micro-batches and deferred weight-grad steps add up without copies.
// Backward is split in two where a layer has weights: *_backward_input (dgrad) and
// *_backward_weight (wgrad), which a pipeline schedule may run later.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moetrain::ops {

// ---- determinism ------------------------------------------------------------------------
// By default every op is bitwise repeatable: no float atomics, reductions in a fixed order.
// set_deterministic(false) lets the ops that have a faster order-free form take it; today
// that is the CUDA attention backward on Hopper (one pass: dQ added up across key tiles with
// f32 atomic adds instead of a second pass that recomputes the scores). Process-wide, set
// once at start-up from `[training].deterministic`; the CPU ops are unaffected.
void set_deterministic(bool on);
bool deterministic();

// A rank's columns (logits) or rows (embedding) of a vocabulary split across ranks: from id
// `begin` on, of a whole vocabulary of `size` ids (the embedding ops take {0, 0} as the
// weight's own rows being the whole vocabulary).
struct VocabShard {
  int64_t begin = 0, size = 0;  // size: the whole vocabulary's
};

// ---- FP8 (e4m3) with block scales: DeepSeek-V3's recipe (issue 30) -------------------
// x ~= q * scale blockwise. Rows (activations and their gradients): one scale per 1 x 128
// tile along a row (the reduction dimension), stored [ceil(C/128), R], the rows contiguous
// (cuBLASLt's VEC128_32F layout). Blocks (weights): one scale per 128 x 128 block, stored
// [ceil(R/128), round_up(ceil(C/128), 4)], the columns' blocks contiguous and each row
// padded to a multiple of 4 with 1s (cuBLASLt's BLK128x128_32F layout). A tile's scale is
// amax / 448 (1 for an all-zero tile) and q = e4m3(x / scale) rounded to nearest even
// (f8e4m3 in core/dtype.h): the same bits on every backend.
enum class Fp8Blocks { kRows, kBlocks };
struct Fp8Tensor {
  Tensor q;      // f8e4m3 [R, C]
  Tensor scale;  // f32, laid out as above
  Fp8Blocks blocks = Fp8Blocks::kRows;
};
// Rows-mode codes with their values (q * scale in some dtype), made in one pass where an op
// hands over both (permute_forward_fp8_values, unpack_fp8_rows).
struct UnpackedFp8Rows {
  Fp8Tensor q;
  Tensor values;
};
// A weight's 128 x 128 blocks both ways (quantize_fp8_weight): w_t holds W^T's (each
// expert's, for experts' weights), the input gradient's operand.
struct Fp8WeightBlocks {
  Fp8Tensor w, w_t;
};
// x per 1 x 128 tile both ways (quantize_fp8_both_ways): along the features (rows, [R, C])
// and along the tokens (tokens: x^T's rows, [C, R]).
struct Fp8BothWays {
  Fp8Tensor rows, tokens;
};

// ---- embedding: y[t] = W[ids[t]] ------------------------------------------------------
// ids i32 [T], weight [V, H] -> [T, H]. An id outside [0, V) is an error naming it (NaN rows
// on the GPU). With a shard (a vocabulary-parallel embedding), weight holds rows
// [shard.begin, shard.begin + V) of a vocabulary of shard.size: an id among the other rows
// gives a zero row (the sum over the shards' outputs is the whole lookup), and its gradient
// goes nowhere.
Tensor embedding_forward(const Tensor& ids, const Tensor& weight, const VocabShard& shard = {});
// dweight[ids[t]] += dy[t]
//
// Every weight-gradient op takes `accumulate`: true adds into the gradient (micro-batches
// after the first), false overwrites it, so a step's first micro-batch needs no zeroed
// gradients (for the expert weights that saves a 4-byte read and a 4-byte memset per
// parameter). Overwrite writes every element, including the weights of an expert that got
// no rows (zeros).
void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight, bool accumulate = true,
                               const VocabShard& shard = {});
// Token ids k places ahead, within each row of a [batch, seq] batch (multi-token
// prediction's inputs and targets): out[b, i] = ids[b, i + k] where i + k < seq and, with
// segment_ids given (packed documents; may be undefined), i + k lies in i's document;
// `fill` elsewhere. ids and segment_ids i32 [batch * seq]; k >= 0.
Tensor shift_tokens(const Tensor& ids, const Tensor& segment_ids, int64_t batch, int64_t k, int32_t fill);

// ---- linear: y = x W^T ----------------------------------------------------------------
// x [T, in], w [out, in] -> [T, out]. With residual [T, out] given: y = residual + x W^T
// in the GEMM's epilogue (C = residual, beta = 1), so the residual add costs no pass.
Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& residual = Tensor());
// y = x W^T in f32 whatever the operands' float dtype: on the GPU a bf16 GEMM with an f32
// output (bf16 products are exact in f32, so it is the f32 GEMM of those values, at tensor-
// core speed), as HF's routers that compute their logits in f32 (DeepSeek-V3's). The CPU's
// is linear_forward (f32 or f64 models).
Tensor linear_forward_f32_out(const Tensor& x, const Tensor& w);
// dx = dy W            dy [T, out] -> [T, in]
Tensor linear_backward_input(const Tensor& dy, const Tensor& w);
// dx += dy W (beta = 1): sums the input gradients of projections that share an input.
void linear_backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx);
// dw += dy^T x  (dw = dy^T x when !accumulate)
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate = true);

// ---- RMSNorm over the last D = w.numel() elements -------------------------------------
// x is read as [R, D] rows (so [T, heads*hd] with w [hd] is Qwen3's per-head q/k norm).
// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps), saved as [R] in x's dtype.
struct RmsNormOut {
  Tensor y;
  Tensor rstd;
  Fp8Tensor y_q;  // rmsnorm_forward_fp8 only
};
RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps);
// The same, and y quantized per 1 x 128 tile (rows mode) in the same pass, bitwise
// quantize_fp8(y, kRows): the input of FP8 products (the attention projections, the experts'
// dispatch) without a quantizer's pass over y. D must be a multiple of 128.
RmsNormOut rmsnorm_forward_fp8(const Tensor& x, const Tensor& w, double eps);
// dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)) (+ residual: a gradient reaching x by
// another path, added before dx is rounded, so no separate add reads and writes it again)
Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& residual = Tensor());
// dw += sum_rows dy * x * rstd
void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw,
                             bool accumulate = true);

// ---- RoPE ------------------------------------------------------------------------------
// x [T, heads * stride]; positions i32 [T]. In each head of `stride` values the last
// head_dim are rotary (the others are copied through): pair i of them turns by
// angle = pos * inv_freq[i], (a, b) -> scale * (a cos - b sin, b cos + a sin).
//   rotate-half (HF Llama/Qwen): pair i is (i, i + head_dim/2);
//   interleaved (DeepSeek-V3's rope_interleave): pair i is (2i, 2i+1). HF instead permutes
//   the rotary dims to (evens, odds) and rotates halves; its q and k are this op's under the
//   same permutation, so the attention scores are the same.
struct RopeSpec {
  int64_t head_dim = 0;          // rotary dims per head (even)
  double theta = 10000;          // inv_freq[i] = theta^(-2i/head_dim) when inv_freq is empty
  std::vector<double> inv_freq;  // head_dim/2 given frequencies (YaRN's), or empty
  double scale = 1;              // cos and sin times this (YaRN's attention factor)
  bool interleaved = false;
  int64_t stride = 0;            // a head's width in x (>= head_dim); 0: head_dim
  int64_t head_stride() const { return stride > 0 ? stride : head_dim; }
};
Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& r);
// The transposed map (the inverse rotation, times scale) applied to dy.
Tensor rope_backward(const Tensor& dy, const Tensor& positions, const RopeSpec& r);
// Qwen3's plain rotate-half rope of whole heads.
inline Tensor rope_forward(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta) {
  return rope_forward(x, positions, RopeSpec{head_dim, theta});
}
inline Tensor rope_backward(const Tensor& dy, const Tensor& positions, int64_t head_dim, double theta) {
  return rope_backward(dy, positions, RopeSpec{head_dim, theta});
}

// ---- DeepSeek-V3's multi-head latent attention: the heads' keys and values ------------
// kv [T, H*(nope+dv)] (kv_b_proj's output: per head its nope key dims, then its value) and
// k_rot [T, rope] (the rotated key dims every head shares) ->
//   k [T, H*(nope+rope)] (per head: its nope dims, then k_rot), v [T, H*dv].
struct MlaKv {
  Tensor k, v;
};
MlaKv mla_kv_forward(const Tensor& kv, const Tensor& k_rot, int64_t heads, int64_t nope, int64_t v_dim);
// dkv [T, H*(nope+dv)] as kv, and dk_rot [T, rope] = the sum over the heads of dk's rotary
// dims (f32 sums, rounded once to dk's dtype).
struct MlaKvGrads {
  Tensor dkv, dk_rot;
};
MlaKvGrads mla_kv_backward(const Tensor& dk, const Tensor& dv, int64_t heads, int64_t nope, int64_t v_dim);

// ---- Qwen3's per-head q/k norm, then RoPE, as one op -----------------------------------
// y = rope_forward(rmsnorm_forward(x, w, eps).y, positions, head_dim, theta) with
// w [head_dim] (x [T, heads * head_dim]); rstd [T * heads] as rmsnorm_forward's. On the GPU
// for head_dim 128 one pass: the normalised value is rotated in f32 and rounded once (the
// two ops in turn round it in between), and the backward forms dx and dw from dy without
// writing rope_backward(dy). Elsewhere the ops in turn.
RmsNormOut rmsnorm_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& positions,
                                int64_t head_dim, double theta);
// dx (as x) and dw = sum_rows rope_backward(dy) * x * rstd ([head_dim]; f32 for a bf16 x,
// else x's dtype): the gradient of this call alone, for the caller to add or store.
struct RmsNormRopeGrads {
  Tensor dx, dw;
};
RmsNormRopeGrads rmsnorm_rope_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       const Tensor& positions, int64_t head_dim, double theta);

// ---- causal grouped-query attention ---------------------------------------------------
// q [B*S, Hq*D], k [B*S, Hkv*D], v [B*S, Hkv*Dv] (Dv: below), token-major; query head h
// reads kv head h / (Hq/Hkv). Query s attends to keys j <= s of the same sequence and, when
// segment_ids (i32 [B*S]) is defined, of the same segment (packed documents).
struct AttentionShape {
  int64_t batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  double scale = 0;  // softmax scale, usually 1/sqrt(head_dim)
  // The value heads' size Dv when it differs from the query/key heads' (DeepSeek-V3's MLA:
  // 192 and 128); 0: head_dim. v and dv are then [B*S, Hkv*Dv], out and dout [B*S, Hq*Dv].
  // The CPU reference takes any; the CUDA kernels take head_dim 32, 64 or 128 with Dv ==
  // head_dim, and (192, 128) (an error names the pair and those supported).
  int64_t v_head_dim = 0;
  int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};
struct AttentionOut {
  Tensor out;  // [B*S, Hq*Dv]
  Tensor lse;  // [B, Hq, S] log-sum-exp of each score row, saved for backward
};
AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids,
                               const AttentionShape& shape);
// dq has q's dtype, except after the GPU's one-pass backward (ops::deterministic() false,
// the Hopper kernels): f32, the sums as the kernel left them, for the next op to read.
struct AttentionGrads {
  Tensor dq, dk, dv;
};
// P = exp(scale*QK^T - lse); dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(dO*O));
// dQ = scale * dS K; dK = scale * dS^T Q (summed over the query heads sharing a kv head).
AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& segment_ids, const Tensor& out, const Tensor& lse,
                                  const AttentionShape& shape);

// ---- attention between parts of the sequences (context parallelism's ring) -----------
// q [B*S, Hq*D] and k, v [B*S, ...] hold B sequences of S rows each (S = shape.seq), the keys
// maybe another rank's. Queries in rows [q_begin, q_end) of every sequence attend to the keys
// in rows [k_begin, k_end). causal: key row j is seen by query row i only when j <= i (then q
// and k are rows of the same places and the two ranges are one). q_segments and k_segments
// (i32 [B*S], both or neither): each row's document; a query sees only keys of its own.
// out [B*S, Hq*Dv] and lse [B, Hq, S] cover every row: a query row outside the part, or one
// that sees none of the part's keys, gets out 0 and lse -inf. attention_merge folds a part's
// result into the running one (the softmax over the keys of both); acc.out may be f32 where
// the part's out is bf16 (the running sum kept unrounded). attention_part_backward gives the
// part's gradients from the merged out and lse: dq rows outside the query range and dk, dv
// rows outside the key range are zero. On the GPU with the fused kernels (the head sizes
// attention_forward takes); the CPU reference takes any.
struct AttentionPart {
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  bool causal = false;
  Tensor q_segments, k_segments;
};
AttentionOut attention_part_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part,
                                    const AttentionShape& shape);
void attention_merge(AttentionOut& acc, const AttentionOut& part);
AttentionGrads attention_part_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionPart& part, const Tensor& out, const Tensor& lse,
                                       const AttentionShape& shape);

// ---- router: softmax -> top-k -> optional renormalisation -----------------------------
// logits [T, E] -> probs [T, E] = softmax(logits); topk_idx i32 [T, K] (descending prob,
// ties to the lower expert id); topk_weight [T, K] = probs at topk_idx, divided by their
// sum when norm_topk_prob.
// selection_bias (f32 [E], optional: DeepSeek-V3's aux-loss-free balancing) steers only the
// choice: the K experts of largest probs + bias are taken (ties to the lower id), and their
// weights are still their probs. The backward does not change (the choice is a constant).
struct RouterOut {
  Tensor probs, topk_idx, topk_weight;
};
RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob,
                         const Tensor& selection_bias = Tensor());
// dlogits from d(topk_weight) [T, K] and, if defined, an extra d(probs) [T, E] (from the
// load-balancing loss); both flow through the softmax.
Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                       bool norm_topk_prob);

// ---- router, DeepSeek-V3: sigmoid scores -> group-limited top-k ------------------------
// Per row of logits [T, E] (HF DeepseekV3's gate, transformers 5.x):
//   s = sigmoid(l)                          (probs holds s)
//   c = s + bias                            (e_score_correction_bias [E] f32; undefined: 0)
//   the E experts form n_group groups of E / n_group (>= 2); a group's score is the sum of
//   its two largest c; the topk_group best groups stay (ties to the lower group) and every
//   other expert's c becomes 0 (HF masks with 0, not -inf);
//   idx = the K experts of largest c, descending, ties to the lower id;
//   w[k] = scaling * s[idx_k]               or, with norm_topk_prob,
//   w[k] = scaling * s[idx_k] / (sum_j s[idx_j] + 1e-20).
// n_group = topk_group = 1: a plain top-k of c. The bias steers the choice only: the
// weights are the unbiased scores.
RouterOut router_sigmoid_forward(const Tensor& logits, const Tensor& bias, int64_t k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk_prob, double scaling);
// dlogits from d(topk_weight) [T, K] and, if defined, an extra d(probs) [T, E] (DeepSeek's
// sequence-wise auxiliary loss), through the weights and the sigmoid; the choice (and the
// bias, which only moves it) gets no gradient.
Tensor router_sigmoid_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                               bool norm_topk_prob, double scaling);

// ---- token permutation by expert ------------------------------------------------------
// The T*K (token, slot) pairs sorted stably by expert: rows of expert 0 first, and within
// an expert in (t, k) order.
//
// A partial permutation keeps only its first `rows` permuted rows: the pairs of the experts
// that matter here (sorted first, see expert_ids_in_range), the others absent. Their
// slot_row is >= rows; the ops below skip them (permute_backward and the combine leave them
// out of the sums, unpermute_forward gives them zero rows, unpermute_backward drops them).
struct Permutation {
  Tensor expert_counts;  // i64 [E]
  Tensor source_token;   // i32 [T*K]: the token feeding permuted row r
  Tensor slot_row;       // i32 [T*K]: for pair t*K+k, its row in permuted order
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  int64_t rows = -1;  // permuted rows kept; -1: all T*K
  int64_t permuted_rows() const { return rows < 0 ? num_tokens * top_k : rows; }
};
Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts);
// topk_idx i32 [T, K] -> i32 [T, K]: ids in [first, first + count) become id - first, every
// other id becomes `count` (one group past the last: sorted after the range by
// permutation_by_expert(.., count + 1), so a partial permutation keeps the range's rows).
Tensor expert_ids_in_range(const Tensor& topk_idx, int64_t first, int64_t count);
// x [T, H] -> [R, H] (R = permuted_rows()), row r = x[source_token[r]]
Tensor permute_forward(const Tensor& x, const Permutation& p);
// The same for tokens quantized per 1 x 128 tile (rows mode, x.q [T, H]): the codes' rows
// and the scales' columns ([ceil(H/128), T] -> [ceil(H/128), R]) follow the rows, so the
// result is bitwise quantize_fp8(permute_forward(x), kRows) at the cost of a gather of bytes
// instead of a pass over K times the rows (the FP8 experts' input, DispatchOut::rows_q).
Fp8Tensor permute_forward_fp8(const Fp8Tensor& x, const Permutation& p);
// The same and the rows' values (code x scale as `dtype`, dequantize_fp8's) in one pass: the
// rows an FP8 experts' local dispatch hands over (DispatchOut::rows and rows_q).
UnpackedFp8Rows permute_forward_fp8_values(const Fp8Tensor& x, const Permutation& p, DType dtype);
// [R, H] -> dx [T, H], dx[t] = sum of the rows that copied token t
Tensor permute_backward(const Tensor& dxp, const Permutation& p);
// expert-ordered [R, H] -> (t, k)-ordered [T*K, H]; row t*K+k = yp[slot_row[t*K+k]] (zero
// for absent pairs)
Tensor unpermute_forward(const Tensor& yp, const Permutation& p);
// the inverse, (t, k)-ordered gradients [T*K, H] -> expert order [R, H]
Tensor unpermute_backward(const Tensor& dy, const Permutation& p);

// ---- rows by index ----------------------------------------------------------------------
// x [R, ...] of any dtype, index i32 [N] -> [N, ...]: row i is x[index[i]] where 0 <=
// index[i] < R, zeros where the index is outside (a scatter into zeros is the gather of
// the inverse map with the absent rows pointed outside). Exact copies.
Tensor take_rows(const Tensor& x, const Tensor& index);

// ---- weighted combine: y[t] = residual[t] + sum_k w[t,k] * e[row(t, k)] ---------------
// expert_out [T*K, H], weight [T, K], residual [T, H] or undefined. row(t, k) = t*K + k, or
// with `order` (i32 [T*K], a permutation: Permutation::slot_row) order[t*K + k]: the expert
// outputs stay in expert order and the combine reads them there, with no unpermute copy.
// With an order, expert_out may hold fewer rows R (a partial permutation's): slots whose
// row is >= R are absent, left out of the sum, their dweight 0.
Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual,
                       const Tensor& order = Tensor());
struct CombineGrads {
  Tensor dexpert_out;  // expert_out's shape, row(t, k) = w[t,k] * dy[t] (expert_out's layout)
  Tensor dweight;      // [T, K]   = <dy[t], e[row(t, k)]>
  Fp8Tensor dexpert_out_q;  // quantize_rows: quantize_fp8(dexpert_out, kRows), bit for bit
};
// d(residual) is dy itself. quantize_rows: also dexpert_out's e4m3 codes per 1 x 128 tile,
// made by the kernel that writes dexpert_out where it can (bf16, H % 128 == 0: the FP8
// experts' input gradient reads them, with no pass of its own over the rows).
CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight,
                              const Tensor& order = Tensor(), bool quantize_rows = false);

// ---- grouped expert SwiGLU ------------------------------------------------------------
// x [N, H] holds counts[e] consecutive rows per expert e (counts i64 [E], sum N).
// For expert e: g = x W_gate[e]^T, u = x W_up[e]^T, a = silu(g) * u, y = a W_down[e]^T.
// w_gate, w_up [E, I, H]; w_down [E, H, I]. A dense MLP is E = 1.
struct SwigluOut {
  Tensor y;         // [N, H]
  Tensor gate, up;  // [N, I] pre-activations, saved for backward
  Tensor act;       // [N, I] silu(gate) * up as y used it (GPU: from the f32 accumulators)
  Fp8Tensor act_q;  // grouped_swiglu_forward_fp8: act per 1 x 128 tile, as the down GEMM read it
};
SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate,
                                 const Tensor& w_up, const Tensor& w_down);
struct SwigluInputGrads {
  Tensor dx;          // [N, H]
  Tensor dgate, dup;  // [N, I], kept for the weight gradients
};
SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate,
                                               const Tensor& up, const Tensor& w_gate, const Tensor& w_up,
                                               const Tensor& w_down);
// Where an op that writes gradients may also leave the sum of their squares: out[index]
// (f64, on the op's device). Lets the gradient norm skip a pass over gradients that an
// op had in registers anyway (LayerwiseOptimizer).
struct SumSquaresInto {
  Tensor* out = nullptr;  // nullptr: not asked
  int64_t index = 0;
};
// dW_down[e] += dy_e^T a_e; dW_gate[e] += dgate_e^T x_e; dW_up[e] += dup_e^T x_e. With
// accumulate false and squares given: = instead of +=, and squares.out[squares.index] = the
// sum of the squares of the three gradients written (in double; summed in a fixed order).
// a = act ([N, I], the forward's SwigluOut::act) when given (gate and up are then not read
// and may be undefined), else silu(gate) * up again.
void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate,
                                    const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate,
                                    Tensor& dw_up, Tensor& dw_down, bool accumulate = true,
                                    SumSquaresInto squares = {}, const Tensor& act = Tensor());
// The inputs grouped_swiglu_backward_weight takes for one micro-batch's rows.
struct SwigluWgradRows {
  Tensor dy, x, counts, gate, up, dgate, dup, act;
};
// The weight gradients of several micro-batches' rows, in the order given, into the same dW
// (= with accumulate false, else +=): one grouped_swiglu_backward_weight call each, except on
// Hopper with every act given, where each tile's k loop runs over all the micro-batches' rows
// of its expert (up to 8 a pass), so the f32 dW is written or added to once instead of once
// per micro-batch (gradient accumulation: fewer read-modify-writes of dW).
// With accumulate false and squares given, squares.out[squares.index] = the sum of the
// squares of the three gradients written (as grouped_swiglu_backward_weight's).
void grouped_swiglu_backward_weight_group(const std::vector<SwigluWgradRows>& rows, Tensor& dw_gate, Tensor& dw_up,
                                          Tensor& dw_down, bool accumulate, SumSquaresInto squares = {});

// grouped_swiglu_backward_weight_group in FP8 (issue 30): each micro-batch's dy, act, dgate,
// dup and x quantized along each expert's tokens (quantize_fp8_expert_columns), dW_down =
// sum dy^T act, dW_gate = sum dgate^T x, dW_up = sum dup^T x by grouped_wgrad_fp8 (f32
// gradients; 4 micro-batches' operands quantized at a time); squares as
// grouped_swiglu_backward_weight's (here a pass over the written gradients). Each act must be
// given (the forward's); gate and up are not read.
void grouped_swiglu_backward_weight_fp8(const std::vector<SwigluWgradRows>& rows, Tensor& dw_gate, Tensor& dw_up,
                                        Tensor& dw_down, bool accumulate, SumSquaresInto squares = {});

// ---- cross-entropy with ignore index -100 ---------------------------------------------
// logits [T, V], targets i32 [T]. loss_sum [1] = sum over targets != -100 of
// lse(logits[t]) - logits[t, target]; lse [T] saved. A target outside [0, V) other than
// -100 is an error naming it.
struct CrossEntropyOut {
  Tensor loss_sum;
  Tensor lse;
};
constexpr int32_t kIgnoreIndex = -100;
CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets);
// dlogits = scale * (softmax(logits) - onehot(target)); zero rows where ignored.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale);
// Both in one pass over the logits, which are overwritten by their gradient (the values of
// cross_entropy_backward with the forward's lse): the output head reads its logits once.
CrossEntropyOut cross_entropy_forward_backward_(Tensor& logits, const Tensor& targets, double scale);

// ---- cross-entropy over a vocabulary split across ranks (a vocabulary-parallel head) ---
// A rank holds logits [T, Vs]: the columns [shard.begin, shard.begin + Vs) of a vocabulary of
// shard.size; targets i32 [T] are whole-vocabulary ids or -100. The whole rows' softmax never
// meets in one place: each rank's vocab_shard_stats ([T] each: its columns' log-sum-exp, and
// the target's logit where its columns hold the target, else 0), stacked [R, T] over the R
// ranks (an all-gather of 2T numbers a rank), give vocab_parallel_loss: the loss sum over the
// rows not ignored and the whole rows' lse, from which each rank's vocab_shard_backward makes
// its columns' gradient scale * (exp(logits - lse) - [shard.begin + v == target]), zero rows
// where ignored. With one shard of the whole vocabulary these are cross_entropy_forward and
// _backward. A target outside [0, shard.size) other than -100: an error on the CPU, NaN rows
// on the GPU (as cross_entropy_forward's).
struct VocabShardStats {
  Tensor lse, target_logit;  // [T] each (f32 on the GPU)
};
VocabShardStats vocab_shard_stats(const Tensor& logits, const Tensor& targets, const VocabShard& shard);
CrossEntropyOut vocab_parallel_loss(const Tensor& shard_lse, const Tensor& shard_target_logit, const Tensor& targets);
Tensor vocab_shard_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const VocabShard& shard,
                            double scale);

// ---- output head: linear + cross-entropy, fused over row chunks ------------------------
// loss_sum [1] = cross-entropy sum of logits = x W^T against targets, computed chunk_rows
// rows at a time so no more than chunk_rows x V logits exist at once (the whole [T, V]
// logits, in f32 that is 4.8 GB for 8192 tokens of a 152k vocabulary, never do). When dx
// is given, the backward runs in the same pass (the loss is final, so its gradient is known
// per chunk): dx = d(scale * loss_sum)/dx is written [T, H] and, when dw is given, dW is
// accumulated into dw (written when !accumulate_dw). chunk_rows <= 0 picks rows so that a chunk holds ~256M logits.
struct LinearCrossEntropyOut {
  Tensor loss_sum;  // [1], as cross_entropy_forward's (f32 on the GPU)
};
LinearCrossEntropyOut linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& targets, double scale,
                                           Tensor* dx, Tensor* dw, int64_t chunk_rows = 0,
                                           bool accumulate_dw = true);

// ---- FP8 (e4m3) with block scales: the ops (the format: Fp8Tensor, above) ------------
// x [R, C] (bf16, f32 or f64).
Fp8Tensor quantize_fp8(const Tensor& x, Fp8Blocks blocks);
// x^T quantized, [C, R], from x [R, C] in one pass: no transposed copy of x. Rows mode: tiles
// of 128 along R (a weight gradient's operands, whose reduction runs over the tokens); blocks
// mode: W^T of a weight (the input gradient's operand), the same 128 x 128 blocks as W's.
Fp8Tensor quantize_fp8_transposed(const Tensor& x, Fp8Blocks blocks = Fp8Blocks::kRows);
// x per 1 x 128 tile along both dimensions in one pass over it: {quantize_fp8(x, kRows),
// quantize_fp8_transposed(x)}, bit for bit. An output gradient is read along the features by
// the input gradient and along the tokens by the weight gradient.
Fp8BothWays quantize_fp8_both_ways(const Tensor& x);
// q * scale as `dtype`.
Tensor dequantize_fp8(const Fp8Tensor& t, DType dtype);
// Rows-mode codes with their scales as one byte tensor, the form in which an expert dispatch
// moves FP8 rows (a row-wise gather or collective then moves a row's codes and scales
// together: C + 4 ceil(C/128) bytes a row against 2 C for bf16): x.q [R, C] -> f8e4m3
// [R, C + 4 ceil(C/128)], row r its C codes, then its tiles' f32 scales (little-endian bytes).
Tensor pack_fp8_rows(const Fp8Tensor& x);
// The inverse, bit for bit, with the rows' values (q * scale as `dtype`, dequantize_fp8's)
// made in the same pass (UnpackedFp8Rows, above): what a receiver of packed rows hands its experts.
UnpackedFp8Rows unpack_fp8_rows(const Tensor& packed, int64_t cols, DType dtype);
// An expert weight w [E, n, k] (n a multiple of 128) per 128 x 128 block of each expert:
// quantize_fp8 of its [E n, k] view in blocks mode (no block spans two experts).
Fp8Tensor quantize_fp8_experts(const Tensor& w);
// A weight's blocks both ways in one pass over it (a training step's products read W's in
// the forward and W^T's in the input gradient; the GPU reads w once and writes both): w [n, k]
// -> {quantize_fp8(w, kBlocks), quantize_fp8_transposed(w, kBlocks)}; w [E, n, k] (n and k
// multiples of 128) -> {quantize_fp8_experts(w), transpose_fp8_experts of it}. Bit for bit.
Fp8WeightBlocks quantize_fp8_weight(const Tensor& w);

// ---- The experts' weight gradient in FP8: operands quantized along the tokens, per expert ----
// The weight gradient dW_e = A_e^T B_e reduces over expert e's rows (tokens), so its FP8
// operands are quantized per 1 x 128 tile along the tokens, and no tile may hold two experts'
// rows. quantize_fp8_expert_columns(x [N, C], counts [E]) writes x^T [C, P] with each expert's
// rows, in order, filling its own tiles of 128 columns: expert e takes ceil(c_e / 128) tiles
// after those of the experts before it (the grouped GEMMs' row tiles, in the same order), the
// columns of a tile past its expert's last row hold zero codes, and the tiles past the last
// expert's are zero with scale 1. P = 128 fp8_expert_tiles(N, E), the bound for any counts;
// scale [P / 128, C]: rows mode of [C, P] (dequantize_fp8 of the result is x^T so padded).
// counts i64 [E] summing to N (the GPU clamps them as the grouped GEMMs do).
int64_t fp8_expert_tiles(int64_t rows, int64_t experts);
Fp8Tensor quantize_fp8_expert_columns(const Tensor& x, const Tensor& counts);
// dw [E, Ca, Cb] f32: dw[e] = (or += with accumulate) sum over the columns of expert e's tiles
// of a_t[:, j] b_t[:, j]^T, from a_t [Ca, P] and b_t [Cb, P] made by quantize_fp8_expert_columns
// with the same counts: the f32 product of the dequantized operands (on the GPU promoted every
// 128 of K, each fresh sum times its row's and its column's scale). An expert without rows
// gets zeros (or is left as it is, accumulating). Several sources (micro-batches, each its
// own operands and counts; the same Ca, Cb and E): the sum over all of them, dw written or
// added to once (on the GPU once per kFp8WgradSourcesPerPass sources).
constexpr int kFp8WgradSourcesPerPass = 4;
struct Fp8WgradOperands {
  Fp8Tensor a_t, b_t;
  Tensor counts;
};
void grouped_wgrad_fp8(const std::vector<Fp8WgradOperands>& sources, Tensor& dw, bool accumulate);
inline void grouped_wgrad_fp8(const Fp8Tensor& a_t, const Fp8Tensor& b_t, const Tensor& counts, Tensor& dw,
                              bool accumulate) {
  grouped_wgrad_fp8({Fp8WgradOperands{a_t, b_t, counts}}, dw, accumulate);
}

// y [M, N] = a [M, K] b [N, K]^T, a in rows mode, b in either: the product of the dequantized
// operands with f32 sums (on the GPU, per 128-element block of K the e4m3 products' sum times
// the two tiles' scales, added over the blocks in f32: DeepSeek's promotion every 128 of K);
// y of dtype `out` (bf16 or f32).
Tensor linear_fp8(const Fp8Tensor& a, const Fp8Tensor& b, DType out);
// The same into y [M, N] (bf16 or f32): y = a b^T, or y += a b^T when `accumulate` (a weight
// gradient over micro-batches, in the GEMM's epilogue).
void linear_fp8_into(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& y, bool accumulate);
// The experts' forward in FP8 (issue 30): as grouped_swiglu_forward, from x quantized per
// 1 x 128 tile (quantize_fp8(x, kRows), x [N, H]) and each weight per 128 x 128 block of each
// expert (quantize_fp8_experts); act is quantized per 1 x 128 tile for the down GEMM (the
// returned act is the unquantized one, for the backward). Sums in f32, promoted every 128 of
// K on the GPU. H and I multiples of 128. Outputs bf16 on CUDA (Hopper only), f32 on the CPU.
SwigluOut grouped_swiglu_forward_fp8(const Fp8Tensor& x, const Tensor& counts, const Fp8Tensor& w_gate,
                                     const Fp8Tensor& w_up, const Fp8Tensor& w_down, int64_t experts);
// Each expert's W^T per 128 x 128 block from W's blocks (quantize_fp8_experts of w [E, n, k],
// k a multiple of 128): [E n, k] -> [E k, n], the same codes and scales moved (a block's amax
// is its transpose's), bitwise quantize_fp8_transposed(w[e], kBlocks) of each expert, stacked.
Fp8Tensor transpose_fp8_experts(const Fp8Tensor& w, int64_t experts);
// The experts' input gradient in FP8 (issue 30): as grouped_swiglu_backward_input, from dy
// [N, H] per 1 x 128 tile and each expert's W^T per block (transpose_fp8_experts of the
// forward's blocks: w_gate_t, w_up_t [E H, I], w_down_t [E I, H]). dgate and dup are quantized
// per 1 x 128 tile for the dx GEMM; the returned ones (for the weight gradients) are not. Sums
// in f32, promoted every 128 of K on the GPU. H and I multiples of 128. bf16 out on CUDA
// (Hopper only), f32 on the CPU; gate and up as the forward returned them.
SwigluInputGrads grouped_swiglu_backward_input_fp8(const Fp8Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                   const Tensor& up, const Fp8Tensor& w_gate_t,
                                                   const Fp8Tensor& w_up_t, const Fp8Tensor& w_down_t,
                                                   int64_t experts);

// ---- MoE auxiliary losses -------------------------------------------------------------
// Hugging Face Qwen3-MoE load balancing over R router rows (all routed layers of a
// forward, concatenated): loss = coef * E * sum_e (n_e / R) * (P_e / R), with n_e the
// number of top-k selections of expert e and P_e the sum of probs[:, e].
// Adds this layer's n_e and P_e into selections [E] and prob_sum [E] (dtype of probs).
void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum);
// The gradient w.r.t. each row of probs is the same vector coef * E * n_e / R^2: returns
// dprobs [rows, E] filled with it.
Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef);
// Router entropy (telemetry): sum over the rows of probs [R, E] of -sum_e p log p (0 log 0
// = 0), as [1] (probs' dtype; f32 on CUDA). Its mean over rows is log E for a router that
// cannot tell experts apart and 0 for one certain of a single expert.
Tensor router_entropy_sum(const Tensor& probs);
// Router z-loss (ST-MoE): sum over rows of lse(logits[r])^2, as loss_sum [1], plus lse [R].
struct ZLossOut {
  Tensor loss_sum;
  Tensor lse;
};
ZLossOut router_z_loss_forward(const Tensor& logits);
// dlogits = scale * 2 * lse[r] * softmax(logits[r]) (probs = softmax(logits) given).
Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale);

// ---- DeepSeek-V3's sequence-wise balance loss ----------------------------------------
// probs [B*S, E] (router scores, the rows of B sequences of S in order; normalised per row
// here, so sigmoid scores serve) and topk_idx [B*S, K]. Per sequence b:
//   f_i = E / (K S) * (selections of expert i in b),   P_i = (1/S) sum_t p[t,i] / sum_j p[t,j]
//   loss_b = sum_i f_i P_i
// Returns sum_b loss_b as [1] (probs' dtype; f32 on CUDA).
// Under context parallelism a rank holds part of each sequence: `whole` then gives the
// sequences' selections summed over the group (seq_balance_counts, all-reduced) and their
// whole length, and the sums run over this rank's tokens with f and S of the whole
// sequences (the ranks' sums add up to the loss).
struct SeqBalanceWhole {
  Tensor counts;    // f64 [B, E]: selections of each expert in each whole sequence; undefined: these rows
  int64_t seq = 0;  // the whole sequences' length
};
Tensor seq_balance_loss_sum(const Tensor& probs, const Tensor& topk_idx, int64_t batch,
                            const SeqBalanceWhole& whole = {});
// d(scale * sum_b loss_b) / d probs [B*S, E] (f counts choices: no gradient):
//   scale / S * (f_j - sum_i f_i p[t,i] / Z_t) / Z_t,   Z_t = sum_j p[t,j].
Tensor seq_balance_backward(const Tensor& probs, const Tensor& topk_idx, int64_t batch, double scale,
                            const SeqBalanceWhole& whole = {});
// Selections of each expert in each of the B sequences of topk_idx [B*S, K]: f64 [B, E].
Tensor seq_balance_counts(const Tensor& topk_idx, int64_t batch, int64_t experts);

// ---- AdamW (decoupled weight decay), FP32 master weights and moments ------------------
// In place on param, m, v (same shape, f32 or f64; or f32 param and grad with bf16 m and v,
// stored by stochastic rounding keyed by step and the element's place in m's storage, so
// CPU and CUDA, whole-list and per-bucket updates round alike: stochastic_round.h), given grad:
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   param -= lr * (m / (1-b1^step) / (sqrt(v / (1-b2^step)) + eps) + wd * param)
// with g = grad_scale * grad (global-norm clipping folded into the update, so the
// gradients are read once and never rewritten).
struct AdamWStep {
  double lr = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies every gradient element first
  // CUDA: how many multiprocessors the update may occupy (0: all it can fill). Fewer leave
  // the rest to kernels on other streams (the next forward, LayerwiseOptimizer); the
  // result does not depend on it.
  int max_sms = 0;
};
void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s);

// ---- whole parameter lists (the optimizer step) ----------------------------------------
// One call covers every tensor of a list. On CUDA, tensors that lie back to back in memory
// in every role (the per-expert views of a stacked expert weight, with moments and masters
// allocated flat in parameter order) are coalesced into segments, so thousands of
// parameters cost a few launches; sum_squares_all waits for the stream once.
//
// AdamW over the list: params[i] updated from grads[i] as adamw_update with
// s.weight_decay where decay[i] (else 0); when values[i] is defined (the bf16 weight the
// model computes with, params[i] being its f32 master) it receives params[i] rounded. A
// split master (lows[i] defined, values[i] not): params[i] is the bf16 weight and lows[i]
// the rest of the f32 master (master_join_into below); both are updated, exactly as an f32
// master would be and then split.
struct AdamWTensors {
  std::vector<Tensor> params, grads, m, v;
  std::vector<Tensor> values;  // per param: a bf16 copy to refresh, or undefined
  std::vector<Tensor> lows;    // per param: the i16 low half of a split master, or undefined
  std::vector<bool> decay;
};
void adamw_update_all(AdamWTensors& t, const AdamWStep& s);
// Sum over the list of sum_squares, in double; on CUDA in a fixed order (reproducible).
double sum_squares_all(const std::vector<Tensor>& xs);
// The same sum written to out[index] (f64, on the list's device) without waiting for it, so
// a stream can compute a part of a norm while another goes on (LayerwiseOptimizer).
void sum_squares_all_into(const std::vector<Tensor>& xs, Tensor& out, int64_t index);
// Sets every tensor of the list to zero.
void zero_all(const std::vector<Tensor>& xs);

// ---- small reductions and element-wise helpers ----------------------------------------
// sum of squares of all elements, in double
double sum_squares(const Tensor& x);
// x *= alpha
void scale_(Tensor& x, double alpha);
// y += x (same shape and dtype; on the GPU x may also be bf16 summed into an f32 y)
void add_(Tensor& y, const Tensor& x);
// true when every element is finite
bool all_finite(const Tensor& x);
// dst = src converted to dst's dtype (same shape and device), e.g. f32 master -> bf16 weight
void cast_into(Tensor& dst, const Tensor& src);
// Split f32 masters (ops/adamw_math.h): the bf16 weight is the master's high half, rounded
// to nearest with ties away from zero, and an i16 tensor the rest, so that the two hold the
// master exactly. All three tensors of one shape and device.
// master (f32) = the join of high (bf16) and low (i16).
void master_join_into(Tensor& master, const Tensor& high, const Tensor& low);
// high, low = the halves of master; master_join_into gives it back bit for bit, except a
// NaN, which comes back as the canonical NaN (its payload is not kept).
void master_split_into(const Tensor& master, Tensor& high, Tensor& low);

// ---- a signal between the GPUs of one host (engine/parallel/peer_arena.h) -------------
// On the current stream: once the stream's work before it is done, writes `value` into word
// `rank` of every other rank's signal words (peer_words[q]: rank q's words as this GPU
// addresses them; entry `rank` unused), then waits until every other rank q has written a
// value at least `value` (cyclic compare) into word q of its own words (peer_words[rank]).
// One warp, no shared memory and few registers: it sits beside the compute kernels instead
// of taking a multiprocessor from them. A wait past `timeout_s` prints which rank it waited
// for and stops the kernel (a CUDA error at the host's next call: never a silent hang). At
// most 32 ranks. CUDA builds only.
void signal_peers_and_wait(const std::vector<void*>& peer_words, int rank, uint32_t value, double timeout_s);
// One-way signals (engine/pipeline/peer_transport.h), one thread each on the current
// stream. signal_word: once the stream's work before it is done, writes `value` into `word`
// (this GPU's or a peer's, system scope, release). wait_word: the stream's work after it
// waits until `word` holds a value at least `value` (cyclic compare); past `timeout_s` it
// prints the value it waited for and stops the kernel. CUDA builds only.
void signal_word(void* word, uint32_t value);
void wait_word(const void* word, uint32_t value, double timeout_s);

}  // namespace moetrain::ops
