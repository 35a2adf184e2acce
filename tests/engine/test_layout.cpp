// Layout: the one answer to where experts, rows and shards are, checked against the mesh's
// own groups for every rank of several meshes (the groups the communicators are split by).
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/parallel/layout.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::error_of;

int index_in(const std::vector<int>& group, int rank) {
  return static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
}

TEST(Layout, AgreesWithTheMeshGroupsOnEveryRank) {
  for (const Mesh& mesh : {Mesh(8, 2, -1, 1, 2), Mesh(16, 1, -1, 2, 2, 2), Mesh(12, 1, -1, 1, 3), Mesh(6, 3, -1, 1, 1)}) {
    SCOPED_TRACE(mesh.str());
    for (int r = 0; r < mesh.world_size(); ++r) {
      const Layout l(mesh, r);
      const std::vector<int> data = mesh.group(r, {MeshAxis::DP, MeshAxis::CP, MeshAxis::EP});
      EXPECT_EQ(l.data_world(), static_cast<int>(data.size()));
      EXPECT_EQ(l.data_rank(), index_in(data, r));  // the dp_cp_ep communicator's rank
      EXPECT_EQ(l.shard_ranks(true), static_cast<int>(mesh.group(r, {MeshAxis::DP, MeshAxis::CP}).size()));
      EXPECT_EQ(l.shard_ranks(false), l.data_world());
      EXPECT_EQ(l.ep_rank(), index_in(mesh.group(r, {MeshAxis::EP}), r));
      EXPECT_EQ(l.pp_rank(), index_in(mesh.group(r, {MeshAxis::PP}), r));
      EXPECT_EQ(l.first_row(4), 4 * l.data_rank());
      const ModelPlacement p = l.placement();
      // An MoE layer's expert ranks are the tp x ep ranks (the tp_ep communicator's order).
      const std::vector<int> experts = mesh.group(r, {MeshAxis::TP, MeshAxis::EP});
      EXPECT_EQ(p.ep_size, static_cast<int64_t>(experts.size()));
      EXPECT_EQ(p.ep_rank, index_in(experts, r));
      EXPECT_EQ(p.tp_size, mesh.tp());
      EXPECT_EQ(p.tp_rank, index_in(mesh.group(r, {MeshAxis::TP}), r));
      EXPECT_EQ(p.bucket_pad % l.shard_ranks(true), 0);
      EXPECT_EQ(p.bucket_pad % l.shard_ranks(false), 0);
    }
  }
}

// Without folding ([parallel].fold_experts = false) the experts split over the ep ranks only:
// every tp rank of an ep coordinate holds the same ones, as whole copies.
TEST(Layout, UnfoldedExpertsSplitOverEpOnly) {
  const Mesh mesh(8, 1, -1, 1, 2, 2);  // dp 2 x tp 2 x ep 2
  for (int r = 0; r < 8; ++r) {
    const Layout folded(mesh, r), unfolded(mesh, r, 1, /*fold_experts=*/false);
    EXPECT_EQ(folded.expert_ranks(), 4);
    EXPECT_EQ(unfolded.expert_ranks(), 2);
    EXPECT_EQ(unfolded.expert_rank(), unfolded.ep_rank());
    EXPECT_EQ(unfolded.experts(8).first, 4 * unfolded.ep_rank());
    EXPECT_FALSE(folded.placement().experts_over_tp);
    EXPECT_TRUE(unfolded.placement().experts_over_tp);
  }
}

TEST(Layout, ExpertsSplitEvenlyAndEachHasOneOwner) {
  const Mesh mesh(8, 1, -1, 1, 4);
  std::vector<int> owners(12, -1);
  for (int r = 0; r < 4; ++r) {  // ep ranks 0..3 of dp 0
    const Layout l(mesh, r);
    const Layout::ExpertRange e = l.experts(12);
    EXPECT_EQ(e.count, 3);
    EXPECT_EQ(e.first, 3 * r);
    for (int64_t x = e.first; x < e.first + e.count; ++x) {
      EXPECT_EQ(owners[x], -1);
      owners[x] = r;
      EXPECT_EQ(l.expert_owner(x, 12), r);
    }
  }
  EXPECT_EQ(std::count(owners.begin(), owners.end(), -1), 0);
  const std::string e = error_of([&] { Layout(mesh, 0).experts(10); });
  EXPECT_NE(e.find("[model] has 10 experts, which cannot be split evenly over 4 expert-parallel ranks"), std::string::npos)
      << e;
}

// HSDP: dp 4 in 2 replica groups shards each bucket over the 2 dp ranks of a group (x ep
// for dense buckets); buckets stay padded for the whole data world.
TEST(Layout, HsdpShardsWithinAReplicaGroup) {
  const Mesh mesh(8, 1, -1, 1, 2);  // dp 4 x ep 2
  const Layout l(mesh, 5, 2);
  EXPECT_EQ(l.shard_ranks(true), 2);
  EXPECT_EQ(l.shard_ranks(false), 4);
  EXPECT_EQ(l.placement().bucket_pad, 8);
  EXPECT_NE(error_of([&] { Layout(mesh, 0, 3); }).find("3 HSDP replica groups do not divide dp = 4"),
            std::string::npos);
}

}  // namespace
}  // namespace moetrain
