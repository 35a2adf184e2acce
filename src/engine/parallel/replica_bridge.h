// ReplicaBridge: everything a training step sends across data-parallel replica groups goes
// through this one object (DESIGN.md section 6). Inside a replica group a step's
// collectives run on the group's own communicators, which live as long as the group; the
// bridge is what changes when a replica group leaves or rejoins: rebuild() swaps its
// communicator, and every component that crosses replicas (FSDP's gradient all-reduce
// under HSDP, the batch-wide sums of losses, token counts and router statistics) reaches it
// through here at each use rather than holding a communicator of its own.
//
// With one replica group the bridge holds no communicator and every call is a no-op, so a
// layout without HSDP runs exactly the collectives it ran before.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace moetrain {

class ReplicaBridge {
 public:
  ReplicaBridge() = default;  // one replica group
  explicit ReplicaBridge(std::shared_ptr<Communicator> replicas) { rebuild(std::move(replicas)); }

  // The replica groups now (the communicator connects one rank of each: this rank's peers
  // holding the same shard). nullptr or a group of one: a single replica.
  void rebuild(std::shared_ptr<Communicator> replicas);
  int replicas() const { return comm_ ? comm_->size() : 1; }
  int index() const { return comm_ ? comm_->rank() : 0; }  // this replica group's, among them
  bool crosses() const { return comm_ != nullptr; }

  // Over the replica groups, in place (no-ops with one group).
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
  // A few doubles, summed (or the max) over the replica groups, on the device the
  // communicator's backend reads.
  void all_reduce_doubles(std::vector<double>& values, Device device, ReduceOp op = ReduceOp::Sum);

 private:
  std::shared_ptr<Communicator> comm_;
};

// `values` summed over a replica group's `group` (nullptr: one rank), then over the
// replica groups: the batch-wide sum every data rank of every replica group agrees on.
void sum_over_data(Communicator* group, ReplicaBridge* bridge, std::vector<double>& values, Device device);

}  // namespace moetrain
