#include "engine/parallel/tensor_parallel.h"

#include <vector>

#include "core/error.h"
#include "ops/ops.h"
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

Tensor TensorParallel::gather_rows(const Tensor& slice, const EachSlice& each) const {
  MT_CHECK(slice.defined() && slice.ndim() >= 1, "tensor parallelism: gather_rows of {}", slice.str());
  const int R = size(), r = rank();
  const int64_t n = slice.size(0);
  Shape whole_shape = slice.shape();
  whole_shape[0] *= R;
  Tensor whole = Tensor::empty(whole_shape, slice.dtype(), slice.device());
  Tensor in_hand = whole.slice(r * n, (r + 1) * n);
  in_hand.copy_from(slice);
  for (int s = 0; s < R; ++s) {
    const int owner = (r - s + R) % R, next_owner = (r - s - 1 + R) % R;
    Ring::Hop hop;
    Tensor arriving;
    if (s + 1 < R) {  // the next slice under way while this one is worked on
      arriving = whole.slice(next_owner * n, (next_owner + 1) * n);
      hop = ring_.pass_on({in_hand}, {arriving}, static_cast<uint32_t>(s));
    }
    each(owner * n, in_hand);
    hop.wait();
    in_hand = arriving;
  }
  return whole;
}

Tensor TensorParallel::map_rows(const Tensor& slice, const std::function<Tensor(const Tensor& rows)>& f,
                                Tensor* rows) const {
  Tensor out;
  Tensor all = gather_rows(slice, [&](int64_t r0, const Tensor& in) {
    Tensor part = f(in);
    if (!out.defined()) {
      Shape whole = part.shape();
      whole[0] = in.size(0) * size();
      out = Tensor::empty(whole, part.dtype(), part.device());
    }
    out.slice(r0, r0 + in.size(0)).copy_from(part);
  });
  if (rows != nullptr) *rows = std::move(all);
  return out;
}

Tensor TensorParallel::reduce_scatter_rows(int64_t rows, const PartialSlice& partial) const {
  const int R = size(), r = rank();
  const int64_t n = slice_rows(rows);
  Tensor arrived;  // the running sum of the slice handled next, from the previous rank
  Ring::Hop hop;
  for (int s = 0; s < R; ++s) {
    const int j = (r - 1 - s + 2 * R) % R;  // the slice whose sum this step adds to (own last)
    Tensor sum = partial(j * n, n);          // made while the sum before it travels
    MT_CHECK(sum.defined() && sum.ndim() >= 1 && sum.size(0) == n,
             "tensor parallelism: a partial sum of {} rows from row {} is {}", n, j * n, sum.str());
    hop.wait();
    if (s > 0) ops::add_(sum, arrived);
    if (s + 1 == R) return sum;
    arrived = Tensor::empty(sum.shape(), sum.dtype(), sum.device());
    hop = ring_.pass_on({sum}, {arrived}, static_cast<uint32_t>(s));
  }
  MT_THROW("tensor parallelism: a reduce-scatter over {} ranks", R);
}

// Step s works on input slice r - s (its own at s = 0). The running sum of slice j starts at
// rank j + 1 (its step 1), gains each rank's partial on the way and reaches rank j one hop
// after the last step, where rank j adds its own partial (made at step 0). So from step 2 on
// every hop carries, besides the next input slice, the sum made at the step before.
Tensor TensorParallel::gather_map_reduce_rows(const Tensor& slice, Tensor& whole, const MapSlice& f) const {
  MT_CHECK(slice.defined() && slice.ndim() >= 1, "tensor parallelism: gather_map_reduce_rows of {}", slice.str());
  const int R = size(), r = rank();
  const int64_t n = slice.size(0);
  Shape whole_shape = slice.shape();
  whole_shape[0] *= R;
  whole = Tensor::empty(whole_shape, slice.dtype(), slice.device());
  Tensor in_hand = whole.slice(r * n, (r + 1) * n);
  in_hand.copy_from(slice);
  Tensor own, sum, arrived;  // own: f of this rank's slice; sum: made at the step before
  auto check = [&](const Tensor& p, int64_t first) {
    MT_CHECK(p.defined() && p.ndim() >= 1 && p.size(0) == n,
             "tensor parallelism: a partial sum of {} rows from row {} is {}", n, first, p.defined() ? p.str() : "");
  };
  for (int s = 0; s < R; ++s) {
    const int owner = (r - s + R) % R, next_owner = (r - s - 1 + R) % R;
    std::vector<Tensor> sends, recvs;
    Tensor next_in;
    if (s + 1 < R) {  // the next input slice
      next_in = whole.slice(next_owner * n, (next_owner + 1) * n);
      sends.push_back(in_hand);
      recvs.push_back(next_in);
    }
    if (s >= 2) {  // the running sum made at the step before; the one for this step's slice
      arrived = Tensor::empty(sum.shape(), sum.dtype(), sum.device());
      sends.push_back(sum);
      recvs.push_back(arrived);
    }
    Ring::Hop hop = sends.empty() ? Ring::Hop() : ring_.pass_on(sends, recvs, static_cast<uint32_t>(2 * s));
    Tensor partial = f(owner * n, in_hand);  // while the hop travels
    check(partial, owner * n);
    hop.wait();
    if (s == 0) {
      own = std::move(partial);
    } else {
      if (s >= 2) ops::add_(partial, arrived);
      sum = std::move(partial);
    }
    in_hand = next_in;
  }
  if (R == 1) return own;
  arrived = Tensor::empty(sum.shape(), sum.dtype(), sum.device());  // this rank's slice, from the others
  Ring::Hop last = ring_.pass_on({sum}, {arrived}, static_cast<uint32_t>(2 * R));
  last.wait();
  ops::add_(own, arrived);
  return own;
}

}  // namespace moetrain
