// CUDA softmax cross-entropy with ignore index -100 (cross_entropy.cu has the kernels).
// logits bf16 [T, V]; targets i32 [T]; lse f32 [T]; loss_sum f32 [1] (written, not
// accumulated, like the CPU reference); dlogits bf16.
//
// A target outside [0, V) other than -100 is an error on the CPU; here a check would wait
// for the device, so instead the row's loss is NaN (so loss_sum is NaN) and its dlogits
// row is NaN: the trainer's non-finite check stops on it.
#include "ops/cuda/common.h"
#include "ops/cuda/cross_entropy_launch.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {
namespace {

void check_args(const Tensor& logits, const Tensor& targets, const char* op) {
  check_cuda_tensors(op, {&logits, &targets});
  MT_CHECK(logits.defined() && logits.ndim() == 2, "{}: logits must be [T, V], got {}", op, logits.str());
  check_dtype(logits, DType::BF16, "logits");
  const int64_t T = logits.size(0), V = logits.size(1);
  MT_CHECK(V > 0 || T == 0, "{}: logits {} have an empty vocabulary", op, logits.str());
  check_shape(targets, {T}, "targets");
  check_dtype(targets, DType::I32, "targets");
}

}  // namespace

CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets) {
  check_args(logits, targets, "cross_entropy_forward");
  const int64_t T = logits.size(0), V = logits.size(1);
  CrossEntropyOut o{Tensor::empty({1}, DType::F32, logits.device()), Tensor::empty({T}, DType::F32, logits.device())};
  Tensor row_loss = Tensor::empty({T}, DType::F32, logits.device());
  launch_cross_entropy_forward(static_cast<const __nv_bfloat16*>(logits.raw()), targets.data<int32_t>(),
                               o.lse.data<float>(), row_loss.data<float>(), o.loss_sum.data<float>(), T, V, stream());
  check_launch("cross_entropy_forward");
  return o;
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale) {
  check_args(logits, targets, "cross_entropy_backward");
  check_cuda_tensors("cross_entropy_backward", {&lse});
  const int64_t T = logits.size(0), V = logits.size(1);
  check_shape(lse, {T}, "lse");
  check_dtype(lse, DType::F32, "lse");
  Tensor dlogits = Tensor::empty(logits.shape(), DType::BF16, logits.device());
  launch_cross_entropy_backward(static_cast<const __nv_bfloat16*>(logits.raw()), targets.data<int32_t>(),
                                lse.data<float>(), static_cast<__nv_bfloat16*>(dlogits.raw()), T, V,
                                static_cast<float>(scale), stream());
  check_launch("cross_entropy_backward");
  return dlogits;
}

bool cross_entropy_one_pass(Tensor& logits, const Tensor& targets, double scale, CrossEntropyOut& out) {
  check_args(logits, targets, "cross_entropy_forward_backward_");
  const int64_t T = logits.size(0), V = logits.size(1);
  CrossEntropyOut o{Tensor::empty({1}, DType::F32, logits.device()), Tensor::empty({T}, DType::F32, logits.device())};
  Tensor row_loss = Tensor::empty({T}, DType::F32, logits.device());
  if (!launch_cross_entropy_fused(static_cast<__nv_bfloat16*>(logits.raw()), targets.data<int32_t>(),
                                  o.lse.data<float>(), row_loss.data<float>(), o.loss_sum.data<float>(), T, V,
                                  static_cast<float>(scale), stream())) {
    return false;
  }
  check_launch("cross_entropy_forward_backward_");
  out = std::move(o);
  return true;
}

namespace {
void check_shard(const Tensor& logits, const Tensor& targets, const VocabShard& shard, const char* op) {
  check_args(logits, targets, op);
  MT_CHECK(shard.begin >= 0 && shard.begin + logits.size(1) <= shard.size,
           "{}: logits {} hold columns [{}, {}) that do not lie in a vocabulary of {}", op, logits.str(), shard.begin,
           shard.begin + logits.size(1), shard.size);
}
}  // namespace

VocabShardStats vocab_shard_stats(const Tensor& logits, const Tensor& targets, const VocabShard& shard) {
  check_shard(logits, targets, shard, "vocab_shard_stats");
  const int64_t T = logits.size(0), V = logits.size(1);
  VocabShardStats o{Tensor::empty({T}, DType::F32, logits.device()), Tensor::empty({T}, DType::F32, logits.device())};
  launch_vocab_shard_stats(static_cast<const __nv_bfloat16*>(logits.raw()), targets.data<int32_t>(),
                           o.lse.data<float>(), o.target_logit.data<float>(), T, V, shard.begin, shard.size, stream());
  check_launch("vocab_shard_stats");
  return o;
}

CrossEntropyOut vocab_parallel_loss(const Tensor& shard_lse, const Tensor& shard_target_logit, const Tensor& targets) {
  const char* op = "vocab_parallel_loss";
  check_cuda_tensors(op, {&shard_lse, &shard_target_logit, &targets});
  MT_CHECK(shard_lse.ndim() == 2, "{}: shard_lse must be [R, T], got {}", op, shard_lse.str());
  const int64_t R = shard_lse.size(0), T = shard_lse.size(1);
  check_shape(shard_target_logit, {R, T}, "shard_target_logit");
  check_dtype(shard_lse, DType::F32, "shard_lse");
  check_dtype(shard_target_logit, DType::F32, "shard_target_logit");
  check_shape(targets, {T}, "targets");
  check_dtype(targets, DType::I32, "targets");
  CrossEntropyOut o{Tensor::empty({1}, DType::F32, shard_lse.device()), Tensor::empty({T}, DType::F32, shard_lse.device())};
  Tensor row_loss = Tensor::empty({T}, DType::F32, shard_lse.device());
  launch_vocab_parallel_loss(shard_lse.data<float>(), shard_target_logit.data<float>(), targets.data<int32_t>(),
                             o.lse.data<float>(), row_loss.data<float>(), o.loss_sum.data<float>(), R, T, stream());
  check_launch(op);
  return o;
}

Tensor vocab_shard_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const VocabShard& shard,
                            double scale) {
  const char* op = "vocab_shard_backward";
  check_shard(logits, targets, shard, op);
  check_cuda_tensors(op, {&lse});
  const int64_t T = logits.size(0), V = logits.size(1);
  check_shape(lse, {T}, "lse");
  check_dtype(lse, DType::F32, "lse");
  Tensor dlogits = Tensor::empty(logits.shape(), DType::BF16, logits.device());
  launch_vocab_shard_backward(static_cast<const __nv_bfloat16*>(logits.raw()), targets.data<int32_t>(),
                              lse.data<float>(), static_cast<__nv_bfloat16*>(dlogits.raw()), T, V, shard.begin,
                              shard.size, static_cast<float>(scale), stream());
  check_launch(op);
  return dlogits;
}

}  // namespace moetrain::ops::cuda
