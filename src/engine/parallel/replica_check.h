// Whether the ranks that hold copies of the same state hold the same bits. Under expert (and
// data) parallelism the attention, router, shared-expert and norm weights and the routing
// biases are copies on every data rank of a stage; a copy that drifts (an update applied
// on one rank only, a reduction summed in another order) trains a different model on each
// rank without any error. DeepSeek-V3 fine-tuners met exactly this (issue 29). The trainer
// checks at the end of every distributed run.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "engine/models/model.h"

namespace moetrain {

struct NamedTensor {
  std::string name;
  Tensor value;
};

// Which copies: kStage, the state every rank of `model`'s data group (a pipeline stage's dp x
// cp x tp x ep ranks) holds a whole copy of: its named buffers (the routing biases), and, when
// `whole_weights` (the weights are not sharded, ZeRO-1/2), every parameter outside the expert
// buckets that tensor parallelism does not split. kTensorPieces: the parameters tensor
// parallelism splits (each tp rank's piece is a copy on the dp x cp x ep ranks of its tp
// coordinate), when whole_weights. kTensorCopies: the experts every tp rank holds whole copies
// of when they are not folded over tp ([parallel].fold_experts = false: copies on the tp
// ranks of each ep coordinate), when whole_weights.
enum class ReplicaSet { kStage, kTensorPieces, kTensorCopies };
std::vector<NamedTensor> replicated_state(Model& model, bool whole_weights, ReplicaSet set = ReplicaSet::kStage);

// Hashes each tensor's bytes (XXH3-64) and compares the hashes over `group` (one
// all-reduce of their maxima and minima). Every rank must pass the same names in the same
// order. Returns the names whose copies differ somewhere in the group (empty: all agree).
std::vector<std::string> replicas_that_differ(const std::vector<NamedTensor>& tensors, Communicator& group,
                                              Device device);

}  // namespace moetrain
