// Layout: every question about where things are in a job, answered in one place, from the
// mesh (comm/mesh.h: pp, dp, cp, tp, ep, outer to inner) and this rank's place in it:
// which experts the rank holds, which rows of a global micro-batch it takes, over how many
// ranks each kind of weight bucket is sharded, and what the model part it builds is. Nothing else computes these: a new axis (cp, tp) or a
// smaller world after a failure changes this object, not the files that ask it.
#pragma once

#include <cstdint>
#include <string>

#include "comm/mesh.h"
#include "core/tensor.h"
#include "engine/models/model.h"

namespace moetrain {

class Layout {
 public:
  Layout() : Layout(Mesh(1, 1, 1, 1, 1), 0) {}  // one process
  // `replicas`: HSDP replica groups the dp axis is cut into (1: plain FSDP). `fold_experts`:
  // [parallel].fold_experts (the MoE layers' experts over tp x ep, or over ep).
  Layout(const Mesh& mesh, int rank, int replicas = 1, bool fold_experts = true);

  const Mesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }
  int world() const { return mesh_.world_size(); }
  int size(MeshAxis a) const { return mesh_.size(a); }
  int coord(MeshAxis a) const { return coord_.at(a); }
  int pp() const { return size(MeshAxis::PP); }
  int pp_rank() const { return coord(MeshAxis::PP); }
  int ep() const { return size(MeshAxis::EP); }
  int ep_rank() const { return coord(MeshAxis::EP); }
  int tp() const { return size(MeshAxis::TP); }
  int tp_rank() const { return coord(MeshAxis::TP); }
  // An MoE layer's expert ranks: tensor parallelism folds into expert parallelism there, so
  // experts split over the tp x ep ranks (MeshComms::tp_ep), this rank being expert rank
  // tp_rank * ep + ep_rank; not folded, over the ep ranks (every tp rank holding its ep
  // rank's experts).
  bool folds_experts() const { return fold_experts_; }
  int expert_ranks() const { return fold_experts_ ? tp() * ep() : ep(); }
  int expert_rank() const { return fold_experts_ ? tp_rank() * ep() + ep_rank() : ep_rank(); }

  // Experts: of every MoE layer's `num_experts`, this rank holds [first, first + count)
  // (global ids); the expert rank (of expert_ranks()) holding expert `e`. An Error names the numbers when they do not
  // split evenly.
  struct ExpertRange {
    int64_t first = 0, count = 0;
  };
  ExpertRange experts(int64_t num_experts) const;
  int expert_owner(int64_t expert, int64_t num_experts) const;

  // Data: the ranks that load different tokens of one global micro-batch (dp x cp x ep of a
  // pipeline stage; pipeline and tensor ranks load the same ones, the tensor ranks then each
  // taking a slice), this rank's index among them, and the rows [first, first + micro_batch)
  // of the global micro-batch it takes.
  int data_rank() const;
  int data_world() const;
  int64_t first_row(int64_t micro_batch) const { return static_cast<int64_t>(data_rank()) * micro_batch; }
  // Context parallelism: the cp ranks of one (dp, ep) place share rows and split each row's
  // tokens (zigzag_batch). Rows are then cut over the dp x ep ranks: row_rank of row_world.
  int cp() const { return size(MeshAxis::CP); }
  int cp_rank() const { return coord(MeshAxis::CP); }
  int row_rank() const { return coord(MeshAxis::DP) * ep() + ep_rank(); }
  int row_world() const { return size(MeshAxis::DP) * ep(); }

  // Sharding: the ranks a bucket's gradients, optimizer state and (ZeRO-3) weights are cut
  // over: dp x cp for experts (ep ranks hold different experts), dp x cp x ep for every
  // other bucket; within one replica group under HSDP. Buckets are padded to a multiple of
  // the data world (placement()), which every sharding group divides.
  int shard_ranks(bool experts) const;


  // The part of the model this rank builds (before the pipeline cuts it into chunks).
  ModelPlacement placement() const;

  std::string str() const;

 private:
  Mesh mesh_;
  int rank_;
  MeshCoord coord_;
  int replicas_;
  bool fold_experts_;
};

// The experts of `num_experts` that EP rank `ep_rank` of `ep_size` holds: the one split
// Layout::experts and a model placement (ModelPlacement's ep_size, ep_rank) both use.
Layout::ExpertRange expert_range(int64_t num_experts, int64_t ep_size, int64_t ep_rank);

}  // namespace moetrain
