// CUDA AdamW (decoupled weight decay) on f32 master weights and moments; see ops.h and
// the CPU reference ops/cpu/adamw.cpp, whose math (in double, per element) this follows.
#include <cmath>

#include "ops/cuda/adamw_launch.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s) {
  MT_CHECK(param.defined(), "adamw_update: param is undefined");
  check_cuda_tensors("adamw_update", {&param, &grad, &m, &v});
  check_shape(grad, param.shape(), "adamw_update grad");
  check_shape(m, param.shape(), "adamw_update m (first moment)");
  check_shape(v, param.shape(), "adamw_update v (second moment)");
  check_dtype(param, DType::F32, "adamw_update param (f32 master weights on CUDA)");
  check_dtype(grad, DType::F32, "adamw_update grad");
  check_dtype(m, DType::F32, "adamw_update m (first moment)");
  check_dtype(v, DType::F32, "adamw_update v (second moment)");
  MT_CHECK(s.step >= 1, "adamw_update: step = {} must be >= 1 (1-based, for bias correction)", s.step);
  MT_CHECK(s.beta1 >= 0 && s.beta1 < 1 && s.beta2 >= 0 && s.beta2 < 1,
           "adamw_update: betas ({}, {}) must lie in [0, 1)", s.beta1, s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  launch_adamw(param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), param.numel(), s.lr,
               s.beta1, s.beta2, bc1, bc2, s.eps, s.weight_decay, stream());
  check_launch("adamw_update");
}

}  // namespace moetrain::ops::cuda
