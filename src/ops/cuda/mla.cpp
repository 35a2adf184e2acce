// CUDA MLA keys and values (ops.h; kernels in mla.cu): argument checks and allocation.
#include <climits>

#include "ops/arg_checks.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/mla_launch.h"

namespace moetrain::ops::cuda {
namespace {

const __nv_bfloat16* bf16_ptr(const Tensor& t) { return static_cast<const __nv_bfloat16*>(t.raw()); }
__nv_bfloat16* bf16_ptr(Tensor& t) { return static_cast<__nv_bfloat16*>(t.raw()); }

// What the kernels take besides the shared checks: a rotary part, rows within int.
void check_kernel_sizes(const char* op, int64_t heads, int64_t nope, int64_t v_dim, int64_t rope) {
  MT_CHECK(rope > 0, "{}: no rotary key dims (rope = {})", op, rope);
  MT_CHECK(heads * (nope + rope + v_dim) < INT_MAX, "{}: {} heads of {} + {} + {} values are too many for a row",
           op, heads, nope, rope, v_dim);
}

}  // namespace

MlaKv mla_kv_forward(const Tensor& kv, const Tensor& k_rot, int64_t heads, int64_t nope, int64_t v_dim) {
  const char* op = "mla_kv_forward";
  check_cuda_tensors(op, {&kv, &k_rot});
  const int64_t rope = check_mla_kv_forward_args(op, kv, k_rot, heads, nope, v_dim), T = kv.size(0);
  check_dtype(kv, DType::BF16, "kv");
  check_dtype(k_rot, DType::BF16, "k_rot");
  check_kernel_sizes(op, heads, nope, v_dim, rope);
  MlaKv o{Tensor::empty({T, heads * (nope + rope)}, DType::BF16, kv.device()),
          Tensor::empty({T, heads * v_dim}, DType::BF16, kv.device())};
  launch_mla_kv_forward(bf16_ptr(kv), bf16_ptr(k_rot), bf16_ptr(o.k), bf16_ptr(o.v), T, int(heads), int(nope),
                        int(rope), int(v_dim), stream());
  check_launch(op);
  return o;
}

MlaKvGrads mla_kv_backward(const Tensor& dk, const Tensor& dv, int64_t heads, int64_t nope, int64_t v_dim) {
  const char* op = "mla_kv_backward";
  check_cuda_tensors(op, {&dk, &dv});
  const int64_t rope = check_mla_kv_backward_args(op, dk, dv, heads, nope, v_dim), T = dk.size(0);
  check_kernel_sizes(op, heads, nope, v_dim, rope);
  check_dtype(dk, DType::BF16, "dk");
  check_dtype(dv, DType::BF16, "dv");
  MlaKvGrads g{Tensor::empty({T, heads * (nope + v_dim)}, DType::BF16, dk.device()),
               Tensor::empty({T, rope}, DType::BF16, dk.device())};
  launch_mla_kv_backward(bf16_ptr(dk), bf16_ptr(dv), bf16_ptr(g.dkv), bf16_ptr(g.dk_rot), T, int(heads), int(nope),
                         int(rope), int(v_dim), stream());
  check_launch(op);
  return g;
}

}  // namespace moetrain::ops::cuda
