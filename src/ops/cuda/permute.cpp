// Token permutation by expert on CUDA: host wrapper of permute.cu. permutation_by_expert
// leaves the counts on the device (no host synchronisation), so expert ids are not checked
// here: an id outside [0, E) is skipped by the kernels (not counted, its rows not written).
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/permute_launch.h"

namespace moetrain::ops::cuda {
namespace {

// The backend's part of the checks (shapes: ops/dispatch.cpp): i32 indices, everything on
// the device; returns H.
int64_t check_rows(const Permutation& p, const Tensor& t, const char* op) {
  check_dtype(p.source_token, DType::I32, "permutation source_token");
  check_dtype(p.slot_row, DType::I32, "permutation slot_row");
  check_cuda_tensors(op, {&t, &p.source_token, &p.slot_row});
  return t.size(1);
}

}  // namespace

Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts) {
  const char* op = "permutation_by_expert";
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2, "{}: topk_idx must be [T, K], got {}", op, topk_idx.str());
  check_dtype(topk_idx, DType::I32, "permutation_by_expert topk_idx");
  check_cuda_tensors(op, {&topk_idx});
  MT_CHECK(num_experts >= 1 && num_experts <= kPermuteMaxExperts,
           "{}: num_experts = {} must be in [1, {}] on CUDA", op, num_experts, kPermuteMaxExperts);
  Permutation p;
  p.num_tokens = topk_idx.size(0);
  p.top_k = topk_idx.size(1);
  const int64_t NK = p.num_tokens * p.top_k;
  MT_CHECK(NK <= INT32_MAX, "{}: T*K = {} rows exceed the i32 row index range", op, NK);
  const Device dev = topk_idx.device();
  p.expert_counts = Tensor::empty({num_experts}, DType::I64, dev);
  p.source_token = Tensor::empty({NK}, DType::I32, dev);
  p.slot_row = Tensor::empty({NK}, DType::I32, dev);
  const int E = static_cast<int>(num_experts);
  Tensor workspace = Tensor::empty({permutation_workspace_words(NK, E)}, DType::I32, dev);
  launch_permutation(topk_idx.data<int32_t>(), NK, static_cast<int>(p.top_k), E, p.expert_counts.data<int64_t>(),
                     p.slot_row.data<int32_t>(), p.source_token.data<int32_t>(), workspace.data<int32_t>(), stream());
  check_launch("permutation_by_expert kernels");
  return p;  // the workspace is freed in stream order, after the kernels
}

Tensor expert_ids_in_range(const Tensor& topk_idx, int64_t first, int64_t count) {
  const char* op = "expert_ids_in_range";
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2, "{}: topk_idx must be [T, K], got {}", op, topk_idx.str());
  check_dtype(topk_idx, DType::I32, "expert_ids_in_range topk_idx");
  check_cuda_tensors(op, {&topk_idx});
  Tensor out = Tensor::empty(topk_idx.shape(), DType::I32, topk_idx.device());
  launch_expert_ids_in_range(topk_idx.data<int32_t>(), topk_idx.numel(), static_cast<int32_t>(first),
                             static_cast<int32_t>(count), out.data<int32_t>(), stream());
  check_launch("expert_ids_in_range_kernel");
  return out;
}

Tensor permute_forward(const Tensor& x, const Permutation& p) {
  const int64_t H = check_rows(p, x, "permute_forward");
  const int64_t R = p.permuted_rows();
  Tensor xp = Tensor::empty({R, H}, x.dtype(), x.device());
  launch_copy_rows(x.raw(), xp.raw(), p.source_token.data<int32_t>(), R, p.num_tokens,
                   H * static_cast<int64_t>(dtype_size(x.dtype())), /*scatter=*/false, stream());
  check_launch("copy_rows_kernel (permute_forward)");
  return xp;
}

Fp8Tensor permute_forward_fp8(const Fp8Tensor& x, const Permutation& p) {
  check_cuda_tensors("permute_forward_fp8", {&x.q, &x.scale});
  const int64_t R = p.permuted_rows(), L = x.scale.size(0);
  Fp8Tensor out{cuda::permute_forward(x.q, p), Tensor::empty({L, R}, DType::F32, x.q.device()), Fp8Blocks::kRows};
  launch_gather_columns(x.scale.data<float>(), L, p.num_tokens, p.source_token.data<int32_t>(), R,
                        out.scale.data<float>(), stream());
  check_launch("gather_columns_kernel (permute_forward_fp8)");
  return out;
}

Tensor permute_backward(const Tensor& dxp, const Permutation& p) {
  const int64_t H = check_rows(p, dxp, "permute_backward");
  MT_CHECK(dxp.dtype() == DType::BF16 || dxp.dtype() == DType::F32, "permute_backward: dxp must be bf16 or f32, got {}",
           dxp.str());
  MT_CHECK(p.top_k <= INT32_MAX, "permute_backward: top_k = {} is out of range", p.top_k);
  Tensor dx = Tensor::empty({p.num_tokens, H}, dxp.dtype(), dxp.device());
  launch_permute_backward(dxp.raw(), p.slot_row.data<int32_t>(), p.num_tokens, static_cast<int>(p.top_k),
                          p.permuted_rows(), H, dx.raw(), dxp.dtype() == DType::BF16, stream());
  check_launch("permute_backward_kernel");
  return dx;
}

Tensor take_rows(const Tensor& x, const Tensor& index) {
  check_cuda_tensors("take_rows", {&x, &index});
  Shape shape = x.shape();
  const int64_t R = shape[0], N = index.size(0);
  shape[0] = N;
  Tensor y = Tensor::zeros(shape, x.dtype(), x.device());  // rows whose index is outside stay zero
  if (N == 0 || R == 0 || x.numel() == 0) return y;
  launch_copy_rows(x.raw(), y.raw(), index.data<int32_t>(), N, R, x.nbytes() / R, /*scatter=*/false, stream());
  check_launch("copy_rows_kernel (take_rows)");
  return y;
}

Tensor unpermute_forward(const Tensor& yp, const Permutation& p) {
  const int64_t H = check_rows(p, yp, "unpermute_forward");
  const int64_t NK = p.num_tokens * p.top_k, R = p.permuted_rows();
  // Absent pairs' rows are zero: the gather skips them.
  Tensor y = R == NK ? Tensor::empty({NK, H}, yp.dtype(), yp.device()) : Tensor::zeros({NK, H}, yp.dtype(), yp.device());
  launch_copy_rows(yp.raw(), y.raw(), p.slot_row.data<int32_t>(), NK, R,
                   H * static_cast<int64_t>(dtype_size(yp.dtype())), /*scatter=*/false, stream());
  check_launch("copy_rows_kernel (unpermute_forward)");
  return y;
}

Tensor unpermute_backward(const Tensor& dy, const Permutation& p) {
  const int64_t H = check_rows(p, dy, "unpermute_backward");
  const int64_t NK = p.num_tokens * p.top_k, R = p.permuted_rows();
  // slot_row is a bijection: the scatter writes each kept expert-order row exactly once.
  Tensor dyp = Tensor::empty({R, H}, dy.dtype(), dy.device());
  launch_copy_rows(dy.raw(), dyp.raw(), p.slot_row.data<int32_t>(), NK, R,
                   H * static_cast<int64_t>(dtype_size(dy.dtype())), /*scatter=*/true, stream());
  check_launch("copy_rows_kernel (unpermute_backward)");
  return dyp;
}

}  // namespace moetrain::ops::cuda
