// CUDA AdamW (decoupled weight decay) on f32 master weights and f32 or bf16 moments; see ops.h and
// the CPU reference ops/cpu/adamw.cpp, whose per-element f32 arithmetic (ops/adamw_math.h)
// this shares, bit for bit (for finite inputs).
#include "ops/cuda/adamw_launch.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/tensor_runs.h"

namespace moetrain::ops::cuda {
namespace {

// moments: the dtype every m and v of the call must have (f32, or bf16 for all of them).
// low: the low half of a split master (then param is its bf16 high half), or undefined.
void check_entry(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& value,
                 const Tensor& low, DType moments, const char* op) {
  MT_CHECK(param.defined(), "{}: param is undefined", op);
  check_cuda_tensors(op, {&param, &grad, &m, &v, &value, &low});
  check_shape(grad, param.shape(), "adamw grad");
  check_shape(m, param.shape(), "adamw m (first moment)");
  check_shape(v, param.shape(), "adamw v (second moment)");
  if (low.defined()) {
    check_dtype(param, DType::BF16, "adamw param (the bf16 high half of a split master)");
    check_dtype(low, DType::I16, "adamw low (the low half of a split master)");
  } else {
    check_dtype(param, DType::F32, "adamw param (f32 master weights on CUDA)");
  }
  check_dtype(grad, DType::F32, "adamw grad");
  check_dtype(m, moments, "adamw m (first moment: f32, or bf16 for every moment of the call)");
  check_dtype(v, moments, "adamw v (second moment: f32, or bf16 for every moment of the call)");
  if (value.defined()) check_dtype(value, DType::BF16, "adamw value (the bf16 weight refreshed from its master)");
}

AdamWArgs args_of(const AdamWStep& s, DType moments, const char* op) {
  MT_CHECK(s.step >= 1, "{}: step = {} must be >= 1 (1-based, for bias correction)", op, s.step);
  MT_CHECK(s.max_sms >= 0, "{}: max_sms = {} must be >= 0 (0: every multiprocessor)", op, s.max_sms);
  MT_CHECK(s.beta1 >= 0 && s.beta1 < 1 && s.beta2 >= 0 && s.beta2 < 1, "{}: betas ({}, {}) must lie in [0, 1)", op,
           s.beta1, s.beta2);
  return AdamWArgs{adamw_constants(s.lr, s.beta1, s.beta2, s.eps, s.grad_scale, s.step), s.step, moments == DType::BF16};
}

__nv_bfloat16* bf16_or_null(const Tensor& t) { return t.defined() ? static_cast<__nv_bfloat16*>(t.raw()) : nullptr; }

}  // namespace

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s) {
  const DType moments = m.defined() ? m.dtype() : DType::F32;
  check_entry(param, grad, m, v, Tensor(), Tensor(), moments, "adamw_update");
  const AdamWArgs a = args_of(s, moments, "adamw_update");
  const AdamWSegment seg{param.data<float>(), grad.data<float>(), m.raw(), v.raw(), nullptr, param.numel(),
                         s.weight_decay, m.storage_offset(), nullptr};
  launch_adamw(&seg, 1, a, s.max_sms, stream());
  check_launch("adamw_update");
}

void adamw_update_all(AdamWTensors& t, const AdamWStep& s) {
  const DType moments = !t.m.empty() && t.m[0].defined() ? t.m[0].dtype() : DType::F32;
  for (size_t i = 0; i < t.params.size(); ++i) {
    check_entry(t.params[i], t.grads[i], t.m[i], t.v[i], t.values[i], t.lows[i], moments, "adamw_update_all");
  }
  const AdamWArgs a = args_of(s, moments, "adamw_update_all");
  const auto runs = contiguous_runs({&t.params, &t.grads, &t.m, &t.v, &t.values, &t.lows},
                                    [&](size_t i, size_t j) { return t.decay[i] == t.decay[j]; });
  std::vector<AdamWSegment> segs;
  segs.reserve(runs.size());
  for (const TensorRun& r : runs) {
    const size_t i = r.first;
    if (t.lows[i].defined()) {  // a split master: the weight is its high half
      segs.push_back({nullptr, t.grads[i].data<float>(), t.m[i].raw(), t.v[i].raw(), bf16_or_null(t.params[i]),
                      r.numel, t.decay[i] ? s.weight_decay : 0.0, t.m[i].storage_offset(), t.lows[i].data<int16_t>()});
      continue;
    }
    segs.push_back({t.params[i].data<float>(), t.grads[i].data<float>(), t.m[i].raw(), t.v[i].raw(),
                    bf16_or_null(t.values[i]), r.numel, t.decay[i] ? s.weight_decay : 0.0, t.m[i].storage_offset(),
                    nullptr});
  }
  launch_adamw(segs.data(), static_cast<int>(segs.size()), a, s.max_sms, stream());
  check_launch("adamw_update_all");
}

}  // namespace moetrain::ops::cuda
