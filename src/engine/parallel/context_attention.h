// ContextAttention: causal attention when a context-parallel group splits every sequence
// (issue 31, docs/memory.md). Each rank holds its zigzag chunks of the sequences (data/loader.h's
// zigzag_batch) with each token's place; the keys and values, their places and documents are
// gathered from every rank of the group, each rank's queries attend to every rank's block of
// keys (ops::attention_block_forward, the blocks merged in rank order), and the backward sums
// each block's key and value gradients over the group onto the rank that holds those keys
// (a reduce-scatter). The all-gather form: one collective each way, deterministic; the ring
// that overlaps each block's transfer with the attention of the one in hand comes with the
// GPU kernels. The CPU only for now, as the block ops.
#pragma once

#include "comm/communicator.h"
#include "engine/models/model.h"
#include "ops/ops.h"

namespace moetrain {

class ContextAttention {
 public:
  // `group`: the ranks that split the sequences, in zigzag order (rank r of it holds chunks r
  // and 2 cp - 1 - r). Not owned.
  explicit ContextAttention(Communicator& group) : group_(group) {}

  // q [B*n, Hq*D], k and v [B*n, ...] this rank's tokens at `places` (n = shape.seq: a rank's
  // tokens a sequence); out and lse over every rank's keys.
  ops::AttentionOut forward(const Tensor& q, const Tensor& k, const Tensor& v, const ops::AttentionPlaces& places,
                            const ops::AttentionShape& shape) const;
  // dq, and this rank's keys' dk and dv summed over every rank's queries.
  ops::AttentionGrads backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                               const ops::AttentionPlaces& places, const Tensor& out, const Tensor& lse,
                               const ops::AttentionShape& shape) const;

 private:
  struct Blocks;
  // Every rank's rows of `x`, back to back in rank order.
  Tensor gathered(const Tensor& x) const;
  Blocks gather(const Tensor& k, const Tensor& v, const ops::AttentionPlaces& places) const;
  Communicator& group_;
};

// A decoder layer's attention core for batch `b`: over the CP group when b carries places
// (b.context), else ops::attention_forward / attention_backward of whole sequences.
ops::AttentionOut attend(const Tensor& q, const Tensor& k, const Tensor& v, const BatchShape& b,
                         const ops::AttentionShape& shape);
ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape);

}  // namespace moetrain
