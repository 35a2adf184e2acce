#include "engine/parameters.h"

#include "core/rng.h"
#include "ops/ops.h"

namespace moetrain {

int64_t count_elements(const ParameterList& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.value.numel();
  return n;
}

void zero_grads(ParameterList& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (auto& p : params) grads.push_back(p.grad);
  ops::zero_all(grads);
}

std::vector<Tensor> flat_views(const std::vector<Tensor>& like, DType dtype) {
  if (like.empty()) return {};
  int64_t total = 0;
  for (const Tensor& t : like) total += t.numel();
  Tensor flat = Tensor::zeros({total}, dtype, like.front().device());
  std::vector<Tensor> views;
  views.reserve(like.size());
  int64_t at = 0;
  for (const Tensor& t : like) {
    views.push_back(flat.slice(at, at + t.numel()).view(t.shape()));
    at += t.numel();
  }
  return views;
}

DType grad_dtype_for(DType value_dtype) { return value_dtype == DType::BF16 ? DType::F32 : value_dtype; }

void attach_masters(ParameterList& params) {
  std::vector<Parameter*> need;
  std::vector<Tensor> values;
  for (auto& p : params) {
    if (p.value.dtype() == DType::BF16 && !p.master.defined()) {
      need.push_back(&p);
      values.push_back(p.value);
    }
  }
  std::vector<Tensor> masters = flat_views(values, DType::F32);
  for (size_t i = 0; i < need.size(); ++i) {
    masters[i].copy_from(values[i]);
    need[i]->master = masters[i];
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
