// Weighted combine on CUDA: host wrapper of combine.cu. expert_out, residual, y, dy and
// dexpert_out are bf16 (or all f32); the routing weights and dweight are f32.
#include "ops/cuda/combine_launch.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {
namespace {

// expert_out's rows (T*K, or at most T*K with an order) are checked in ops/dispatch.cpp.
struct Dims {
  int64_t T, K, H, R;
};
Dims check_combine(const char* op, const Tensor& expert_out, const Tensor& weight) {
  MT_CHECK(weight.defined() && weight.ndim() == 2, "{}: weight must be [T, K], got {}", op, weight.str());
  const int64_t T = weight.size(0), K = weight.size(1);
  MT_CHECK(expert_out.defined() && expert_out.ndim() == 2, "{}: expert_out must be [R, H], got {}", op,
           expert_out.str());
  MT_CHECK(expert_out.dtype() == DType::BF16 || expert_out.dtype() == DType::F32,
           "{}: expert_out must be bf16 or f32, got {}", op, expert_out.str());
  MT_CHECK(weight.dtype() == DType::F32, "{}: weight must be f32 (routing weights), got {}", op, weight.str());
  MT_CHECK(K <= INT32_MAX, "{}: K = {} is out of range", op, K);
  return {T, K, expert_out.size(1), expert_out.size(0)};
}

}  // namespace

Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual, const Tensor& order) {
  const char* op = "combine_forward";
  const auto [T, K, H, R] = check_combine(op, expert_out, weight);
  if (residual.defined()) {
    check_shape(residual, {T, H}, "combine_forward residual");
    MT_CHECK(residual.dtype() == expert_out.dtype(), "{}: residual {} must have expert_out's dtype ({})", op,
             residual.str(), dtype_name(expert_out.dtype()));
  }
  check_cuda_tensors(op, {&expert_out, &weight, &residual, &order});
  Tensor y = Tensor::empty({T, H}, expert_out.dtype(), expert_out.device());
  launch_combine_forward(expert_out.raw(), weight.data<float>(), residual.defined() ? residual.raw() : nullptr,
                         order.defined() ? order.data<int32_t>() : nullptr, T, static_cast<int>(K), R, H, y.raw(),
                         expert_out.dtype() == DType::BF16, stream());
  check_launch("combine_forward_kernel");
  return y;
}

CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight, const Tensor& order,
                              bool quantize_rows) {
  const char* op = "combine_backward";
  const auto [T, K, H, R] = check_combine(op, expert_out, weight);
  check_shape(dy, {T, H}, "combine_backward dy");
  MT_CHECK(dy.dtype() == expert_out.dtype(), "{}: dy {} must have expert_out's dtype ({})", op, dy.str(),
           dtype_name(expert_out.dtype()));
  check_cuda_tensors(op, {&dy, &expert_out, &weight, &order});
  CombineGrads g;
  g.dexpert_out = Tensor::empty({R, H}, dy.dtype(), dy.device());
  g.dweight = Tensor::empty({T, K}, DType::F32, dy.device());
  if (H == 0 && T * K > 0) {
    g.dweight.zero_();
    return g;
  }
  Fp8Codes codes{};
  if (quantize_rows && dy.dtype() == DType::BF16 && H % 128 == 0) {
    g.dexpert_out_q = empty_fp8(R, H, Fp8Blocks::kRows, dy.device());
    codes = {static_cast<uint8_t*>(g.dexpert_out_q.q.raw()), g.dexpert_out_q.scale.data<float>()};
  }
  const bool fused = launch_combine_backward(dy.raw(), expert_out.raw(), weight.data<float>(),
                                             order.defined() ? order.data<int32_t>() : nullptr, T, static_cast<int>(K),
                                             R, H, g.dexpert_out.raw(), g.dweight.data<float>(),
                                             dy.dtype() == DType::BF16, codes, stream());
  check_launch("combine_backward_kernel");
  if (!fused) g.dexpert_out_q = {};  // the caller quantizes
  return g;
}

}  // namespace moetrain::ops::cuda
