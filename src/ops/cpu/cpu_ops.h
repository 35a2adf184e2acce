// The CPU reference implementations of ops/ops.h, one file per op family in this
// folder. Same signatures and semantics as ops.h; callers go through ops.h.
#pragma once

#include "ops/ops.h"

namespace moetrain::ops::cpu {

Tensor embedding_forward(const Tensor& ids, const Tensor& weight, const VocabShard& shard);
void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight, const VocabShard& shard);
Tensor shift_tokens(const Tensor& ids, const Tensor& segment_ids, int64_t batch, int64_t k, int32_t fill);
Fp8Tensor quantize_fp8(const Tensor& x, Fp8Blocks blocks);
Fp8Tensor quantize_fp8_transposed(const Tensor& x, Fp8Blocks blocks);
Tensor dequantize_fp8(const Fp8Tensor& t, DType dtype);
Tensor pack_fp8_rows(const Fp8Tensor& x);
UnpackedFp8Rows unpack_fp8_rows(const Tensor& packed, int64_t cols, DType dtype);
void linear_fp8_into(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& y, bool accumulate);
Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& residual);
Tensor linear_backward_input(const Tensor& dy, const Tensor& w);
void linear_backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx);
void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate);
RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps);
RmsNormOut rmsnorm_forward_fp8(const Tensor& x, const Tensor& w, double eps);
Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& residual);
void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw);
Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& r);
Tensor rope_backward(const Tensor& dy, const Tensor& positions, const RopeSpec& r);
MlaKv mla_kv_forward(const Tensor& kv, const Tensor& k_rot, int64_t heads, int64_t nope, int64_t v_dim);
MlaKvGrads mla_kv_backward(const Tensor& dk, const Tensor& dv, int64_t heads, int64_t nope, int64_t v_dim);
RmsNormOut rmsnorm_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& positions,
                                int64_t head_dim, double theta);
RmsNormRopeGrads rmsnorm_rope_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       const Tensor& positions, int64_t head_dim, double theta);
AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const AttentionShape& shape);
AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const Tensor& out, const Tensor& lse, const AttentionShape& shape);
AttentionOut attention_part_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part, const AttentionShape& shape);
AttentionGrads attention_part_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part, const Tensor& out, const Tensor& lse, const AttentionShape& shape);
void attention_merge(AttentionOut& acc, const AttentionOut& part);
RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob, const Tensor& selection_bias);
Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd, bool norm_topk_prob);
RouterOut router_sigmoid_forward(const Tensor& logits, const Tensor& bias, int64_t k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk_prob, double scaling);
Tensor router_sigmoid_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                               bool norm_topk_prob, double scaling);
Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts);
Tensor expert_ids_in_range(const Tensor& topk_idx, int64_t first, int64_t count);
Tensor permute_forward(const Tensor& x, const Permutation& p);
Fp8Tensor permute_forward_fp8(const Fp8Tensor& x, const Permutation& p);
UnpackedFp8Rows permute_forward_fp8_values(const Fp8Tensor& x, const Permutation& p, DType dtype);
Tensor permute_backward(const Tensor& dxp, const Permutation& p);
Tensor unpermute_forward(const Tensor& yp, const Permutation& p);
Tensor take_rows(const Tensor& x, const Tensor& index);
Tensor unpermute_backward(const Tensor& dy, const Permutation& p);
Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual, const Tensor& order);
CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight, const Tensor& order);
SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down);
SwigluOut grouped_swiglu_forward_fp8(const Fp8Tensor& x, const Tensor& counts, const Fp8Tensor& w_gate,
                                     const Fp8Tensor& w_up, const Fp8Tensor& w_down, int64_t experts);
Fp8Tensor transpose_fp8_experts(const Fp8Tensor& w, int64_t experts);
Fp8WeightBlocks quantize_fp8_weight(const Tensor& w);
Fp8BothWays quantize_fp8_both_ways(const Tensor& x);
Fp8Tensor quantize_fp8_expert_columns(const Tensor& x, const Tensor& counts);
void grouped_wgrad_fp8(const std::vector<Fp8WgradOperands>& sources, Tensor& dw, bool accumulate);
SwigluInputGrads grouped_swiglu_backward_input_fp8(const Fp8Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                   const Tensor& up, const Fp8Tensor& w_gate_t,
                                                   const Fp8Tensor& w_up_t, const Fp8Tensor& w_down_t,
                                                   int64_t experts);
SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down);
void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate, Tensor& dw_up, Tensor& dw_down, bool accumulate, SumSquaresInto squares, const Tensor& act);
CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets);
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale);
VocabShardStats vocab_shard_stats(const Tensor& logits, const Tensor& targets, const VocabShard& shard);
CrossEntropyOut vocab_parallel_loss(const Tensor& shard_lse, const Tensor& shard_target_logit, const Tensor& targets);
Tensor vocab_shard_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const VocabShard& shard, double scale);
void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum);
Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef);
Tensor router_entropy_sum(const Tensor& probs);
ZLossOut router_z_loss_forward(const Tensor& logits);
Tensor seq_balance_loss_sum(const Tensor& probs, const Tensor& topk_idx, int64_t batch, const SeqBalanceWhole& whole = {});
Tensor seq_balance_backward(const Tensor& probs, const Tensor& topk_idx, int64_t batch, double scale,
                            const SeqBalanceWhole& whole = {});
Tensor seq_balance_counts(const Tensor& topk_idx, int64_t batch, int64_t experts);
Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale);
void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s);
double sum_squares(const Tensor& x);
void adamw_update_all(AdamWTensors& t, const AdamWStep& s);
double sum_squares_all(const std::vector<Tensor>& xs);
void sum_squares_all_into(const std::vector<Tensor>& xs, Tensor& out, int64_t index);
void zero_all(const std::vector<Tensor>& xs);
void scale_(Tensor& x, double alpha);
void add_(Tensor& y, const Tensor& x);
bool all_finite(const Tensor& x);
void cast_into(Tensor& dst, const Tensor& src);
void master_join_into(Tensor& master, const Tensor& high, const Tensor& low);
void master_split_into(const Tensor& master, Tensor& high, Tensor& low);

}  // namespace moetrain::ops::cpu
