#include "engine/parameters.h"

#include "core/rng.h"

namespace moetrain {

int64_t count_elements(const ParameterList& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.value.numel();
  return n;
}

void zero_grads(ParameterList& params) {
  for (auto& p : params) p.grad.zero_();
}

DType grad_dtype_for(DType value_dtype) { return value_dtype == DType::BF16 ? DType::F32 : value_dtype; }

void attach_masters(ParameterList& params) {
  for (auto& p : params) {
    if (p.value.dtype() == DType::BF16 && !p.master.defined()) p.master = p.value.to(DType::F32);
  }
}

void init_parameters(ParameterList& params, uint64_t seed) {
  for (auto& p : params) {
    Tensor& target = p.master_or_value();
    if (p.init_std == 0) {
      target.fill_(1.0);
    } else {
      fill_normal(target, stream_key(seed, p.name), p.init_std);
    }
    if (p.master.defined()) p.value.copy_from(p.master);
  }
}

}  // namespace moetrain
