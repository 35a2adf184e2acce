#include "engine/optim/adamw.h"

#include <cmath>

#include "ops/ops.h"

namespace moetrain {

AdamW::AdamW(const ParameterList& params, AdamWConfig cfg) : cfg_(cfg) {
  std::vector<Tensor> like;
  for (const auto& p : params) like.push_back(p.value);
  if (like.empty()) return;
  // The moments take the masters' dtype: f32 for a split master, else the value's own.
  const DType masters = params.front().has_master() ? DType::F32 : params.front().value.dtype();
  const DType dtype = cfg_.bf16_moments ? DType::BF16 : masters;
  MT_CHECK(!cfg_.bf16_moments || masters == DType::F32,
           "AdamW: bf16 moments need f32 master weights, the parameters hold {}", dtype_name(masters));
  m_ = flat_views(like, dtype);
  v_ = flat_views(like, dtype);
}

void AdamW::step(ParameterList& params, double lr, double grad_scale) {
  std::vector<size_t> all(params.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  advance();
  update(params, all, lr, grad_scale);
}

void AdamW::update(ParameterList& params, const std::vector<size_t>& indices, double lr, double grad_scale,
                   int max_sms) {
  MT_CHECK(params.size() == m_.size(), "AdamW: built for {} parameters, stepped with {}", m_.size(), params.size());
  MT_CHECK(step_ >= 1, "AdamW: update() before advance()");
  if (indices.empty()) return;
  ops::AdamWTensors t;
  for (size_t i : indices) {
    MT_CHECK(i < params.size(), "AdamW: parameter index {} of {}", i, params.size());
    Parameter& p = params[i];
    t.params.push_back(p.value);  // with a master, its high half; master_low the rest
    t.grads.push_back(p.grad);
    t.values.push_back(Tensor());
    t.lows.push_back(p.master_low);
    t.decay.push_back(p.weight_decay);
    t.m.push_back(m_[i]);
    t.v.push_back(v_[i]);
  }
  ops::adamw_update_all(t, ops::AdamWStep{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, cfg_.weight_decay, step_, grad_scale,
                                         max_sms});
}

GradNorm global_grad_norm(const ParameterList& params, double max_norm) {
  std::vector<Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad);
  return grad_norm_of(ops::sum_squares_all(grads), params, max_norm);
}

GradNorm grad_norm_of(double sq, const ParameterList& params, double max_norm) {
  GradNorm r;
  r.norm = std::sqrt(sq);
  if (!std::isfinite(r.norm)) {
    for (const auto& p : params) {
      MT_CHECK(ops::all_finite(p.grad), "gradient of {} is not finite (NaN or Inf)", p.name);
    }
    MT_THROW("global gradient norm is not finite ({})", r.norm);
  }
  if (max_norm > 0 && r.norm > max_norm) r.clip_scale = max_norm / (r.norm + 1e-6);
  return r;
}

}  // namespace moetrain
