// Lists of tensors seen as runs of memory, for the whole-list ops (optimizer step, gradient
// norm, zeroing): consecutive entries whose elements lie back to back in every role (the
// per-expert views of a stacked weight; masters and moments allocated flat in parameter
// order) form one run, so a list of thousands of parameters costs a few launches.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace moetrain::ops::cuda {

struct TensorRun {
  size_t first = 0;   // index of the run's first entry
  int64_t numel = 0;  // elements over the run
};

// `roles` are parallel lists of the same length. Entry i+1 joins entry i's run when, in
// every role, both are undefined or i+1 starts where i ends, and same_key(i, i+1) holds.
template <typename SameKey>
std::vector<TensorRun> contiguous_runs(std::initializer_list<const std::vector<Tensor>*> roles, SameKey same_key) {
  std::vector<TensorRun> runs;
  const size_t n = (*roles.begin())->size();
  for (size_t i = 0; i < n; ++i) {
    bool joins = i > 0 && same_key(i - 1, i);
    for (const std::vector<Tensor>* r : roles) {
      if (!joins) break;
      const Tensor &a = (*r)[i - 1], &b = (*r)[i];
      joins = a.defined() == b.defined() &&
              (!a.defined() || (a.dtype() == b.dtype() && static_cast<const char*>(a.raw()) + a.nbytes() == b.raw()));
    }
    const int64_t numel = (*roles.begin())->at(i).numel();
    if (joins) {
      runs.back().numel += numel;
    } else {
      runs.push_back({i, numel});
    }
  }
  return runs;
}

}  // namespace moetrain::ops::cuda
