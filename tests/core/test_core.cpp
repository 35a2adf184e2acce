#include <gtest/gtest.h>

#include <malloc.h>

#include <cmath>

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {
namespace {

TEST(Tensor, ShapesViewsAndSlices) {
  Tensor t = Tensor::zeros({4, 3}, DType::F32);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  EXPECT_EQ(t.size(-1), 3);
  float* p = t.data<float>();
  for (int i = 0; i < 12; ++i) p[i] = static_cast<float>(i);
  Tensor rows = t.slice(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  EXPECT_EQ(rows.item(0), 3.0);
  Tensor row = t.select(2);
  EXPECT_EQ(row.shape(), (Shape{3}));
  EXPECT_EQ(row.item(2), 8.0);
  row.fill_(-1);  // a view writes through to its storage
  EXPECT_EQ(t.item(7), -1.0);
  EXPECT_EQ(t.view({2, 6}).item(11), 11.0);
  EXPECT_THROW(t.view({5}), Error);
  EXPECT_THROW(t.slice(2, 5), Error);
  EXPECT_THROW(t.data<double>(), Error);
  EXPECT_THROW(t.size(2), Error);
}

// What Projections' codes cache asks of a tensor: whether others hold its storage, and whether
// it is all of that storage (a slice or a part is not).
TEST(Tensor, TellsWhetherItIsSharedAndWhole) {
  Tensor t = Tensor::zeros({4, 6}, DType::F32);
  EXPECT_TRUE(t.whole_storage());
  EXPECT_FALSE(t.storage_shared());
  {
    const Tensor rows = t.slice(1, 3), first = t.slice(0, 2), all = t.view({6, 4});
    EXPECT_TRUE(t.storage_shared());
    EXPECT_FALSE(rows.whole_storage());
    EXPECT_FALSE(first.whole_storage());  // starts where t does, but is not all of it
    EXPECT_TRUE(all.whole_storage());
  }
  EXPECT_FALSE(t.storage_shared());
  EXPECT_FALSE(Tensor().whole_storage());
  EXPECT_FALSE(Tensor().storage_shared());
}

TEST(Tensor, CopiesConvertDtypes) {
  Tensor a = Tensor::from_vector<double>({1.5, -2.25, 3.0e-3, 65504.0}, {4});
  Tensor f = a.to(DType::F32);
  EXPECT_EQ(f.item(1), -2.25);
  Tensor b = a.to(DType::BF16);
  EXPECT_EQ(b.item(0), 1.5);
  EXPECT_NEAR(b.item(2), 3.0e-3, 3.0e-3 / 128);  // 8 significant bits
  Tensor i = a.to(DType::I64);
  EXPECT_EQ(i.item(1), -2.0);
  Tensor c = a.clone();
  c.fill_(0);
  EXPECT_EQ(a.item(0), 1.5);  // clone owns its bytes
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::nanf("")))));
}

TEST(Tensor, ColumnBlocksCopyInAndOut) {
  Tensor a = Tensor::empty({5, 3}, DType::F32), b = Tensor::empty({5, 4}, DType::F32);
  fill_normal(a, 1, 1.0);
  fill_normal(b, 2, 1.0);
  Tensor ab = Tensor::full({5, 7}, -1.0, DType::F32);
  ab.copy_columns_from(0, a);
  ab.copy_columns_from(3, b);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 7; ++c) {
      EXPECT_EQ(ab.item(r * 7 + c), c < 3 ? a.item(r * 3 + c) : b.item(r * 4 + c - 3)) << r << "," << c;
    }
  }
  EXPECT_EQ(ab.columns(3, 7).to_vector<float>(), b.to_vector<float>());
  EXPECT_EQ(ab.columns(0, 3).to_vector<float>(), a.to_vector<float>());
  EXPECT_EQ(ab.columns(2, 2).numel(), 0);
  EXPECT_THROW(ab.copy_columns_from(5, a), Error);                           // past the last column
  EXPECT_THROW(ab.copy_columns_from(0, Tensor::zeros({4, 3}, DType::F32)), Error);  // rows differ
  EXPECT_THROW(ab.copy_columns_from(0, a.to(DType::F64)), Error);                // dtype differs
  EXPECT_THROW(ab.columns(6, 8), Error);
}

TEST(Tensor, ErrorsNameTheTensor) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  try {
    check_shape(t, {3, 2}, "model.norm.weight");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[3, 2]"), std::string::npos);
  }
  if (!cuda::available()) {
    EXPECT_THROW(Tensor::empty({2}, DType::F32, Device::cuda(0)), Error);
  }
}

TEST(Tensor, ReleasedMemoryIsGivenBackAndViewsSurviveIt) {
  const int64_t before = host_memory_stats().live_bytes;
  Tensor t = Tensor::zeros({256, 4}, DType::F32);
  Tensor view = t.slice(10, 20);
  EXPECT_EQ(host_memory_stats().live_bytes, before + 4096);
  view.release_memory();  // the whole storage goes, whichever view asks
  EXPECT_FALSE(t.memory_resident());
  EXPECT_EQ(host_memory_stats().live_bytes, before);
  try {
    t.item(0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("released"), std::string::npos) << e.what();
  }
  t.restore_memory();
  EXPECT_TRUE(view.memory_resident());
  t.fill_(2.0);
  EXPECT_EQ(view.item(3), 2.0);  // the view sees the new memory
  EXPECT_EQ(host_memory_stats().live_bytes, before + 4096);
}

TEST(Rng, CounterBasedStreamsAreSliceable) {
  const uint64_t key = stream_key(1234, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_NE(key, stream_key(1234, "model.layers.1.self_attn.q_proj.weight"));
  EXPECT_NE(key, stream_key(1235, "model.layers.0.self_attn.q_proj.weight"));
  Tensor whole = Tensor::empty({6, 4}, DType::F64);
  fill_normal(whole, key, 0.02);
  Tensor shard = Tensor::empty({2, 4}, DType::F64);
  fill_normal(shard, key, 0.02, /*first_element=*/8);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(shard.item(i), whole.item(8 + i));
}

TEST(Rng, NormalMoments) {
  const int n = 200000;
  double s = 0, s2 = 0;
  for (int i = 0; i < n; ++i) {
    double x = normal_at(99, i);
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
  Rng a(5), b(5);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(a.next_u64(), b.next_u64());
  for (int i = 0; i < 1000; ++i) EXPECT_LT(a.below(7), 7u);
}

TEST(Allocator, TracksPeak) {
  reset_host_peak();
  const int64_t before = host_memory_stats().live_bytes;
  {
    Tensor big = Tensor::empty({1 << 20}, DType::F32);
    EXPECT_GE(host_memory_stats().live_bytes, before + (4 << 20));
  }
  EXPECT_EQ(host_memory_stats().live_bytes, before);
  EXPECT_GE(host_memory_stats().peak_bytes, before + (4 << 20));
}

// keep_host_heap: a large block freed stays in the heap for the next step (glibc would have
// served it by mmap and unmapped it on free, so that the next allocation faults its pages in
// again). Read through glibc's own accounting, which the sanitizers replace.
TEST(Allocator, KeptHeapHoldsFreedLargeBlocks) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers replace malloc: glibc's heap settings do not apply";
#else
  keep_host_heap();
  const size_t bytes = 64u << 20;
  const struct mallinfo2 start = mallinfo2();
  void* p = host_alloc(bytes);
  const struct mallinfo2 held = mallinfo2();
  EXPECT_EQ(held.hblkhd, start.hblkhd);              // not mmapped
  EXPECT_GE(held.arena, start.arena + bytes);        // but from the heap
  host_free(p, bytes);
  const struct mallinfo2 freed = mallinfo2();
  EXPECT_GE(freed.arena, start.arena + bytes);       // still there: not trimmed
  EXPECT_GE(freed.fordblks, start.fordblks + bytes);  // free, for the next allocation
  void* again = host_alloc(bytes);
  EXPECT_EQ(mallinfo2().arena, freed.arena);  // reused: the heap did not grow
  host_free(again, bytes);
#endif
}

}  // namespace
}  // namespace moetrain
