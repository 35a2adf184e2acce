// CUDA rotary position embedding, rotate-half (rope.cu has the kernel and the f32 angle
// rule). x / dy bf16 [T, heads * head_dim], positions i32 [T]; backward is the inverse
// rotation.
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/rope_launch.h"

namespace moetrain::ops::cuda {
namespace {

Tensor rotate(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta, float sign, const char* op) {
  check_cuda_tensors(op, {&x, &positions});
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: input must be [T, heads*head_dim], got {}", op, x.str());
  MT_CHECK(head_dim > 0 && head_dim % 2 == 0, "{}: head_dim must be positive and even, got {}", op, head_dim);
  MT_CHECK(head_dim <= 8192, "{}: head_dim {} is larger than the kernel's shared cos/sin table allows", op,
           head_dim);
  MT_CHECK(x.size(1) % head_dim == 0, "{}: width {} of {} is not a multiple of head_dim {}", op, x.size(1),
           x.str(), head_dim);
  MT_CHECK(theta > 0, "{}: theta must be positive, got {}", op, theta);
  check_dtype(x, DType::BF16, sign > 0 ? "rope_forward x" : "rope_backward dy");
  const int64_t T = x.size(0), W = x.size(1);
  check_shape(positions, {T}, "positions");
  check_dtype(positions, DType::I32, "positions");
  Tensor y = Tensor::empty(x.shape(), DType::BF16, x.device());
  launch_rope(static_cast<const __nv_bfloat16*>(x.raw()), positions.data<int32_t>(),
              static_cast<__nv_bfloat16*>(y.raw()), T, W, head_dim, static_cast<float>(theta), sign, stream());
  check_launch(op);
  return y;
}

}  // namespace

Tensor rope_forward(const Tensor& x, const Tensor& positions, int64_t head_dim, double theta) {
  return rotate(x, positions, head_dim, theta, 1.0f, "rope_forward");
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, int64_t head_dim, double theta) {
  return rotate(dy, positions, head_dim, theta, -1.0f, "rope_backward");
}

}  // namespace moetrain::ops::cuda
