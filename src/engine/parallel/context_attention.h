// ContextAttention: causal attention when a context-parallel group splits every sequence
// (issue 31, docs/memory.md). Each rank holds its zigzag chunks of the sequences (data/loader.h's
// zigzag_batch) with each token's place. Ring attention: the keys and values go round the
// group, rank r sending its block to r + 1 while it attends to the one in hand
// (ops::attention_block_forward, merged into the running softmax); the places and documents
// of every rank's tokens are gathered once a pass (a few bytes a token). The backward sends
// the blocks round again, each with the sum of its key and value gradients over the ranks it
// has visited, and one last hop brings every rank its own keys' sums. Deterministic: the
// merge and the sums run in a fixed order per rank.
//
// On GPUs, until the CUDA block kernels exist, the whole-sequence form: each rank gathers
// every rank's keys and values into whole sequences, places its own queries among zeros,
// and runs the causal flash-attention kernels over the whole sequences; its rows of the
// output (and the whole sequences' lse) are kept, and the backward's key/value gradients,
// made by its own queries only, are reduce-scattered onto the ranks that hold those keys.
// Correct, and every per-token activation is split, but each rank does the attention work
// of the whole sequence (cp times its share) and holds whole-sequence buffers for the
// attention core. The CPU can run either form (`Form`); the GPU runs the whole one.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "engine/models/model.h"
#include "ops/ops.h"

namespace moetrain {

class ContextAttention {
 public:
  enum class Form { kAuto, kRing, kWhole };  // kAuto: the ring on the CPU, whole sequences on GPUs
  // `group`: the ranks that split the sequences, in zigzag order (rank r of it holds chunks r
  // and 2 cp - 1 - r). Not owned.
  explicit ContextAttention(Communicator& group, Form form = Form::kAuto);
  ~ContextAttention();

  // q [B*n, Hq*D], k and v [B*n, ...] this rank's tokens at `places` (n = shape.seq: a rank's
  // tokens a sequence); out and lse over every rank's keys.
  ops::AttentionOut forward(const Tensor& q, const Tensor& k, const Tensor& v, const ops::AttentionPlaces& places,
                            const ops::AttentionShape& shape) const;
  // dq, and this rank's keys' dk and dv summed over every rank's queries. `out` and `lse` as
  // forward returned them.
  ops::AttentionGrads backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                               const ops::AttentionPlaces& places, const Tensor& out, const Tensor& lse,
                               const ops::AttentionShape& shape) const;

  // For a loss over whole sequences (DeepSeek's sequence-wise balance loss): the sequences'
  // expert selections summed over the group, and their whole length, from this rank's rows
  // (`seq` tokens of each of `batch` sequences).
  ops::SeqBalanceWhole whole_sequences(const Tensor& topk_idx, int64_t batch, int64_t seq, int64_t experts) const;
  int size() const { return group_.size(); }

 private:
  struct Places;
  struct Hop;
  struct WholeMaps;
  struct WholeKeys;
  bool whole_form(const Tensor& q) const;
  const WholeMaps& maps(int64_t batch, int64_t seq, Device device) const;
  WholeKeys whole_keys(const Tensor& k, const Tensor& v, const ops::AttentionPlaces& places,
                       const ops::AttentionShape& shape) const;
  ops::AttentionOut whole_forward(const Tensor& q, const Tensor& k, const Tensor& v, const ops::AttentionPlaces& places,
                                  const ops::AttentionShape& shape) const;
  ops::AttentionGrads whole_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const ops::AttentionPlaces& places, const Tensor& out, const Tensor& lse,
                                     const ops::AttentionShape& shape) const;
  // Every rank's rows of `x`, back to back in rank order.
  Tensor gathered(const Tensor& x) const;
  Places gather_places(const Tensor& rows, const ops::AttentionPlaces& places) const;
  Hop pass_on(const Tensor& a, const Tensor& b, Tensor& a_in, Tensor& b_in, int64_t step, int kind_a,
              int kind_b) const;
  Communicator& group_;
  Form form_;
  mutable std::vector<std::unique_ptr<WholeMaps>> maps_;  // by (batch, seq), made once
};

// A decoder layer's attention core for batch `b`: over the CP group when b carries places
// (b.context), else ops::attention_forward / attention_backward of whole sequences.
ops::AttentionOut attend(const Tensor& q, const Tensor& k, const Tensor& v, const BatchShape& b,
                         const ops::AttentionShape& shape);
ops::AttentionGrads attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                    const BatchShape& b, const Tensor& out, const Tensor& lse,
                                    const ops::AttentionShape& shape);

}  // namespace moetrain
