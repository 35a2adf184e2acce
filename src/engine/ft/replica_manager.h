// ReplicaManager: live fault tolerance for one rank of a data-parallel replica group
// (DESIGN.md section 6, level 2; [fault_tolerance]; docs/fault-tolerance.md).
//
// A run trains as several replica groups, each its own job under its own `moetrain launch`
// (which restarts it when one of its ranks dies), each a whole model in any layout. Every
// step, before its batches:
//   1. rank 0 of the group asks the lighthouse for the quorum (lighthouse.h) and the group's
//      ranks get the answer from it;
//   2. when the quorum changed, the cross-group communicator is built again (rank r of every
//      group in the quorum: the ranks holding the same shards) and handed to the
//      ReplicaBridge, through which FSDP sums gradient shards and the trainer sums losses and
//      token counts over the groups;
//   3. a group that is behind (restarted, or new) copies the live state of its assigned peer
//      shard to shard over that communicator: weights (and masters), Adam moments, the
//      optimizer's step count, the routing buffers, the step and the data loader's position;
//      it then trains this step like the others, so after the step it is bitwise equal to its
//      source. The source keeps training while its sends run and waits for them only before
//      its optimizer step.
// After the gradients, should_commit() asks every rank of every group in the quorum whether
// its step succeeded (no collective across groups failed, no send failed); the optimizer
// runs only if all say yes, otherwise the step leaves no trace and the next quorum is a new one.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/data/loader.h"
#include "engine/ft/lighthouse.h"
#include "engine/run_config.h"
#include "engine/train_context.h"
#include "engine/train_state.h"

namespace moetrain {

// The data rank and data world of this rank across every planned replica group: group g's
// data ranks come after those of groups 0 .. g - 1, so each group reads its own rows of
// every global micro-batch whether or not the others are there.
struct DataShare {
  int rank = 0, world = 1;
};
DataShare replica_data_share(const FaultToleranceConfig& ft, int data_rank, int data_world);

class ReplicaManager {
 public:
  // Connects rank 0 to the lighthouse. The train context must use a ReplicaBridge (FSDP
  // over the group's ranks, even a group of one rank).
  ReplicaManager(const FaultToleranceConfig& cfg, TrainContext& ctx);
  ~ReplicaManager();

  // Before step state.step + 1: quorum, communicator, and healing (which sets `state` and
  // the loader's position when this group was behind).
  void begin_step(TrainState& state, DataLoader& loader);
  // After the step's gradients: whether every rank of every group in the quorum succeeded.
  // When it did (and `ask_next`), rank 0 asks for the next step's quorum in the background.
  bool should_commit(bool ask_next = true);
  // The vote of a round in which this group trained nothing (it healed to the run's end, or
  // it has finished): the others wait for it.
  bool vote_without_step(const TrainState& state, bool ask_next = true);
  // After the last step: stays in the quorums (training nothing: begin_step and the vote)
  // until every alive group has reached this step, sending its state to those behind.
  // Bounded by quorum_timeout_s.
  void finish(TrainState& state, DataLoader& loader);

  // What the last step saw, for metrics.jsonl.
  struct StepReport {
    int replicas = 1;         // groups in the quorum
    int64_t quorum_id = 0;
    double quorum_ms = 0;     // asking the lighthouse and sharing its answer in the group
    std::optional<std::string> recovered_from;  // the replica group this one healed from
    double heal_s = 0;        // the copy's time (receiving side)
    int64_t heal_bytes = 0;   // bytes this rank received
  };
  const StepReport& report() const { return report_; }

 private:
  // fresh: a new incarnation, so any quorum asked for in advance is not followed.
  QuorumAnswer ask(int64_t step, bool fresh = false);
  void connect(const QuorumAnswer& a);
  void heal_from(int peer, TrainState& state, DataLoader& loader);
  void send_to(const std::vector<int>& peers, const TrainState& state, const DataLoader& loader);
  std::vector<Tensor> state_tensors();
  bool wait_sends();  // false when a send to a peer failed
  void discard_early();  // cancels and forgets the quorum asked for in advance

  FaultToleranceConfig cfg_;
  TrainContext& ctx_;
  Communicator& group_;                       // every rank of this replica group
  std::unique_ptr<LighthouseClient> client_;  // rank 0 only
  uint64_t incarnation_;
  std::string prefix_;                        // the quorum the communicator belongs to
  std::shared_ptr<Communicator> send_comm_;   // the sends' communicator, alive until they are waited for
  std::vector<std::unique_ptr<P2pRequest>> sends_;
  std::vector<Tensor> send_buffers_;          // alive until the sends are waited for
  bool send_failed_ = false;
  bool rejoin_ = false;                       // the last step was discarded
  int64_t step_ = 0;                          // the step being trained (1-based)
  StepReport report_;
  QuorumAnswer last_;                         // the last quorum's answer
  std::future<QuorumAnswer> early_;           // rank 0: the next quorum, asked at the last commit
  int64_t early_step_ = -1;                   // the step it was asked with
};

}  // namespace moetrain
