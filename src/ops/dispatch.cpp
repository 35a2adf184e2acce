// Routes each op to the backend where its tensors live. Only the CPU backend exists in
// this build; a CUDA tensor here is an error that says so.
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops {
namespace {
void require_cpu(const Tensor& t, const char* op) {
  MT_CHECK(!t.defined() || t.device().is_cpu(), "{}: tensor on {} but this build has only the CPU backend", op,
           t.device().str());
}
}  // namespace

Tensor embedding_forward(const Tensor& ids, const Tensor& weight) {
  require_cpu(ids, "embedding_forward");
  return cpu::embedding_forward(ids, weight);
}

void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight) {
  require_cpu(ids, "embedding_backward_weight");
  cpu::embedding_backward_weight(ids, dy, dweight);
}

Tensor linear_forward(const Tensor& x, const Tensor& w) {
  require_cpu(x, "linear_forward");
  return cpu::linear_forward(x, w);
}

Tensor linear_backward_input(const Tensor& dy, const Tensor& w) {
  require_cpu(dy, "linear_backward_input");
  return cpu::linear_backward_input(dy, w);
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw) {
  require_cpu(dy, "linear_backward_weight");
  cpu::linear_backward_weight(dy, x, dw);
}

RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  require_cpu(x, "rmsnorm_forward");
  return cpu::rmsnorm_forward(x, w, eps);
}

Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd) {
  require_cpu(dy, "rmsnorm_backward_input");
  return cpu::rmsnorm_backward_input(dy, x, w, rstd);
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw) {
  require_cpu(dy, "rmsnorm_backward_weight");
  cpu::rmsnorm_backward_weight(dy, x, rstd, dw);
}

Tensor rope_forward(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta) {
  require_cpu(x, "rope_forward");
  return cpu::rope_forward(x, positions, head_dim, theta);
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, int64_t head_dim, double theta) {
  require_cpu(dy, "rope_backward");
  return cpu::rope_backward(dy, positions, head_dim, theta);
}

AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const AttentionShape& shape) {
  require_cpu(q, "attention_forward");
  return cpu::attention_forward(q, k, v, segment_ids, shape);
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const Tensor& out, const Tensor& lse, const AttentionShape& shape) {
  require_cpu(dout, "attention_backward");
  return cpu::attention_backward(dout, q, k, v, segment_ids, out, lse, shape);
}

RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob) {
  require_cpu(logits, "router_forward");
  return cpu::router_forward(logits, k, norm_topk_prob);
}

Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd, bool norm_topk_prob) {
  require_cpu(dtopk_weight, "router_backward");
  return cpu::router_backward(dtopk_weight, dprobs, fwd, norm_topk_prob);
}

Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts) {
  require_cpu(topk_idx, "permutation_by_expert");
  return cpu::permutation_by_expert(topk_idx, num_experts);
}

Tensor permute_forward(const Tensor& x, const Permutation& p) {
  require_cpu(x, "permute_forward");
  return cpu::permute_forward(x, p);
}

Tensor permute_backward(const Tensor& dxp, const Permutation& p) {
  require_cpu(dxp, "permute_backward");
  return cpu::permute_backward(dxp, p);
}

Tensor unpermute_forward(const Tensor& yp, const Permutation& p) {
  require_cpu(yp, "unpermute_forward");
  return cpu::unpermute_forward(yp, p);
}

Tensor unpermute_backward(const Tensor& dy, const Permutation& p) {
  require_cpu(dy, "unpermute_backward");
  return cpu::unpermute_backward(dy, p);
}

Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual) {
  require_cpu(expert_out, "combine_forward");
  return cpu::combine_forward(expert_out, weight, residual);
}

CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight) {
  require_cpu(dy, "combine_backward");
  return cpu::combine_backward(dy, expert_out, weight);
}

SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down) {
  require_cpu(x, "grouped_swiglu_forward");
  return cpu::grouped_swiglu_forward(x, counts, w_gate, w_up, w_down);
}

SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down) {
  require_cpu(dy, "grouped_swiglu_backward_input");
  return cpu::grouped_swiglu_backward_input(dy, counts, gate, up, w_gate, w_up, w_down);
}

void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate, Tensor& dw_up, Tensor& dw_down) {
  require_cpu(dy, "grouped_swiglu_backward_weight");
  cpu::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dgate, dup, dw_gate, dw_up, dw_down);
}

CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets) {
  require_cpu(logits, "cross_entropy_forward");
  return cpu::cross_entropy_forward(logits, targets);
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale) {
  require_cpu(logits, "cross_entropy_backward");
  return cpu::cross_entropy_backward(logits, targets, lse, scale);
}

void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum) {
  require_cpu(probs, "load_balance_accumulate");
  cpu::load_balance_accumulate(probs, topk_idx, selections, prob_sum);
}

Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef) {
  require_cpu(selections, "load_balance_backward");
  return cpu::load_balance_backward(selections, rows, total_rows, coef);
}

ZLossOut router_z_loss_forward(const Tensor& logits) {
  require_cpu(logits, "router_z_loss_forward");
  return cpu::router_z_loss_forward(logits);
}

Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale) {
  require_cpu(probs, "router_z_loss_backward");
  return cpu::router_z_loss_backward(probs, lse, scale);
}

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s) {
  require_cpu(param, "adamw_update");
  cpu::adamw_update(param, grad, m, v, s);
}

double sum_squares(const Tensor& x) {
  require_cpu(x, "sum_squares");
  return cpu::sum_squares(x);
}

void scale_(Tensor& x, double alpha) {
  require_cpu(x, "scale_");
  cpu::scale_(x, alpha);
}

void add_(Tensor& y, const Tensor& x) {
  require_cpu(y, "add_");
  cpu::add_(y, x);
}

bool all_finite(const Tensor& x) {
  require_cpu(x, "all_finite");
  return cpu::all_finite(x);
}

}  // namespace moetrain::ops
