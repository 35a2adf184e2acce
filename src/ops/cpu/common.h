// Shared plumbing of the CPU reference ops: dtype dispatch and argument checks.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// Calls f(T{}) with T = float or double matching `t`; other dtypes are an error naming op.
template <typename F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    default: MT_THROW("{}: CPU op needs f32 or f64 tensors, got {}", op, dtype_name(t));
  }
}

// Each defined tensor in `ts` must have dtype `t`.
inline void check_same_dtype(const char* op, DType t, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* x : ts) {
    if (x->defined()) {
      MT_CHECK(x->dtype() == t, "{}: mixed dtypes {} and {}", op, dtype_name(t), dtype_name(x->dtype()));
    }
  }
}

}  // namespace moetrain::ops::cpu
