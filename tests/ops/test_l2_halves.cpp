// The L2 half probe (src/ops/cuda/l2_halves): its decision from chain times, and on a GPU
// that the probe's map covers every multiprocessor.
#include <gtest/gtest.h>

#include <vector>

#include "backend_compare.h"
#include "core/cuda_runtime.h"

#if MOETRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "ops/cuda/l2_halves.h"

namespace {

using moetrain::ops::cuda::split_l2_halves;

// Times shaped like an H100's: pairs of multiprocessors alternate between the halves in
// runs, ~290 and ~377 cycles a line, a little jitter.
std::vector<long long> two_groups(int n, std::vector<uint8_t>& truth) {
  std::vector<long long> c(static_cast<size_t>(n));
  truth.assign(static_cast<size_t>(n), 0);
  for (int s = 0; s < n; ++s) {
    const bool far = ((s / 2) % 3) != 0;  // sm 0 fast
    truth[static_cast<size_t>(s)] = far ? 1 : 0;
    c[static_cast<size_t>(s)] = (far ? 377 : 289) * 64 + (s * 37) % 90;
  }
  return c;
}

TEST(L2Halves, SplitsTwoClearGroupsWithMultiprocessorZeroInHalfZero) {
  std::vector<uint8_t> truth, half;
  int count[2] = {-1, -1};
  std::vector<long long> c = two_groups(132, truth);
  ASSERT_TRUE(split_l2_halves(c, half, count));
  EXPECT_EQ(half, truth);
  EXPECT_EQ(count[0] + count[1], 132);
  EXPECT_EQ(count[0], 44);
  // multiprocessor 0 in the slow group: the labels flip, the groups do not
  for (long long& t : c) t = 377 * 64 + 289 * 64 - t;
  ASSERT_TRUE(split_l2_halves(c, half, count));
  EXPECT_EQ(half, truth);
}

TEST(L2Halves, NoSplitWithoutAClearGap) {
  std::vector<uint8_t> half{7};
  int count[2] = {-1, -1};
  std::vector<long long> c(132);
  for (int s = 0; s < 132; ++s) c[static_cast<size_t>(s)] = 289 * 64 + (s * 53) % 700;  // < 10% spread
  EXPECT_FALSE(split_l2_halves(c, half, count));
  EXPECT_EQ(half, std::vector<uint8_t>{7});
  EXPECT_EQ(count[0], -1);
}

TEST(L2Halves, NoSplitWhenOneGroupIsSmall) {
  std::vector<uint8_t> half;
  int count[2];
  std::vector<long long> c(132, 289 * 64);
  for (int s = 0; s < 20; ++s) c[static_cast<size_t>(s * 6)] = 400 * 64;  // 20 of 132 slow: under a quarter
  EXPECT_FALSE(split_l2_halves(c, half, count));
  EXPECT_FALSE(split_l2_halves(std::vector<long long>(4, 1), half, count));  // too few to tell
}

TEST(L2Halves, ProbeCoversEveryMultiprocessor) {
  MT_REQUIRE_GPU();
  const auto& h = moetrain::ops::cuda::sm_l2_halves(static_cast<cudaStream_t>(moetrain::cuda::current_stream()));
  int dev = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
  if (!h.known()) GTEST_SKIP() << "SKIPPED: the probe found no two L2 halves on this GPU (not an H100/H200?)";
  EXPECT_EQ(h.count[0] + h.count[1], sms);
  EXPECT_GE(h.count[0], sms / 4);
  EXPECT_GE(h.count[1], sms / 4);
}

}  // namespace
#endif
