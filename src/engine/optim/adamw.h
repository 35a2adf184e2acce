// AdamW over a ParameterList: FP32 (or f64) first and second moments per parameter,
// decoupled weight decay on matrices only (Parameter::weight_decay), and global
// gradient-norm clipping.
#pragma once

#include <vector>

#include "engine/parameters.h"

namespace moetrain {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

class AdamW {
 public:
  AdamW(const ParameterList& params, AdamWConfig cfg);
  // One update of every parameter with learning rate lr; advances the step count.
  void step(ParameterList& params, double lr);
  int64_t steps_taken() const { return step_; }

 private:
  AdamWConfig cfg_;
  int64_t step_ = 0;
  std::vector<Tensor> m_, v_;
};

// The global L2 norm of all gradients; when max_norm > 0 and the norm exceeds it, scales
// every gradient by max_norm / norm. Returns the norm before clipping. A non-finite norm
// is an error naming the first parameter whose gradient is not finite.
double clip_grad_norm(ParameterList& params, double max_norm);

}  // namespace moetrain
