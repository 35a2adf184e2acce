// AdamW over a ParameterList: FP32 (or f64, or with bf16_moments bf16) first and second
// moments per parameter (views of two flat buffers), decoupled weight decay on matrices only (Parameter::weight_decay),
// and global gradient-norm clipping folded into the update as a gradient scale. On the GPU
// a step is one whole-list launch (ops::adamw_update_all) that also refreshes the bf16
// weights from their f32 masters.
#pragma once

#include <vector>

#include "engine/parameters.h"

namespace moetrain {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  // Moments in bf16 next to f32 masters (half the moment memory and traffic; stochastic
  // rounding keeps them unbiased), instead of the masters' dtype.
  bool bf16_moments = false;
};

class AdamW {
 public:
  AdamW(const ParameterList& params, AdamWConfig cfg);
  // One update of every parameter with learning rate lr, each gradient multiplied by
  // grad_scale first (the clipping factor); advances the step count.
  void step(ParameterList& params, double lr, double grad_scale = 1.0);
  // The same step in parts: advance() counts it, then update() does the parameters whose
  // indices are given (every parameter exactly once per step, in any grouping: the update
  // is element-wise, so the result is the same).
  void advance() { ++step_; }
  // max_sms: see ops::AdamWStep (0: the whole GPU).
  void update(ParameterList& params, const std::vector<size_t>& indices, double lr, double grad_scale,
              int max_sms = 0);
  int64_t steps_taken() const { return step_; }
  // The moments, one per parameter in list order (views; checkpoints read and write them).
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }

 private:
  AdamWConfig cfg_;
  int64_t step_ = 0;
  std::vector<Tensor> m_, v_;
};

// The global L2 norm of all gradients (one host wait on the GPU) and the factor that clips
// it: max_norm / (norm + 1e-6) when max_norm > 0 and the norm exceeds it, else 1. The
// gradients are not modified. A non-finite norm is an error naming the first parameter
// whose gradient is not finite.
struct GradNorm {
  double norm = 0;
  double clip_scale = 1;
};
GradNorm global_grad_norm(const ParameterList& params, double max_norm);
// The same from a norm already summed (sum of squares `sq`): throws as above, naming the
// parameter, when it is not finite.
GradNorm grad_norm_of(double sq, const ParameterList& params, double max_norm);

}  // namespace moetrain
