// ExpertDispatcher: stages 2 (dispatch) and 4 (combine) of the decoder layer contract.
//
// Dispatch sends every routed (token, slot) copy to the rank holding its expert, grouped
// by expert; combine brings the expert outputs back in (token, slot) order. The engine
// owns these stages so a schedule can run them on a communication stream while another
// micro-batch computes. With one process they are local permutations (LocalDispatcher);
// the all-to-all version arrives with expert parallelism.
#pragma once

#include "ops/ops.h"

namespace moetrain {

// What a dispatch remembers for its combine and for both backwards.
struct DispatchState {
  ops::Permutation perm;
};

struct DispatchOut {
  Tensor rows;    // [N, H] token copies grouped by local expert
  Tensor counts;  // i64 [local experts], rows per expert
};

class ExpertDispatcher {
 public:
  virtual ~ExpertDispatcher() = default;
  virtual int64_t num_local_experts(int64_t num_experts) const = 0;
  // x [T, H], topk_idx i32 [T, K] -> rows grouped by expert.
  virtual DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) = 0;
  // Expert outputs [N, H] -> [T*K, H] in (t, k) order.
  virtual Tensor combine(const Tensor& expert_rows, DispatchState& st) = 0;
  // Gradient of combine: d[T*K, H] in (t, k) order -> d rows [N, H].
  virtual Tensor combine_backward(const Tensor& dout, DispatchState& st) = 0;
  // Gradient of dispatch: d rows [N, H] -> dx [T, H].
  virtual Tensor dispatch_backward(const Tensor& drows, DispatchState& st) = 0;
};

// One process: every expert is local; dispatch and combine are permutations.
class LocalDispatcher final : public ExpertDispatcher {
 public:
  int64_t num_local_experts(int64_t num_experts) const override { return num_experts; }
  DispatchOut dispatch(const Tensor& x, const Tensor& topk_idx, int64_t num_experts, DispatchState& st) override;
  Tensor combine(const Tensor& expert_rows, DispatchState& st) override;
  Tensor combine_backward(const Tensor& dout, DispatchState& st) override;
  Tensor dispatch_backward(const Tensor& drows, DispatchState& st) override;
};

}  // namespace moetrain
