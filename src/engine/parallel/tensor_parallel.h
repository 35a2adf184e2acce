// TensorParallel: the collectives of tensor parallelism with sequence parallelism (issue 33,
// docs/parallel.md), as the layers use them.
//
// Between the split layers each of the tp ranks holds one slice of a micro-batch's T token
// rows: rank r rows [r T/tp, (r+1) T/tp) (sequence parallelism: norms, residuals and the
// router run on T/tp rows). A column-parallel GEMM (q/k/v, gate/up, the head) needs every
// row: gather_rows all-gathers the slices into [T, ...] in rank order. A row-parallel GEMM
// (o_proj, down_proj, the vocabulary-parallel embedding) leaves each rank a partial sum of
// every row: reduce_scatter_rows sums them over the ranks and keeps this rank's slice. The
// backward of a gather is a reduce-scatter and the other way round. Timed as
// "tensor_parallel" (engine/telemetry/collective_timer.h).
//
// Overlapped forms (as async-TP does): the slices go round the ranks as a ring (engine/
// parallel/ring.h; on a GPU on the ring's stream) while the GEMM of the slice in hand runs,
// so a GEMM split by row slices hides the transfer of the next slice; the plain forms are
// single collectives on the compute stream, for what has no GEMM to hide under.
#pragma once

#include <cstdint>
#include <functional>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "engine/parallel/ring.h"
#include "ops/ops.h"

namespace moetrain {

class TensorParallel {
 public:
  // `group`: the tp ranks in rank order (tp coordinate 0 first). Not owned.
  explicit TensorParallel(Communicator& group) : group_(group), ring_(group, Collective::kTensorParallel) {}

  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  // This rank's rows of a micro-batch of `rows` token rows (an Error when tp does not divide it).
  int64_t slice_rows(int64_t rows) const;
  int64_t first_row(int64_t rows) const { return slice_rows(rows) * rank(); }
  // The vocabulary rows (embedding) or columns (head) this rank holds of a vocabulary of `vocab`.
  ops::VocabShard vocab(int64_t vocab) const { return {vocab / size() * rank(), vocab}; }

  // Every rank's slice [n, ...] -> the whole [tp n, ...], in rank order.
  Tensor gather_rows(const Tensor& slice) const;
  // Partial sums [tp n, ...] -> their sum over the ranks, this rank's rows [n, ...].
  Tensor reduce_scatter_rows(const Tensor& partial) const;

  // The whole [tp n, ...] as gather_rows, round the ring: `each(first_row, rows)` runs on
  // every slice while the next one travels (this rank's own first, then the one that came
  // from the previous rank, and so on).
  using EachSlice = std::function<void(int64_t first_row, const Tensor& rows)>;
  Tensor gather_rows(const Tensor& slice, const EachSlice& each) const;
  // f of every row ([tp n, ...]: f's rows are its input's), made slice by slice as the slices
  // come round (gather_rows with `each`); the gathered rows go to *rows when given.
  Tensor map_rows(const Tensor& slice, const std::function<Tensor(const Tensor& rows)>& f,
                  Tensor* rows = nullptr) const;
  // The sum over the ranks of their partial sums of this rank's rows, round the ring: each
  // rank makes `partial(first_row, n)` ([n, ...], rows [first_row, first_row + n) of its
  // partial sums) for the slice whose running sum arrives next, while the one before travels;
  // the sum for a slice is its rank's own partial plus what came round, in ring order.
  using PartialSlice = std::function<Tensor(int64_t first_row, int64_t n)>;
  Tensor reduce_scatter_rows(int64_t rows, const PartialSlice& partial) const;

  // A gather, a map that is row by row, and a reduce-scatter round one ring (a dense MLP
  // under sequence parallelism: every row gathered, f's partial sums of each row, their sum
  // over the ranks for this rank's rows): f(first_row, rows) gives the partial sums of the
  // gathered rows [first_row, first_row + n) ([n, ...]), made for each slice as it comes
  // round while the next input slice and the running sums of the reduce-scatter travel
  // together in one hop. `whole` ([tp n, ...] of slice's dtype and device) receives every
  // row, each slice before f sees it. Returns this rank's rows of the sum (own partial
  // added last, as reduce_scatter_rows).
  using MapSlice = std::function<Tensor(int64_t first_row, const Tensor& rows)>;
  Tensor gather_map_reduce_rows(const Tensor& slice, Tensor& whole, const MapSlice& f) const;

 private:
  Communicator& group_;
  Ring ring_;
};

}  // namespace moetrain
