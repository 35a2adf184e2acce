// Router on CUDA: host wrapper (checks, allocation) of the kernels in router.cu.
// logits bf16 (or f32) -> probs f32, topk_idx i32, topk_weight f32; the backward's dlogits
// is bf16 (an activation gradient, ops.h's CUDA contract; RouterOut does not record the
// logits' dtype).
#include <string>
#include <utility>

#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/router_launch.h"

namespace moetrain::ops::cuda {
namespace {

// A router forward's logits, bias (called `bias_name` in errors) and k (both routers take
// the same ones): returns T, E.
std::pair<int64_t, int64_t> check_forward(const char* op, const Tensor& logits, const Tensor& bias,
                                          const char* bias_name, int64_t k) {
  MT_CHECK(logits.defined() && logits.ndim() == 2, "{}: logits must be [T, E], got {}", op, logits.str());
  MT_CHECK(logits.dtype() == DType::BF16 || logits.dtype() == DType::F32, "{}: logits must be bf16 or f32, got {}",
           op, logits.str());
  check_cuda_tensors(op, {&logits, &bias});
  const int64_t T = logits.size(0), E = logits.size(1);
  MT_CHECK(k >= 1 && k <= E, "{}: top_k = {} must be in [1, num_experts = {}]", op, k, E);
  if (bias.defined()) {
    check_shape(bias, {E}, bias_name);
    check_dtype(bias, DType::F32, bias_name);
  }
  MT_CHECK(E <= kRouterMaxExperts, "{}: logits {} has {} experts; the CUDA router takes at most {}", op,
           logits.str(), E, kRouterMaxExperts);
  return {T, E};
}

struct BackwardDims {
  int64_t T, E, K;
};

// A router backward's arguments against its forward's outputs (both routers' backwards
// take the same ones); names in errors are `op`'s.
BackwardDims check_backward(const char* op, const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd) {
  const std::string n = op;
  MT_CHECK(fwd.probs.defined() && fwd.probs.ndim() == 2, "{}: fwd.probs must be [T, E], got {}", op, fwd.probs.str());
  const int64_t T = fwd.probs.size(0), E = fwd.probs.size(1);
  MT_CHECK(fwd.topk_idx.defined() && fwd.topk_idx.ndim() == 2 && fwd.topk_idx.size(0) == T,
           "{}: fwd.topk_idx must be [T = {}, K], got {}", op, T, fwd.topk_idx.str());
  const int64_t K = fwd.topk_idx.size(1);
  check_dtype(fwd.probs, DType::F32, (n + " fwd.probs").c_str());
  check_dtype(fwd.topk_idx, DType::I32, (n + " fwd.topk_idx").c_str());
  MT_CHECK(dtopk_weight.defined(), "{}: dtopk_weight is undefined", op);
  check_shape(dtopk_weight, {T, K}, (n + " dtopk_weight").c_str());
  check_dtype(dtopk_weight, DType::F32, (n + " dtopk_weight").c_str());
  if (dprobs.defined()) {
    check_shape(dprobs, {T, E}, (n + " dprobs").c_str());
    check_dtype(dprobs, DType::F32, (n + " dprobs").c_str());
  }
  MT_CHECK(E <= kRouterMaxExperts, "{}: {} experts; the CUDA router takes at most {}", op, E, kRouterMaxExperts);
  check_cuda_tensors(op, {&dtopk_weight, &dprobs, &fwd.probs, &fwd.topk_idx});
  return {T, E, K};
}

}  // namespace

RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob, const Tensor& selection_bias) {
  const std::pair<int64_t, int64_t> te = check_forward("router_forward", logits, selection_bias, "router_forward selection_bias", k);
  const int64_t T = te.first, E = te.second;
  RouterOut out;
  out.probs = Tensor::empty({T, E}, DType::F32, logits.device());
  out.topk_idx = Tensor::empty({T, k}, DType::I32, logits.device());
  out.topk_weight = Tensor::empty({T, k}, DType::F32, logits.device());
  launch_router_forward(logits.raw(), logits.dtype() == DType::BF16,
                        selection_bias.defined() ? selection_bias.data<float>() : nullptr, T, static_cast<int>(E),
                        static_cast<int>(k), norm_topk_prob, out.probs.data<float>(), out.topk_idx.data<int32_t>(),
                        out.topk_weight.data<float>(), stream());
  check_launch("router_forward_kernel");
  return out;
}

Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd, bool norm_topk_prob) {
  const BackwardDims dims = check_backward("router_backward", dtopk_weight, dprobs, fwd);
  const int64_t T = dims.T, E = dims.E, K = dims.K;
  // Expert ids are not re-checked here (that would wait for the device): ids outside
  // [0, E) from a corrupt fwd.topk_idx contribute nothing.
  Tensor dlogits = Tensor::empty({T, E}, DType::BF16, fwd.probs.device());
  launch_router_backward(dtopk_weight.data<float>(), dprobs.defined() ? dprobs.data<float>() : nullptr,
                         fwd.probs.data<float>(), fwd.topk_idx.data<int32_t>(), T, static_cast<int>(E),
                         static_cast<int>(K), norm_topk_prob, dlogits.raw(), /*out_bf16=*/true, stream());
  check_launch("router_backward_kernel");
  return dlogits;
}

RouterOut router_sigmoid_forward(const Tensor& logits, const Tensor& bias, int64_t k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk_prob, double scaling) {
  const char* op = "router_sigmoid_forward";
  const std::pair<int64_t, int64_t> te = check_forward(op, logits, bias, "router_sigmoid_forward bias", k);
  const int64_t T = te.first, E = te.second;
  MT_CHECK(n_group >= 1 && n_group <= 32 && E % n_group == 0 && (n_group == 1 || E / n_group >= 2),
           "{}: n_group = {} must divide num_experts = {} into groups of 2 or more (at most 32 groups)", op, n_group,
           E);
  MT_CHECK(topk_group >= 1 && topk_group <= n_group, "{}: topk_group = {} must be in [1, n_group = {}]", op,
           topk_group, n_group);
  RouterOut out;
  out.probs = Tensor::empty({T, E}, DType::F32, logits.device());
  out.topk_idx = Tensor::empty({T, k}, DType::I32, logits.device());
  out.topk_weight = Tensor::empty({T, k}, DType::F32, logits.device());
  launch_router_sigmoid_forward(logits.raw(), logits.dtype() == DType::BF16, bias.defined() ? bias.data<float>() : nullptr,
                                T, static_cast<int>(E), static_cast<int>(k), static_cast<int>(n_group),
                                static_cast<int>(topk_group), norm_topk_prob, static_cast<float>(scaling),
                                out.probs.data<float>(), out.topk_idx.data<int32_t>(), out.topk_weight.data<float>(),
                                stream());
  check_launch("router_sigmoid_forward_kernel");
  return out;
}

Tensor router_sigmoid_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                               bool norm_topk_prob, double scaling) {
  // Ids outside [0, E) (a corrupt fwd.topk_idx) contribute nothing, as in router_backward.
  const BackwardDims dims = check_backward("router_sigmoid_backward", dtopk_weight, dprobs, fwd);
  const int64_t T = dims.T, E = dims.E, K = dims.K;
  Tensor dlogits = Tensor::empty({T, E}, DType::BF16, fwd.probs.device());
  launch_router_sigmoid_backward(dtopk_weight.data<float>(), dprobs.defined() ? dprobs.data<float>() : nullptr,
                                 fwd.probs.data<float>(), fwd.topk_idx.data<int32_t>(), T, static_cast<int>(E),
                                 static_cast<int>(K), norm_topk_prob, static_cast<float>(scaling), dlogits.raw(),
                                 /*out_bf16=*/true, stream());
  check_launch("router_sigmoid_backward_kernel");
  return dlogits;
}

}  // namespace moetrain::ops::cuda
