// CUDA tensors in core: allocation from the stream-ordered pool, copies both ways with
// dtype conversion, fills, poisoning and memory accounting. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>

#include "core/cuda_runtime.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {
namespace {

#define REQUIRE_GPU()                                                                                   \
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason()

TEST(CudaTensor, RoundTripAndConversions) {
  REQUIRE_GPU();
  Tensor h = Tensor::empty({37, 5}, DType::F32);
  fill_normal(h, 11, 1.0);
  Tensor d = h.to(Device::cuda(0));
  EXPECT_FALSE(d.device().is_cpu());
  EXPECT_EQ(d.to(Device::cpu()).to_vector<float>(), h.to_vector<float>());
  Tensor d16 = d.to(DType::BF16);  // converted through the host
  EXPECT_EQ(d16.device(), Device::cuda(0));
  EXPECT_EQ(d16.to(Device::cpu()).to_double_vector(), h.to(DType::BF16).to_double_vector());
  Tensor slice = d.slice(3, 7);
  EXPECT_EQ(slice.item(0), h.item(15));
  Tensor c = d.clone();
  c.fill_(2.5);
  EXPECT_EQ(c.item(100), 2.5);
  EXPECT_EQ(d.item(100), h.item(100));  // the clone owns its memory
  c.zero_();
  EXPECT_EQ(c.item(7), 0.0);
}

TEST(CudaTensor, PoisonAndMemoryStats) {
  REQUIRE_GPU();
  cuda::reset_device_peak();
  const int64_t before = cuda::device_memory_stats().live_bytes;
  cuda::set_poison_allocations(true);
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, Device::cuda(0));
    cuda::set_poison_allocations(false);
    EXPECT_TRUE(std::isnan(t.item(12345)));
    EXPECT_EQ(cuda::device_memory_stats().live_bytes, before + (4 << 20));
  }
  EXPECT_EQ(cuda::device_memory_stats().live_bytes, before);
  EXPECT_GE(cuda::device_memory_stats().peak_bytes, before + (4 << 20));
  std::printf("GPU: %s, %d device(s)\n", cuda::device_name(0).c_str(), cuda::device_count());
}

TEST(CudaTensor, OutOfMemoryIsAClearError) {
  REQUIRE_GPU();
  try {
    Tensor t = Tensor::empty({int64_t{1} << 40}, DType::F32, Device::cuda(0));  // 4 TiB
    FAIL() << "allocated 4 TiB";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of GPU memory"), std::string::npos) << e.what();
  }
}

TEST(CudaTensor, CpuOnlyBuildOrNoDeviceSaysWhy) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is present";
  EXPECT_FALSE(cuda::unavailable_reason().empty());
  EXPECT_THROW(Tensor::empty({4}, DType::F32, Device::cuda(0)), Error);
}

}  // namespace
}  // namespace moetrain
