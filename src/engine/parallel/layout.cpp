#include "engine/parallel/layout.h"

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain {

Layout::ExpertRange expert_range(int64_t num_experts, int64_t ep_size, int64_t ep_rank) {
  MT_CHECK(ep_size >= 1 && ep_rank >= 0 && ep_rank < ep_size, "expert-parallel rank {} of {} is not a valid placement",
           ep_rank, ep_size);
  MT_CHECK(num_experts % ep_size == 0,
           "[model] has {} experts, which cannot be split evenly over {} expert-parallel ranks ([parallel].tp x ep)",
           num_experts, ep_size);
  const int64_t count = num_experts / ep_size;
  return {ep_rank * count, count};
}

Layout::Layout(const Mesh& mesh, int rank, int replicas, bool fold_experts)
    : mesh_(mesh), rank_(rank), coord_(mesh.coord(rank)), replicas_(replicas), fold_experts_(fold_experts) {
  MT_CHECK(replicas >= 1 && mesh.dp() % replicas == 0,
           "layout: {} HSDP replica groups do not divide dp = {} ({})", replicas, mesh.dp(), mesh.str());
}

Layout::ExpertRange Layout::experts(int64_t num_experts) const {
  return expert_range(num_experts, expert_ranks(), expert_rank());
}

int Layout::expert_owner(int64_t expert, int64_t num_experts) const {
  MT_CHECK(expert >= 0 && expert < num_experts, "expert {} is outside [0, {})", expert, num_experts);
  return static_cast<int>(expert / expert_range(num_experts, expert_ranks(), 0).count);
}

// The order of the dp x cp x ep group: mesh rank order, i.e. dp major, then cp, then ep.
int Layout::data_rank() const {
  return (coord(MeshAxis::DP) * size(MeshAxis::CP) + coord(MeshAxis::CP)) * size(MeshAxis::EP) + coord(MeshAxis::EP);
}

int Layout::data_world() const { return size(MeshAxis::DP) * size(MeshAxis::CP) * size(MeshAxis::EP); }

int Layout::shard_ranks(bool experts) const {
  const int dp_cp = size(MeshAxis::DP) / replicas_ * size(MeshAxis::CP);
  return experts ? dp_cp : dp_cp * size(MeshAxis::EP);
}

ModelPlacement Layout::placement() const {
  ModelPlacement p;
  p.ep_size = expert_ranks();
  p.ep_rank = expert_rank();
  p.tp_size = tp();
  p.tp_rank = tp_rank();
  p.experts_over_tp = tp() > 1 && !fold_experts_;
  // Padded for the largest sharding group of any replica layout: the data world, which
  // every sharding group divides.
  p.bucket_pad = data_world();
  return p;
}

std::string Layout::str() const {
  return fmt::format("rank {} of {}: pp {} dp {} cp {} tp {} ep {}", rank_, world(), coord_.pp, coord_.dp, coord_.cp,
                     coord_.tp, coord_.ep);
}

}  // namespace moetrain
