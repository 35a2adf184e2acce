#include "comm/mesh.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

Mesh::Mesh(int64_t world, int64_t pp, int64_t dp, int64_t cp, int64_t ep) {
  MT_CHECK(world >= 1, "mesh: world size {} must be at least 1", world);
  for (auto [name, v] : {std::pair{"pp", pp}, {"cp", cp}, {"ep", ep}}) {
    MT_CHECK(v >= 1, "mesh: {} = {} must be at least 1", name, v);
  }
  const int64_t inner = pp * cp * ep;
  if (dp == -1) {
    MT_CHECK(world % inner == 0,
             "mesh: world size {} is not divisible by pp * cp * ep = {} * {} * {} = {}, so dp cannot be inferred",
             world, pp, cp, ep, inner);
    dp = world / inner;
  } else {
    MT_CHECK(dp >= 1, "mesh: dp = {} must be at least 1 (or -1 to infer it)", dp);
    MT_CHECK(pp * dp * cp * ep == world, "mesh: pp * dp * cp * ep = {} * {} * {} * {} = {} but the world size is {}",
             pp, dp, cp, ep, pp * dp * cp * ep, world);
  }
  world_ = static_cast<int>(world);
  sizes_[0] = static_cast<int>(pp);
  sizes_[1] = static_cast<int>(dp);
  sizes_[2] = static_cast<int>(cp);
  sizes_[3] = static_cast<int>(ep);
}

MeshCoord Mesh::coord(int rank) const {
  MT_CHECK(rank >= 0 && rank < world_, "mesh: rank {} is outside the world of {}", rank, world_);
  MeshCoord c;
  c.ep = rank % ep();
  rank /= ep();
  c.cp = rank % cp();
  rank /= cp();
  c.dp = rank % dp();
  c.pp = rank / dp();
  return c;
}

int Mesh::rank_of(const MeshCoord& c) const {
  MT_CHECK(c.pp >= 0 && c.pp < pp() && c.dp >= 0 && c.dp < dp() && c.cp >= 0 && c.cp < cp() && c.ep >= 0 &&
               c.ep < ep(),
           "mesh: coordinate (pp {}, dp {}, cp {}, ep {}) is outside {}", c.pp, c.dp, c.cp, c.ep, str());
  return ((c.pp * dp() + c.dp) * cp() + c.cp) * ep() + c.ep;
}

std::vector<int> Mesh::group(int rank, std::initializer_list<MeshAxis> axes) const {
  const MeshCoord me = coord(rank);
  bool free_axis[4] = {false, false, false, false};
  for (MeshAxis a : axes) free_axis[static_cast<int>(a)] = true;
  std::vector<int> out;
  for (int r = 0; r < world_; ++r) {
    MeshCoord c = coord(r);
    int mine[4] = {me.pp, me.dp, me.cp, me.ep}, theirs[4] = {c.pp, c.dp, c.cp, c.ep};
    bool same = true;
    for (int a = 0; a < 4; ++a) same = same && (free_axis[a] || mine[a] == theirs[a]);
    if (same) out.push_back(r);
  }
  return out;
}

int Mesh::group_color(int rank, std::initializer_list<MeshAxis> axes) const { return group(rank, axes).front(); }

std::string Mesh::str() const {
  return fmt::format("pp {} x dp {} x cp {} x ep {} ({} ranks)", pp(), dp(), cp(), ep(), world_);
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
  m.ep = sub({MeshAxis::EP}, "ep");
  m.dp_cp = sub({MeshAxis::DP, MeshAxis::CP}, "dp_cp");
  m.dp_cp_ep = sub({MeshAxis::DP, MeshAxis::CP, MeshAxis::EP}, "dp_cp_ep");
  MT_CHECK(dp_replicate >= 1 && mesh.dp() % dp_replicate == 0,
           "mesh: dp_replicate = {} must divide dp = {} (HSDP: replica groups of dp / dp_replicate ranks)",
           dp_replicate, mesh.dp());
  if (dp_replicate == 1) {
    m.shard_experts = m.dp_cp;
    m.shard_dense = m.dp_cp_ep;
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
  m.shard_experts = std::shared_ptr<Communicator>(world->split((pp_rep * mesh.ep() + c.ep), r, "shard_experts"));
  m.shard_dense = std::shared_ptr<Communicator>(world->split(pp_rep, r, "shard_dense"));
  m.replicate = std::shared_ptr<Communicator>(
      world->split(((c.pp * S + shard) * mesh.cp() + c.cp) * mesh.ep() + c.ep, r, "replicate"));
  return m;
}

}  // namespace moetrain
