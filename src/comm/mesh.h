// Mesh: the ranks of a job laid out on five named axes, outer to inner PP, DP, CP, TP, EP:
//   rank = (((pp * DP + dp) * CP + cp) * TP + tp) * EP + ep
// CP, TP and EP are innermost so their frequent collectives (ring K/V, TP gathers, MoE
// all-to-all) stay among neighbouring ranks, i.e. inside a node. DP is inferred as
// world / (pp * cp * tp * ep) when not given. A layout that does not fit the world size is
// an Error naming the numbers.
//
// MeshComms holds one sub-communicator per axis plus the combined groups: dp x cp (FSDP's
// group for expert weights), dp x cp x ep (for every other weight: tensor-parallel ranks
// hold different pieces of them), tp x ep (an MoE layer's expert ranks: tensor parallelism
// folds into expert parallelism there) and dp x cp x tp x ep (the ranks of a pipeline stage,
// which under sequence parallelism all hold different tokens).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace moetrain {

enum class MeshAxis { PP, DP, CP, TP, EP };
inline constexpr int kMeshAxes = 5;
const char* axis_name(MeshAxis a);  // "pp", "dp", "cp", "tp", "ep"

struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, tp = 0, ep = 0;
  int at(MeshAxis a) const;
  bool operator==(const MeshCoord&) const = default;
};

class Mesh {
 public:
  // dp = -1: inferred. Every size must be >= 1 and pp * dp * cp * tp * ep == world.
  Mesh(int64_t world, int64_t pp, int64_t dp, int64_t cp, int64_t ep, int64_t tp = 1);

  int world_size() const { return world_; }
  int size(MeshAxis a) const { return sizes_[static_cast<int>(a)]; }
  int pp() const { return size(MeshAxis::PP); }
  int dp() const { return size(MeshAxis::DP); }
  int cp() const { return size(MeshAxis::CP); }
  int tp() const { return size(MeshAxis::TP); }
  int ep() const { return size(MeshAxis::EP); }

  MeshCoord coord(int rank) const;
  int rank_of(const MeshCoord& c) const;
  // The ranks that share every coordinate of `rank` except those on `axes`, ascending
  // (which is also their order inside the group: outer axis major).
  std::vector<int> group(int rank, std::initializer_list<MeshAxis> axes) const;
  // Which group of that family `rank` is in: the smallest rank of its group (a split color).
  int group_color(int rank, std::initializer_list<MeshAxis> axes) const;

  std::string str() const;  // "pp 2 x dp 2 x cp 1 x tp 1 x ep 2 (8 ranks)"

 private:
  int world_;
  int sizes_[kMeshAxes];
};

struct MeshComms {
  Mesh mesh;
  std::shared_ptr<Communicator> world, pp, dp, cp, tp, ep;
  std::shared_ptr<Communicator> dp_cp;     // the ranks holding the same experts
  std::shared_ptr<Communicator> dp_cp_ep;  // the ranks holding the same pieces of every other weight
  std::shared_ptr<Communicator> tp_ep;     // an MoE layer's expert ranks (ep itself when tp is 1)
  // Every rank of a pipeline stage within this replica group: each holds different tokens
  // (the tp ranks their sequence-parallel slices); shard_dense itself when tp is 1.
  std::shared_ptr<Communicator> stage;
  // Sharded data parallelism. Plain FSDP: expert weights shard over dp_cp, every other
  // weight over dp_cp_ep, and `replicate` is null. HSDP (dp_replicate = R > 1): dp is
  // R replica groups (outer) of dp / R ranks (inner); weights shard inside a replica group
  // and the replicas all-reduce their gradient shards over `replicate` (R ranks).
  std::shared_ptr<Communicator> shard_experts, shard_dense, replicate;
  int replica = 0, replicas = 1;  // this rank's replica group, and how many there are
  // Every rank of this rank's replica group (pp x dp / R x cp x tp x ep; the world when R
  // is 1): what a step's collectives inside one replica span. Only `replicate` crosses.
  std::shared_ptr<Communicator> replica_world;

  // Splits `world` along the mesh; collective over world. Each sub-communicator's rank is
  // this rank's index in Mesh::group. dp_replicate must divide dp (an Error names both).
  static MeshComms build(std::shared_ptr<Communicator> world, const Mesh& mesh, int dp_replicate = 1);
};

}  // namespace moetrain
