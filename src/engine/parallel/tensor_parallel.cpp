#include "engine/parallel/tensor_parallel.h"

#include "core/error.h"
#include "engine/telemetry/collective_timer.h"

namespace moetrain {

int64_t TensorParallel::slice_rows(int64_t rows) const {
  MT_CHECK(rows % size() == 0,
           "tensor parallelism: {} token rows do not split evenly over tp = {} ranks (sequence parallelism gives each "
           "an equal slice)",
           rows, size());
  return rows / size();
}

Tensor TensorParallel::gather_rows(const Tensor& slice) const {
  MT_CHECK(slice.defined() && slice.ndim() >= 1, "tensor parallelism: gather_rows of {}", slice.str());
  Shape whole = slice.shape();
  whole[0] *= size();
  Tensor out = Tensor::empty(whole, slice.dtype(), slice.device());
  CollectiveScope timed(Collective::kTensorParallel);
  CollectiveTimer::count_bytes(Collective::kTensorParallel, static_cast<double>(slice.nbytes()) * (size() - 1));
  group_.all_gather(slice, out);
  return out;
}

Tensor TensorParallel::reduce_scatter_rows(const Tensor& partial) const {
  MT_CHECK(partial.defined() && partial.ndim() >= 1, "tensor parallelism: reduce_scatter_rows of {}", partial.str());
  Shape mine = partial.shape();
  mine[0] = slice_rows(mine[0]);
  Tensor out = Tensor::empty(mine, partial.dtype(), partial.device());
  CollectiveScope timed(Collective::kTensorParallel);
  CollectiveTimer::count_bytes(Collective::kTensorParallel, static_cast<double>(out.nbytes()) * (size() - 1));
  group_.reduce_scatter(partial, out);
  return out;
}

}  // namespace moetrain
