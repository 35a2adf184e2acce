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

// Several device tensors of different dtypes and odd sizes (so their places in the gathered
// buffer need aligning), a host tensor and an undefined one, read back with one wait.
TEST(CudaTensor, ToHostReadsManyWithOneWait) {
  REQUIRE_GPU();
  std::vector<Tensor> host;
  for (DType t : {DType::F32, DType::I64, DType::BF16, DType::F64, DType::I16, DType::I32}) {
    Tensor h = Tensor::empty({static_cast<int64_t>(host.size()) * 2 + 3}, DType::F64);
    fill_normal(h, 20 + host.size(), 100.0);
    host.push_back(h.to(t));
  }
  std::vector<Tensor> in;
  for (const Tensor& h : host) in.push_back(h.to(Device::cuda(0)));
  const Tensor on_host = Tensor::full({2}, 4.0, DType::F32);
  in.push_back(on_host);
  in.push_back(Tensor());
  const int64_t before = cuda::host_waits();
  const std::vector<Tensor> out = to_host(in);
  EXPECT_EQ(cuda::host_waits() - before, 1);
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_TRUE(out[i].device().is_cpu());
    EXPECT_EQ(out[i].dtype(), host[i].dtype());
    EXPECT_EQ(out[i].shape(), host[i].shape());
    EXPECT_EQ(out[i].to_double_vector(), host[i].to_double_vector()) << dtype_name(host[i].dtype());
  }
  EXPECT_EQ(out[host.size()].raw(), on_host.raw());  // host tensors come back as they are
  EXPECT_FALSE(out.back().defined());
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

// Column blocks on the GPU (a strided copy) against the same on the host.
TEST(CudaTensor, ColumnBlocksMatchTheHost) {
  REQUIRE_GPU();
  Tensor a = Tensor::empty({33, 5}, DType::F32), b = Tensor::empty({33, 9}, DType::F32);
  fill_normal(a, 3, 1.0);
  fill_normal(b, 4, 1.0);
  Tensor host = Tensor::zeros({33, 14}, DType::F32);
  host.copy_columns_from(0, a);
  host.copy_columns_from(5, b);
  Tensor dev = Tensor::zeros({33, 14}, DType::BF16, Device::cuda(0));
  dev.copy_columns_from(0, a.to(DType::BF16).to(Device::cuda(0)));
  dev.copy_columns_from(5, b.to(DType::BF16).to(Device::cuda(0)));
  EXPECT_EQ(dev.to(Device::cpu()).to_double_vector(), host.to(DType::BF16).to_double_vector());
  EXPECT_EQ(dev.columns(5, 14).to(Device::cpu()).to_double_vector(), b.to(DType::BF16).to_double_vector());
}

TEST(CudaTensor, CpuOnlyBuildOrNoDeviceSaysWhy) {
  if (cuda::available()) GTEST_SKIP() << "a GPU is present";
  EXPECT_FALSE(cuda::unavailable_reason().empty());
  EXPECT_THROW(Tensor::empty({4}, DType::F32, Device::cuda(0)), Error);
}

}  // namespace
}  // namespace moetrain
