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

  // Live fault tolerance (engine/ft/replica_manager.h): a collective that fails (another
  // group died or timed out) does not throw but marks the bridge failed and drops its
  // communicator, closing its connections so that the other groups fail at once too rather
  // than wait out their timeout; the calls after it do nothing until rebuild(). The step
  // then goes on inside the group and is discarded at its commit.
  void set_tolerant(bool on) { tolerant_ = on; }
  bool failed() const { return !failure_.empty(); }
  void fail(std::string why);  // marks it failed (and drops the communicator), as a failed collective
  const std::string& failure() const { return failure_; }
  // The communicator now (nullptr: one replica group, or failed); shared(): kept alive by
  // the caller past a rebuild (transfers in flight on it).
  Communicator* comm() const { return comm_.get(); }
  std::shared_ptr<Communicator> shared() const { return comm_; }

  // Over the replica groups, in place (no-ops with one group).
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
  // A few doubles, summed (or the max) over the replica groups, on the device the
  // communicator's backend reads.
  void all_reduce_doubles(std::vector<double>& values, Device device, ReduceOp op = ReduceOp::Sum);

 private:
  // Runs `op` on the communicator; in tolerant mode turns its Error into failed().
  template <typename F>
  void guarded(F&& op);

  std::shared_ptr<Communicator> comm_;
  bool tolerant_ = false;
  std::string failure_;
};

// `values` summed over a replica group's `group` (nullptr: one rank), then over the
// replica groups: the batch-wide sum every data rank of every replica group agrees on.
void sum_over_data(Communicator* group, ReplicaBridge* bridge, std::vector<double>& values, Device device);

}  // namespace moetrain
