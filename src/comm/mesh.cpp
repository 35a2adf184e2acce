#include "comm/mesh.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

const char* axis_name(MeshAxis a) {
  static const char* names[kMeshAxes] = {"pp", "dp", "cp", "tp", "ep"};
  return names[static_cast<int>(a)];
}

int MeshCoord::at(MeshAxis a) const {
  const int v[kMeshAxes] = {pp, dp, cp, tp, ep};
  return v[static_cast<int>(a)];
}

Mesh::Mesh(int64_t world, int64_t pp, int64_t dp, int64_t cp, int64_t ep, int64_t tp) {
  MT_CHECK(world >= 1, "mesh: world size {} must be at least 1", world);
  for (auto [name, v] : {std::pair{"pp", pp}, {"cp", cp}, {"tp", tp}, {"ep", ep}}) {
    MT_CHECK(v >= 1, "mesh: {} = {} must be at least 1", name, v);
  }
  const int64_t inner = pp * cp * tp * ep;
  if (dp == -1) {
    MT_CHECK(world % inner == 0,
             "mesh: world size {} is not divisible by pp * cp * tp * ep = {} * {} * {} * {} = {}, so dp cannot be "
             "inferred",
             world, pp, cp, tp, ep, inner);
    dp = world / inner;
  } else {
    MT_CHECK(dp >= 1, "mesh: dp = {} must be at least 1 (or -1 to infer it)", dp);
    MT_CHECK(dp * inner == world, "mesh: pp * dp * cp * tp * ep = {} * {} * {} * {} * {} = {} but the world size is {}",
             pp, dp, cp, tp, ep, dp * inner, world);
  }
  world_ = static_cast<int>(world);
  const int64_t sizes[kMeshAxes] = {pp, dp, cp, tp, ep};
  for (int a = 0; a < kMeshAxes; ++a) sizes_[a] = static_cast<int>(sizes[a]);
}

MeshCoord Mesh::coord(int rank) const {
  MT_CHECK(rank >= 0 && rank < world_, "mesh: rank {} is outside the world of {}", rank, world_);
  int v[kMeshAxes];
  for (int a = kMeshAxes - 1; a >= 0; --a) {  // the innermost axis varies fastest
    v[a] = rank % sizes_[a];
    rank /= sizes_[a];
  }
  return {v[0], v[1], v[2], v[3], v[4]};
}

int Mesh::rank_of(const MeshCoord& c) const {
  int rank = 0;
  for (int a = 0; a < kMeshAxes; ++a) {
    const int x = c.at(static_cast<MeshAxis>(a));
    MT_CHECK(x >= 0 && x < sizes_[a], "mesh: coordinate (pp {}, dp {}, cp {}, tp {}, ep {}) is outside {}", c.pp, c.dp,
             c.cp, c.tp, c.ep, str());
    rank = rank * sizes_[a] + x;
  }
  return rank;
}

std::vector<int> Mesh::group(int rank, std::initializer_list<MeshAxis> axes) const {
  const MeshCoord me = coord(rank);
  bool free_axis[kMeshAxes] = {};
  for (MeshAxis a : axes) free_axis[static_cast<int>(a)] = true;
  std::vector<int> out;
  for (int r = 0; r < world_; ++r) {
    const MeshCoord c = coord(r);
    bool same = true;
    for (int a = 0; a < kMeshAxes; ++a) {
      same = same && (free_axis[a] || me.at(static_cast<MeshAxis>(a)) == c.at(static_cast<MeshAxis>(a)));
    }
    if (same) out.push_back(r);
  }
  return out;
}

int Mesh::group_color(int rank, std::initializer_list<MeshAxis> axes) const { return group(rank, axes).front(); }

std::string Mesh::str() const {
  return fmt::format("pp {} x dp {} x cp {} x tp {} x ep {} ({} ranks)", pp(), dp(), cp(), tp(), ep(), world_);
}

MeshComms MeshComms::build(std::shared_ptr<Communicator> world, const Mesh& mesh, int dp_replicate) {
  MT_CHECK(world->size() == mesh.world_size(), "mesh {} does not fit communicator {} of {} ranks", mesh.str(),
           world->name(), world->size());
  const int r = world->rank();
  auto sub = [&](std::initializer_list<MeshAxis> axes, const char* name) {
    return std::shared_ptr<Communicator>(world->split(mesh.group_color(r, axes), r, name));
  };
  MeshComms m{mesh, world};
  m.pp = sub({MeshAxis::PP}, "pp");
  m.dp = sub({MeshAxis::DP}, "dp");
  m.cp = sub({MeshAxis::CP}, "cp");
  m.tp = sub({MeshAxis::TP}, "tp");
  m.ep = sub({MeshAxis::EP}, "ep");
  m.tp_ep = mesh.tp() == 1 ? m.ep : sub({MeshAxis::TP, MeshAxis::EP}, "tp_ep");
  m.dp_cp = sub({MeshAxis::DP, MeshAxis::CP}, "dp_cp");
  m.dp_cp_ep = sub({MeshAxis::DP, MeshAxis::CP, MeshAxis::EP}, "dp_cp_ep");
  MT_CHECK(dp_replicate >= 1 && mesh.dp() % dp_replicate == 0,
           "mesh: dp_replicate = {} must divide dp = {} (HSDP: replica groups of dp / dp_replicate ranks)",
           dp_replicate, mesh.dp());
  if (dp_replicate == 1) {
    m.shard_experts = m.dp_cp;
    m.shard_dense = m.dp_cp_ep;
    m.replica_world = world;
    m.stage = mesh.tp() == 1 ? m.shard_dense : sub({MeshAxis::DP, MeshAxis::CP, MeshAxis::TP, MeshAxis::EP}, "stage");
    return m;
  }
  // dp coordinate = replica * S + shard, S = dp / R: replicas outer (across nodes), the
  // shards of one replica group inner (within a node).
  const MeshCoord c = mesh.coord(r);
  const int S = mesh.dp() / dp_replicate;
  m.replica = c.dp / S;
  m.replicas = dp_replicate;
  const int shard = c.dp % S;
  const int pp_rep = c.pp * dp_replicate + m.replica;
  // Experts shard over (dp shard, cp) of one replica, tp and ep fixed; other weights over
  // (dp shard, cp, ep), tp fixed; the replicas of one shard meet in `replicate`.
  m.shard_experts = std::shared_ptr<Communicator>(
      world->split((pp_rep * mesh.tp() + c.tp) * mesh.ep() + c.ep, r, "shard_experts"));
  m.shard_dense = std::shared_ptr<Communicator>(world->split(pp_rep * mesh.tp() + c.tp, r, "shard_dense"));
  m.replicate = std::shared_ptr<Communicator>(world->split(
      (((c.pp * S + shard) * mesh.cp() + c.cp) * mesh.tp() + c.tp) * mesh.ep() + c.ep, r, "replicate"));
  m.replica_world = std::shared_ptr<Communicator>(world->split(m.replica, r, "replica_world"));
  m.stage = mesh.tp() == 1 ? m.shard_dense : std::shared_ptr<Communicator>(world->split(pp_rep, r, "stage"));
  return m;
}

}  // namespace moetrain
