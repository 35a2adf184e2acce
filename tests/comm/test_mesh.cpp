// Mesh: rank <-> coordinates, the groups of each axis, and layouts that do not fit.
#include <gtest/gtest.h>

#include "comm/mesh.h"

namespace moetrain {
namespace {

std::string error_of(int64_t world, int64_t pp, int64_t dp, int64_t cp, int64_t ep) {
  try {
    Mesh m(world, pp, dp, cp, ep);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CommMesh, InfersDpAndRoundTripsCoordinates) {
  Mesh m(16, 2, -1, 2, 2);
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.str(), "pp 2 x dp 2 x cp 2 x tp 1 x ep 2 (16 ranks)");
  for (int r = 0; r < 16; ++r) EXPECT_EQ(m.rank_of(m.coord(r)), r);
  // EP innermost, then CP, DP, PP.
  EXPECT_EQ(m.coord(1), (MeshCoord{0, 0, 0, 0, 1}));
  EXPECT_EQ(m.coord(2), (MeshCoord{0, 0, 1, 0, 0}));
  EXPECT_EQ(m.coord(4), (MeshCoord{0, 1, 0, 0, 0}));
  EXPECT_EQ(m.coord(8), (MeshCoord{1, 0, 0, 0, 0}));
  EXPECT_EQ(m.coord(13), (MeshCoord{1, 1, 0, 0, 1}));
}

// TP sits between CP and EP: with tp 2 and ep 2, rank = (.. * 2 + tp) * 2 + ep.
TEST(CommMesh, TensorParallelAxisSitsBetweenCpAndEp) {
  Mesh m(16, 1, -1, 2, 2, 2);
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.tp(), 2);
  EXPECT_EQ(m.str(), "pp 1 x dp 2 x cp 2 x tp 2 x ep 2 (16 ranks)");
  for (int r = 0; r < 16; ++r) EXPECT_EQ(m.rank_of(m.coord(r)), r);
  EXPECT_EQ(m.coord(1), (MeshCoord{0, 0, 0, 0, 1}));
  EXPECT_EQ(m.coord(2), (MeshCoord{0, 0, 0, 1, 0}));
  EXPECT_EQ(m.coord(4), (MeshCoord{0, 0, 1, 0, 0}));
  EXPECT_EQ(m.coord(8), (MeshCoord{0, 1, 0, 0, 0}));
  EXPECT_EQ(m.group(5, {MeshAxis::TP}), (std::vector<int>{5, 7}));
  // FSDP's dense group (dp x cp x ep) keeps tp fixed: TP ranks hold different slices.
  EXPECT_EQ(m.group(5, {MeshAxis::DP, MeshAxis::CP, MeshAxis::EP}), (std::vector<int>{0, 1, 4, 5, 8, 9, 12, 13}));
  EXPECT_EQ(std::string(axis_name(MeshAxis::TP)), "tp");
  EXPECT_EQ(m.coord(13).at(MeshAxis::DP), 1);
}

TEST(CommMesh, GroupsPerAxisAndForFsdp) {
  Mesh m(8, 2, -1, 1, 2);  // pp 2 x dp 2 x cp 1 x ep 2
  // rank 5 = (pp 1, dp 0, cp 0, ep 1)
  EXPECT_EQ(m.group(5, {MeshAxis::EP}), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group(5, {MeshAxis::DP}), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group(5, {MeshAxis::PP}), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group(5, {MeshAxis::CP}), (std::vector<int>{5}));
  EXPECT_EQ(m.group(5, {MeshAxis::DP, MeshAxis::CP}), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group(5, {MeshAxis::DP, MeshAxis::CP, MeshAxis::EP}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(m.group_color(7, {MeshAxis::DP}), 5);
  // Every rank is in exactly one group of each family.
  for (int r = 0; r < 8; ++r) {
    for (int other : m.group(r, {MeshAxis::EP})) {
      EXPECT_EQ(m.group_color(other, {MeshAxis::EP}), m.group_color(r, {MeshAxis::EP}));
    }
  }
}

TEST(CommMesh, SizesThatDoNotFitNameTheNumbers) {
  EXPECT_NE(error_of(8, 3, -1, 1, 1).find("world size 8 is not divisible by pp * cp * tp * ep = 3 * 1 * 1 * 1 = 3"),
            std::string::npos);
  EXPECT_NE(error_of(8, 2, 3, 1, 2).find("pp * dp * cp * tp * ep = 2 * 3 * 1 * 1 * 2 = 12 but the world size is 8"),
            std::string::npos);
  EXPECT_NE(error_of(8, 1, -1, 0, 1).find("cp = 0 must be at least 1"), std::string::npos);
  EXPECT_NE(error_of(8, 1, 0, 1, 1).find("dp = 0"), std::string::npos);
  EXPECT_EQ(error_of(8, 2, 2, 1, 2), "");
  EXPECT_THROW(Mesh(4, 1, -1, 1, 1).coord(4), Error);
  EXPECT_THROW(Mesh(4, 1, -1, 1, 1).rank_of({0, 4, 0, 0, 0}), Error);
}

}  // namespace
}  // namespace moetrain
