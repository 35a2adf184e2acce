#include "engine/optim/adamw.h"

#include <cmath>

#include "ops/ops.h"

namespace moetrain {

AdamW::AdamW(const ParameterList& params, AdamWConfig cfg) : cfg_(cfg) {
  for (auto p : params) {
    const Tensor& w = p.master_or_value();
    m_.push_back(Tensor::zeros(w.shape(), w.dtype(), w.device()));
    v_.push_back(Tensor::zeros(w.shape(), w.dtype(), w.device()));
  }
}

void AdamW::step(ParameterList& params, double lr) {
  MT_CHECK(params.size() == m_.size(), "AdamW: built for {} parameters, stepped with {}", m_.size(), params.size());
  ++step_;
  for (size_t i = 0; i < params.size(); ++i) {
    ops::AdamWStep s{lr, cfg_.beta1, cfg_.beta2, cfg_.eps, params[i].weight_decay ? cfg_.weight_decay : 0.0, step_};
    ops::adamw_update(params[i].master_or_value(), params[i].grad, m_[i], v_[i], s);
    if (params[i].master.defined()) ops::cast_into(params[i].value, params[i].master);
  }
}

double clip_grad_norm(ParameterList& params, double max_norm) {
  double sq = 0;
  for (const auto& p : params) sq += ops::sum_squares(p.grad);
  const double norm = std::sqrt(sq);
  if (!std::isfinite(norm)) {
    for (const auto& p : params) {
      MT_CHECK(ops::all_finite(p.grad), "gradient of {} is not finite (NaN or Inf)", p.name);
    }
    MT_THROW("global gradient norm is not finite ({})", norm);
  }
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& p : params) ops::scale_(p.grad, scale);
  }
  return norm;
}

}  // namespace moetrain
