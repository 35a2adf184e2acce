// CUDA rotary position embedding (ops.h's RopeSpec; rope.cu has the kernel and the f32
// angle rule). x / dy bf16 [T, heads * stride], positions i32 [T]; backward is the inverse
// rotation.
#include "ops/arg_checks.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/rope_launch.h"

namespace moetrain::ops::cuda {
namespace {

Tensor rotate(const Tensor& x, const Tensor& positions, const RopeSpec& r, float sign, const char* op) {
  check_cuda_tensors(op, {&x, &positions});
  const RopeDims d = check_rope_args(op, x, positions, r);  // (no structured binding: lambdas capture these)
  const int64_t T = d.T, W = d.W, hd = d.head_dim, stride = d.stride, half = d.half;
  MT_CHECK(half <= RopeArgs::kMaxPairs, "{}: head_dim {} is larger than the kernel's {} rotary pairs allow", op,
           hd, RopeArgs::kMaxPairs);
  MT_CHECK(stride <= 65536, "{}: a head's width (stride) {} must be in [head_dim {}, 65536]", op, stride, hd);
  check_dtype(x, DType::BF16, sign > 0 ? "rope_forward x" : "rope_backward dy");
  RopeArgs a;
  a.head_dim = static_cast<int>(hd);
  a.stride = static_cast<int>(stride);
  a.theta = static_cast<float>(r.theta);
  a.scale = static_cast<float>(r.scale);
  a.interleaved = r.interleaved;
  a.given_freqs = !r.inv_freq.empty();
  for (size_t i = 0; i < r.inv_freq.size(); ++i) a.inv_freq[i] = static_cast<float>(r.inv_freq[i]);
  Tensor y = Tensor::empty(x.shape(), DType::BF16, x.device());
  launch_rope(static_cast<const __nv_bfloat16*>(x.raw()), positions.data<int32_t>(),
              static_cast<__nv_bfloat16*>(y.raw()), T, W, a, sign, stream());
  check_launch(op);
  return y;
}

}  // namespace

Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& r) {
  return rotate(x, positions, r, 1.0f, "rope_forward");
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, const RopeSpec& r) {
  return rotate(dy, positions, r, -1.0f, "rope_backward");
}

}  // namespace moetrain::ops::cuda
