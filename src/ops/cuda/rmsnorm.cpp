// CUDA RMSNorm over the last D = w.numel() elements (rmsnorm.cu has the kernels).
// x, dy, w, y, dx are bf16; rstd is f32 [R] (a saved statistic: ops.h's CUDA paragraph,
// which overrides "rstd in x's dtype" of the CPU path); dw is f32, accumulated +=.
// y = x * rstd * w is formed in f32 and rounded once (Hugging Face rounds x * rstd to bf16
// before the weight multiply; the CPU reference does not, and neither do we).
#include <cstdlib>

#include "ops/arg_checks.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/rmsnorm_launch.h"

namespace moetrain::ops::cuda {
namespace {

using bf16_t = __nv_bfloat16;

int64_t row_count(const Tensor& x, const Tensor& w, const char* op, const char* wname) {
  MT_CHECK(x.defined() && w.defined(), "{}: x and {} must be defined", op, wname);
  MT_CHECK(w.ndim() == 1 && w.numel() > 0, "{}: {} must be 1-D and non-empty, got {}", op, wname, w.str());
  const int64_t D = w.numel();
  MT_CHECK(x.ndim() >= 1 && x.size(-1) % D == 0, "{}: x {} cannot be read as rows of {}'s size {}", op, x.str(),
           wname, D);
  return x.numel() / D;
}

const bf16_t* bf(const Tensor& t) { return static_cast<const bf16_t*>(t.raw()); }
bf16_t* bf_mut(Tensor& t) { return static_cast<bf16_t*>(t.raw()); }

}  // namespace

namespace {

// rmsnorm_forward, and with `fp8` its output quantized per 1 x 128 tile in the same pass (two
// passes where the kernel cannot fuse them: unaligned views).
RmsNormOut rmsnorm_forward_impl(const char* op, const Tensor& x, const Tensor& w, double eps, bool fp8) {
  check_cuda_tensors(op, {&x, &w});
  const int64_t R = row_count(x, w, op, "w"), D = w.numel();
  check_dtype(x, DType::BF16, fmt::format("{} x", op).c_str());
  check_dtype(w, DType::BF16, fmt::format("{} w", op).c_str());
  RmsNormOut o{Tensor::empty(x.shape(), DType::BF16, x.device()), Tensor::empty({R}, DType::F32, x.device())};
  if (fp8) {
    o.y_q = Fp8Tensor{Tensor::empty({R, D}, DType::F8E4M3, x.device()),
                      Tensor::empty(fp8_scale_shape(R, D, Fp8Blocks::kRows), DType::F32, x.device()), Fp8Blocks::kRows};
  }
  const bool fused = launch_rmsnorm_forward(bf(x), bf(w), bf_mut(o.y), o.rstd.data<float>(), R, D,
                                            static_cast<float>(eps), stream(),
                                            fp8 ? static_cast<uint8_t*>(o.y_q.q.raw()) : nullptr,
                                            fp8 ? o.y_q.scale.data<float>() : nullptr);
  check_launch(op);
  if (fp8 && !fused) o.y_q = cuda::quantize_fp8(o.y, Fp8Blocks::kRows);  // unaligned views: a second pass
  return o;
}

}  // namespace

RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  return rmsnorm_forward_impl("rmsnorm_forward", x, w, eps, false);
}

RmsNormOut rmsnorm_forward_fp8(const Tensor& x, const Tensor& w, double eps) {
  return rmsnorm_forward_impl("rmsnorm_forward_fp8", x, w, eps, true);
}

Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& residual) {
  check_cuda_tensors("rmsnorm_backward_input", {&dy, &x, &w, &rstd, &residual});
  const int64_t R = row_count(x, w, "rmsnorm_backward_input", "w"), D = w.numel();
  check_shape(dy, x.shape(), "dy");
  check_shape(rstd, {R}, "rstd");
  check_dtype(dy, DType::BF16, "rmsnorm_backward_input dy");
  check_dtype(x, DType::BF16, "rmsnorm_backward_input x");
  check_dtype(w, DType::BF16, "rmsnorm_backward_input w");
  check_dtype(rstd, DType::F32, "rmsnorm_backward_input rstd");
  if (residual.defined()) check_dtype(residual, DType::BF16, "rmsnorm_backward_input residual");
  Tensor dx = Tensor::empty(x.shape(), DType::BF16, x.device());
  launch_rmsnorm_backward_input(bf(dy), bf(x), bf(w), rstd.data<float>(), residual.defined() ? bf(residual) : nullptr,
                                bf_mut(dx), R, D, stream());
  check_launch("rmsnorm_backward_input");
  return dx;
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw) {
  check_cuda_tensors("rmsnorm_backward_weight", {&dy, &x, &rstd, &dw});
  const int64_t R = row_count(x, dw, "rmsnorm_backward_weight", "dw"), D = dw.numel();
  check_shape(dy, x.shape(), "dy");
  check_shape(rstd, {R}, "rstd");
  check_dtype(dy, DType::BF16, "rmsnorm_backward_weight dy");
  check_dtype(x, DType::BF16, "rmsnorm_backward_weight x");
  check_dtype(rstd, DType::F32, "rmsnorm_backward_weight rstd");
  check_dtype(dw, DType::F32, "rmsnorm_backward_weight dw (f32 weight gradient on CUDA)");
  if (R == 0) return;
  Tensor scratch = Tensor::empty({rmsnorm_backward_weight_scratch_floats(R, D)}, DType::F32, x.device());
  launch_rmsnorm_backward_weight(bf(dy), bf(x), rstd.data<float>(), dw.data<float>(), R, D,
                                 scratch.data<float>(), stream());
  check_launch("rmsnorm_backward_weight");
}

// Per-head norm then RoPE: one pass when rmsnorm_rope_fusable (head_dim 128), else the two
// ops in turn (each checks its own arguments).
namespace {
bool fusable(const Tensor& x, const Tensor& w, const Tensor& positions, int64_t head_dim, const char* op) {
  check_cuda_tensors(op, {&x, &w, &positions});
  static const bool two_ops = [] {  // MOETRAIN_NORM_ROPE_TWO_OPS=1: the ops in turn, to compare
    const char* v = std::getenv("MOETRAIN_NORM_ROPE_TWO_OPS");
    return v != nullptr && *v != '\0' && *v != '0';
  }();
  if (two_ops) return false;
  if (!(x.defined() && w.defined() && x.dtype() == DType::BF16 && w.dtype() == DType::BF16 && x.ndim() == 2 &&
        w.ndim() == 1 && head_dim > 0 && x.size(1) % head_dim == 0)) {
    return false;
  }
  // The output's alignment is x's stand-in: it is a fresh pool allocation, always aligned.
  if (!rmsnorm_rope_fusable(bf(x), bf(w), bf(x), w.numel(), head_dim)) return false;
  check_shape(positions, {x.size(0)}, "positions");
  check_dtype(positions, DType::I32, "positions");
  return true;
}
}  // namespace

RmsNormOut rmsnorm_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& positions,
                                int64_t head_dim, double theta) {
  if (!fusable(x, w, positions, head_dim, "rmsnorm_rope_forward")) {
    RmsNormOut n = rmsnorm_forward(x, w, eps);
    n.y = cuda::rope_forward(n.y, positions, RopeSpec{head_dim, theta});
    return n;
  }
  MT_CHECK(theta > 0, "rmsnorm_rope_forward: theta must be positive, got {}", theta);
  const int64_t R = x.numel() / head_dim, heads = x.size(1) / head_dim;
  RmsNormOut o{Tensor::empty(x.shape(), DType::BF16, x.device()), Tensor::empty({R}, DType::F32, x.device())};
  launch_rmsnorm_rope_forward(bf(x), bf(w), positions.data<int32_t>(), bf_mut(o.y), o.rstd.data<float>(), R, heads,
                              static_cast<float>(eps), static_cast<float>(theta), stream());
  check_launch("rmsnorm_rope_forward");
  return o;
}

RmsNormRopeGrads rmsnorm_rope_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       const Tensor& positions, int64_t head_dim, double theta) {
  check_cuda_tensors("rmsnorm_rope_backward", {&dy, &rstd});
  // dy bf16, or f32 as the attention backward's one-pass dQ comes (read as it is).
  const bool dy_f32 = dy.defined() && dy.dtype() == DType::F32;
  const bool one_pass = fusable(x, w, positions, head_dim, "rmsnorm_rope_backward") && dy.defined() &&
                        (dy.dtype() == DType::BF16 || dy_f32) &&
                        rmsnorm_rope_fusable(bf(x), bf(w), static_cast<const __nv_bfloat16*>(dy.raw()), w.numel(),
                                             head_dim);
  RmsNormRopeGrads g;
  g.dw = Tensor::zeros({w.defined() ? w.numel() : 0}, DType::F32, x.device());
  if (!one_pass) {
    const Tensor dn = cuda::rope_backward(dy_f32 ? dy.to(DType::BF16) : dy, positions, RopeSpec{head_dim, theta});
    g.dx = rmsnorm_backward_input(dn, x, w, rstd, Tensor());
    rmsnorm_backward_weight(dn, x, rstd, g.dw);
    return g;
  }
  const int64_t R = x.numel() / head_dim, heads = x.size(1) / head_dim;
  check_shape(dy, x.shape(), "dy");
  check_shape(rstd, {R}, "rstd");
  check_dtype(rstd, DType::F32, "rmsnorm_rope_backward rstd");
  MT_CHECK(theta > 0, "rmsnorm_rope_backward: theta must be positive, got {}", theta);
  g.dx = Tensor::empty(x.shape(), DType::BF16, x.device());
  if (R == 0) return g;
  Tensor scratch = Tensor::empty({rmsnorm_rope_backward_scratch_floats(R)}, DType::F32, x.device());
  if (dy_f32) {
    launch_rmsnorm_rope_backward(dy.data<float>(), bf(x), bf(w), rstd.data<float>(), positions.data<int32_t>(),
                                 bf_mut(g.dx), g.dw.data<float>(), R, heads, static_cast<float>(theta),
                                 scratch.data<float>(), stream());
  } else {
    launch_rmsnorm_rope_backward(bf(dy), bf(x), bf(w), rstd.data<float>(), positions.data<int32_t>(), bf_mut(g.dx),
                                 g.dw.data<float>(), R, heads, static_cast<float>(theta), scratch.data<float>(),
                                 stream());
  }
  check_launch("rmsnorm_rope_backward");
  return g;
}

}  // namespace moetrain::ops::cuda
