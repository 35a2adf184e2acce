// CUDA token embedding: y[t] = W[ids[t]]; dW[ids[t]] += dy[t] (deterministic; see
// embedding.cu for the sort-then-walk-runs method), W being the rows of one vocabulary
// shard (ops.h: another shard's id gives a zero row, and no gradient).
//
// The weight is bf16 (the contract) or f32 (an f32 master copy works too); y has W's
// dtype. dW is f32 and dy bf16 or f32. An id outside [0, V) cannot be reported here
// without waiting for the device: forward fills that token's row with NaN (which the loss
// and the non-finite check then catch) and backward skips it.
#include <limits>

#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/embedding_launch.h"

namespace moetrain::ops::cuda {
namespace {

void check_ids(const Tensor& ids, const char* op) {
  MT_CHECK(ids.defined() && ids.ndim() == 1, "{}: ids must be a 1-D i32 tensor, got {}", op, ids.str());
  check_dtype(ids, DType::I32, "ids");
  MT_CHECK(ids.numel() <= std::numeric_limits<int32_t>::max(), "{}: {} tokens is more than the kernels index",
           op, ids.numel());
}

}  // namespace

Tensor shift_tokens(const Tensor& ids, const Tensor& segment_ids, int64_t batch, int64_t k, int32_t fill) {
  check_cuda_tensors("shift_tokens", {&ids});
  if (segment_ids.defined()) check_cuda_tensors("shift_tokens", {&segment_ids});
  Tensor out = Tensor::empty(ids.shape(), DType::I32, ids.device());
  launch_shift_tokens(ids.data<int32_t>(), segment_ids.defined() ? segment_ids.data<int32_t>() : nullptr,
                      out.data<int32_t>(), ids.numel(), ids.numel() / batch, k, fill, stream());
  check_launch("shift_tokens");
  return out;
}

Tensor embedding_forward(const Tensor& ids, const Tensor& weight, const VocabShard& shard) {
  check_cuda_tensors("embedding_forward", {&ids, &weight});
  MT_CHECK(weight.defined() && weight.ndim() == 2, "embedding_forward: weight must be [V, H], got {}",
           weight.str());
  MT_CHECK(weight.dtype() == DType::BF16 || weight.dtype() == DType::F32,
           "embedding_forward: weight must be bf16 or f32 on CUDA, got {}", weight.str());
  check_ids(ids, "embedding_forward");
  const int64_t V = weight.size(0), H = weight.size(1), T = ids.numel();
  Tensor y = Tensor::empty({T, H}, weight.dtype(), weight.device());
  launch_embedding_forward(ids.data<int32_t>(), weight.raw(), y.raw(), T, V, H,
                           static_cast<int>(dtype_size(weight.dtype())), shard.begin, shard.size, stream());
  check_launch("embedding_forward");
  return y;
}

void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight, const VocabShard& shard) {
  check_cuda_tensors("embedding_backward_weight", {&ids, &dy, &dweight});
  MT_CHECK(dweight.defined() && dweight.ndim() == 2, "embedding_backward_weight: dweight must be [V, H], got {}",
           dweight.str());
  check_dtype(dweight, DType::F32, "dweight (f32 weight gradient on CUDA)");
  check_ids(ids, "embedding_backward_weight");
  const int64_t V = dweight.size(0), H = dweight.size(1), T = ids.numel();
  check_shape(dy, {T, H}, "dy");
  MT_CHECK(dy.dtype() == DType::BF16 || dy.dtype() == DType::F32,
           "embedding_backward_weight: dy must be bf16 or f32 on CUDA, got {}", dy.str());
  MT_CHECK(V <= std::numeric_limits<int32_t>::max(), "embedding_backward_weight: vocabulary {} too large", V);
  if (T == 0 || H == 0) return;
  const size_t bytes = embedding_backward_workspace_bytes(T, V);
  Tensor workspace = Tensor::empty({static_cast<int64_t>((bytes + 7) / 8)}, DType::I64, dweight.device());
  cudaError_t e;
  if (dy.dtype() == DType::BF16) {
    e = launch_embedding_backward(ids.data<int32_t>(), static_cast<const __nv_bfloat16*>(dy.raw()),
                                  dweight.data<float>(), T, V, H, shard.begin, workspace.raw(), workspace.nbytes(), stream());
  } else {
    e = launch_embedding_backward(ids.data<int32_t>(), dy.data<float>(), dweight.data<float>(), T, V, H, shard.begin,
                                  workspace.raw(), workspace.nbytes(), stream());
  }
  MT_CHECK(e == cudaSuccess, "embedding_backward_weight: sort or launch failed: {} ({})", cudaGetErrorName(e),
           cudaGetErrorString(e));
  check_launch("embedding_backward_weight");
}

}  // namespace moetrain::ops::cuda
