// ContextAttention: causal attention when a context-parallel group splits every sequence
// (issue 31, docs/memory.md). Each rank holds its zigzag chunks of the sequences (data/loader.h's
// zigzag_batch): chunks r and 2cp-1-r of 2cp. Ring attention: the keys and values go round the
// group, rank r sending the block in hand to r + 1 while it attends to it; by the zigzag order
// each block is seen by a rectangle of this rank's queries (ops::attention_part_forward: its
// own block causally, an earlier rank's first chunk by every query, a later rank's block by
// the second chunk's queries), merged into the running softmax (f32). The backward sends the
// blocks round again, each with the sum of its key and value gradients over the ranks it has
// visited, and one last hop brings every rank its own keys' sums. On a GPU the transfers run
// on the ring's own stream (NCCL, one group per hop), hidden behind the attention of the block
// in hand; the CPU's go through Gloo. Deterministic: the merge and the sums run in a fixed
// order per rank. The documents (segment ids) of every rank are gathered once a pass.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "engine/models/model.h"
#include "engine/parallel/ring.h"
#include "ops/ops.h"

namespace moetrain {

class ContextAttention {
 public:
  // `group`: the ranks that split the sequences, in zigzag order (rank r of it holds chunks r
  // and 2 cp - 1 - r). Not owned.
  explicit ContextAttention(Communicator& group);
  ~ContextAttention();

  // q [B*n, Hq*D], k and v [B*n, ...] this rank's tokens (n = shape.seq: a rank's tokens a
  // sequence, its two chunks), segments their documents (or undefined); out and lse over
  // every rank's keys.
  ops::AttentionOut forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segments,
                            const ops::AttentionShape& shape) const;
  // dq, and this rank's keys' dk and dv summed over every rank's queries. `out` and `lse` as
  // forward returned them.
  ops::AttentionGrads backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& segments, const Tensor& out, const Tensor& lse,
                               const ops::AttentionShape& shape) const;

  // For a loss over whole sequences (DeepSeek's sequence-wise balance loss): the sequences'
  // expert selections summed over the group, and their whole length, from this rank's rows
  // (`seq` tokens of each of `batch` sequences).
  ops::SeqBalanceWhole whole_sequences(const Tensor& topk_idx, int64_t batch, int64_t seq, int64_t experts) const;
  int size() const { return group_.size(); }

 private:
  // Every rank's rows of `x`, back to back in rank order.
  Tensor gathered(const Tensor& x) const;
  Communicator& group_;
  Ring ring_;  // the blocks' transfers
};

// A decoder layer's attention core for batch `b`: over the CP group when b carries places
// (b.context), else ops::attention_forward / attention_backward of whole sequences.
ops::AttentionOut attend(const Tensor& q, const Tensor& k, const Tensor& v, const BatchShape& b,
                         const ops::AttentionShape& shape);
ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape);

}  // namespace moetrain
