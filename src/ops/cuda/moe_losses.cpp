// CUDA MoE auxiliary losses (moe_losses.cu has the kernels and their determinism notes).
//
// load_balance_accumulate: probs f32 [R, E], topk_idx i32 [R, K]; selections and prob_sum
// f32 [E] (+=). load_balance_backward: selections f32 -> dprobs f32 [rows, E].
// router_z_loss_forward: logits bf16 or f32 [R, E] -> loss_sum f32 [1], lse f32 [R].
// router_z_loss_backward: probs f32, lse f32 -> dlogits bf16 [R, E]: on CUDA the router
// logits are bf16 (a linear's output), and a logit gradient takes its logits' dtype, so
// that it adds straight into the router's other dlogits (add_ wants equal dtypes).
//
// A top-k index outside [0, E) is an error on the CPU; here it turns every selections
// entry into NaN (a check would wait for the device), which the loss then shows.
#include "ops/arg_checks.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/moe_losses_launch.h"

namespace moetrain::ops::cuda {

void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum) {
  check_cuda_tensors("load_balance_accumulate", {&probs, &topk_idx, &selections, &prob_sum});
  MT_CHECK(probs.defined() && probs.ndim() == 2, "load_balance_accumulate: probs must be [R, E], got {}",
           probs.str());
  const int64_t R = probs.size(0), E = probs.size(1);
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2 && topk_idx.size(0) == R,
           "load_balance_accumulate: topk_idx must be [R = {}, K], got {}", R, topk_idx.str());
  check_dtype(topk_idx, DType::I32, "load_balance_accumulate topk_idx");
  check_dtype(probs, DType::F32, "load_balance_accumulate probs");
  check_shape(selections, {E}, "load_balance_accumulate selections");
  check_shape(prob_sum, {E}, "load_balance_accumulate prob_sum");
  check_dtype(selections, DType::F32, "load_balance_accumulate selections");
  check_dtype(prob_sum, DType::F32, "load_balance_accumulate prob_sum");
  const int64_t K = topk_idx.size(1);
  if (E == 0) return;
  const size_t bytes = load_balance_scratch_bytes(R, E);
  Tensor scratch = Tensor::empty({static_cast<int64_t>((bytes + 7) / 8)}, DType::I64, probs.device());
  launch_load_balance_accumulate(probs.data<float>(), topk_idx.data<int32_t>(), selections.data<float>(),
                                 prob_sum.data<float>(), R, E, K, scratch.raw(), stream());
  check_launch("load_balance_accumulate");
}

Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef) {
  check_cuda_tensors("load_balance_backward", {&selections});
  MT_CHECK(selections.defined() && selections.ndim() == 1, "load_balance_backward: selections must be [E], got {}",
           selections.str());
  check_dtype(selections, DType::F32, "load_balance_backward selections");
  MT_CHECK(rows >= 0 && total_rows > 0, "load_balance_backward: rows = {} and total_rows = {} must be >= 0 and > 0",
           rows, total_rows);
  const int64_t E = selections.size(0);
  Tensor dprobs = Tensor::empty({rows, E}, DType::F32, selections.device());
  launch_load_balance_backward(selections.data<float>(), dprobs.data<float>(), rows, E, total_rows, coef, stream());
  check_launch("load_balance_backward");
  return dprobs;
}

Tensor router_entropy_sum(const Tensor& probs) {
  check_cuda_tensors("router_entropy_sum", {&probs});
  MT_CHECK(probs.defined() && probs.ndim() == 2, "router_entropy_sum: probs must be [R, E], got {}", probs.str());
  check_dtype(probs, DType::F32, "router_entropy_sum probs");
  const int64_t R = probs.size(0), E = probs.size(1);
  Tensor out = Tensor::empty({1}, DType::F32, probs.device());
  Tensor h = Tensor::empty({R}, DType::F32, probs.device());
  launch_router_entropy_sum(probs.data<float>(), h.data<float>(), out.data<float>(), R, E, stream());
  check_launch("router_entropy_sum");
  return out;
}

ZLossOut router_z_loss_forward(const Tensor& logits) {
  check_cuda_tensors("router_z_loss_forward", {&logits});
  MT_CHECK(logits.defined() && logits.ndim() == 2, "router_z_loss_forward: logits must be [R, E], got {}",
           logits.str());
  MT_CHECK(logits.dtype() == DType::BF16 || logits.dtype() == DType::F32,
           "router_z_loss_forward: logits must be bf16 or f32 on CUDA, got {}", logits.str());
  const int64_t R = logits.size(0), E = logits.size(1);
  MT_CHECK(E > 0 || R == 0, "router_z_loss_forward: logits {} have no experts", logits.str());
  ZLossOut out;
  out.lse = Tensor::empty({R}, DType::F32, logits.device());
  out.loss_sum = Tensor::empty({1}, DType::F32, logits.device());
  Tensor sq = Tensor::empty({R}, DType::F32, logits.device());
  if (logits.dtype() == DType::F32) {
    launch_router_z_loss_forward(logits.data<float>(), out.lse.data<float>(), sq.data<float>(),
                                 out.loss_sum.data<float>(), R, E, stream());
  } else {
    launch_router_z_loss_forward(static_cast<const __nv_bfloat16*>(logits.raw()), out.lse.data<float>(),
                                 sq.data<float>(), out.loss_sum.data<float>(), R, E, stream());
  }
  check_launch("router_z_loss_forward");
  return out;
}

Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale) {
  check_cuda_tensors("router_z_loss_backward", {&probs, &lse});
  MT_CHECK(probs.defined() && probs.ndim() == 2, "router_z_loss_backward: probs must be [R, E], got {}", probs.str());
  check_dtype(probs, DType::F32, "router_z_loss_backward probs");
  const int64_t R = probs.size(0), E = probs.size(1);
  check_shape(lse, {R}, "router_z_loss_backward lse");
  check_dtype(lse, DType::F32, "router_z_loss_backward lse");
  Tensor d = Tensor::empty({R, E}, DType::BF16, probs.device());
  launch_router_z_loss_backward(probs.data<float>(), lse.data<float>(), static_cast<__nv_bfloat16*>(d.raw()), R, E,
                                static_cast<float>(scale), stream());
  check_launch("router_z_loss_backward");
  return d;
}

namespace {

// The sequence-wise balance loss's arguments (arg_checks.h), and what the kernel takes; returns S.
int64_t seq_balance_args(const char* op, const Tensor& probs, const Tensor& topk_idx, int64_t batch) {
  check_cuda_tensors(op, {&probs, &topk_idx});
  const int64_t S = check_seq_balance_args(op, probs, topk_idx, batch), E = probs.size(1);
  check_dtype(probs, DType::F32, "seq_balance probs");
  MT_CHECK(E > 0 && (E + 8) * sizeof(float) <= 48 * 1024, "{}: {} experts: the kernel's shared tally holds 1..12280",
           op, E);
  return S;
}

}  // namespace

namespace {
// The whole sequences' counts (context parallelism), checked; null when not given.
const double* whole_counts(const char* op, const Tensor& probs, int64_t batch, const SeqBalanceWhole& whole) {
  if (!whole.counts.defined()) return nullptr;
  check_cuda_tensors(op, {&probs, &whole.counts});
  MT_CHECK(whole.counts.dtype() == DType::F64 && whole.counts.shape() == Shape({batch, probs.size(1)}) && whole.seq > 0,
           "{}: whole.counts is {} of sequences of {}, expected f64 [{}, {}] (seq_balance_counts) of a positive length",
           op, whole.counts.str(), whole.seq, batch, probs.size(1));
  return whole.counts.data<double>();
}
}  // namespace

Tensor seq_balance_loss_sum(const Tensor& probs, const Tensor& topk_idx, int64_t batch, const SeqBalanceWhole& whole) {
  const int64_t S = seq_balance_args("seq_balance_loss_sum", probs, topk_idx, batch);
  const double* counts = whole_counts("seq_balance_loss_sum", probs, batch, whole);
  Tensor out = Tensor::empty({1}, DType::F32, probs.device());
  Tensor per_seq = Tensor::zeros({batch}, DType::F32, probs.device());  // stays 0 for empty sequences
  launch_seq_balance_loss_sum(probs.data<float>(), topk_idx.data<int32_t>(), counts, whole.seq, per_seq.data<float>(),
                              out.data<float>(), batch, S, probs.size(1), topk_idx.size(1), stream());
  check_launch("seq_balance_loss_sum");
  return out;
}

Tensor seq_balance_backward(const Tensor& probs, const Tensor& topk_idx, int64_t batch, double scale,
                            const SeqBalanceWhole& whole) {
  const int64_t S = seq_balance_args("seq_balance_backward", probs, topk_idx, batch);
  const double* counts = whole_counts("seq_balance_backward", probs, batch, whole);
  Tensor d = Tensor::empty(probs.shape(), DType::F32, probs.device());
  launch_seq_balance_backward(probs.data<float>(), topk_idx.data<int32_t>(), counts, whole.seq, d.data<float>(), batch,
                              S, probs.size(1), topk_idx.size(1), static_cast<float>(scale), stream());
  check_launch("seq_balance_backward");
  return d;
}

Tensor seq_balance_counts(const Tensor& topk_idx, int64_t batch, int64_t experts) {
  const char* op = "seq_balance_counts";
  check_cuda_tensors(op, {&topk_idx});
  MT_CHECK(topk_idx.dtype() == DType::I32 && topk_idx.ndim() == 2 && batch > 0 && topk_idx.size(0) % batch == 0,
           "{}: topk_idx {} must be i32 [batch * S, K] with batch = {}", op, topk_idx.str(), batch);
  MT_CHECK(experts > 0 && experts * sizeof(int) <= 48 * 1024, "{}: {} experts: the kernel's shared tally holds 1..12288",
           op, experts);
  Tensor counts = Tensor::empty({batch, experts}, DType::F64, topk_idx.device());
  launch_seq_balance_counts(topk_idx.data<int32_t>(), counts.data<double>(), batch, topk_idx.size(0) / batch, experts,
                            topk_idx.size(1), stream());
  check_launch(op);
  return counts;
}

}  // namespace moetrain::ops::cuda
