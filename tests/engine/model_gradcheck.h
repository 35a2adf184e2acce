// The whole-model gradient check every family's tests share: finite differences (float64)
// on a few elements of every parameter (all of them for small ones) against the gradient
// of one forward_backward, relative to the gradient's scale over the whole parameter.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include "engine/models/model.h"
#include "test_util.h"

namespace moetrain::testing {

// `loss`: the model's total loss on `b` (its cross-entropy mean plus the family's terms).
// `skip_zero`: names of parameters that may get no gradient (a routed expert no token took).
inline void check_model_gradients(Model& model, const Batch& b, ExpertDispatcher& d,
                                  const std::function<double()>& loss, const char* label,
                                  const std::function<bool(const std::string&)>& may_be_zero = {}) {
  zero_grads(model.parameters());
  model.forward_backward(b, d, 1.0 / static_cast<double>(b.num_targets), 1.0);
  const double h = 1e-6;
  double worst = 0;
  std::string worst_name;
  for (Parameter& p : model.parameters()) {
    double* w = p.value.data<double>();
    const double* g = p.grad.data<double>();
    const int64_t n = p.value.numel();
    const int64_t picks = std::min<int64_t>(n, 6);
    double num2 = 0, den2 = 0;
    for (int64_t j = 0; j < picks; ++j) {
      const int64_t i = j * n / picks;
      const double saved = w[i];
      w[i] = saved + h;
      const double up = loss();
      w[i] = saved - h;
      const double down = loss();
      w[i] = saved;
      const double numeric = (up - down) / (2 * h);
      num2 += (numeric - g[i]) * (numeric - g[i]);
      den2 += numeric * numeric;
    }
    // Relative to the gradient scale of the whole parameter, so tiny entries do not blow up.
    const double scale = std::sqrt(std::max(den2, dot(p.grad, p.grad) * picks / n));
    const double err = std::sqrt(num2) / std::max(scale, 1e-12);
    if (err > worst) {
      worst = err;
      worst_name = p.name;
    }
    EXPECT_LT(err, 1e-5) << p.name;
    if (may_be_zero && !may_be_zero(p.name)) {
      EXPECT_GT(dot(p.grad, p.grad), 0.0) << p.name << ": no gradient reached it";
    }
  }
  std::printf("GRADCHECK model(%s) worst=%s %.3e\n", label, worst_name.c_str(), worst);
}

}  // namespace moetrain::testing
