#include "engine/parallel/expert_dispatch.h"

#include "engine/telemetry/stage_timer.h"

namespace moetrain {

DispatchOut LocalDispatcher::dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts,
                                      DispatchState& st) {
  StageScope t(Stage::kRouterPermute);
  st.perm = ops::permutation_by_expert(topk_idx, num_experts);
  return {ops::permute_forward(x, st.perm), st.perm.expert_counts};
}

Tensor LocalDispatcher::combine(const Tensor& expert_rows, DispatchState& st) {
  StageScope t(Stage::kCombine);
  return ops::unpermute_forward(expert_rows, st.perm);
}

Tensor LocalDispatcher::combine_backward(const Tensor& dout, DispatchState& st) {
  StageScope t(Stage::kCombine);
  return ops::unpermute_backward(dout, st.perm);
}

Tensor LocalDispatcher::dispatch_backward(const Tensor& drows, DispatchState& st) {
  StageScope t(Stage::kRouterPermute);
  return ops::permute_backward(drows, st.perm);
}

}  // namespace moetrain
