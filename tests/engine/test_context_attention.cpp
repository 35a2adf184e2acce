// ContextAttention over a Gloo group of 2, 3 and 4 ranks (threads): every rank holds its zigzag
// chunks (zigzag_batch's places) of two sequences; its out and dq, and its keys' dk and dv
// (summed over every rank's queries on their way round the ring), equal the whole sequences' causal
// attention at its places within 1e-12 (f64), with grouped heads, value heads of another size
// and packed documents.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <latch>
#include <string>
#include <thread>

#include "comm/comm_test_util.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "core/cuda_runtime.h"
#include "engine/data/loader.h"
#include "engine/parallel/context_attention.h"
#include "test_util.h"

namespace moetrain {
namespace {

Tensor rows_at(const Tensor& x, const std::vector<int32_t>& places, int64_t B, int64_t S) {
  const int64_t n = static_cast<int64_t>(places.size());
  Tensor out = Tensor::empty({B * n, x.size(1)}, x.dtype());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      out.slice(b * n + i, b * n + i + 1).copy_from(x.slice(b * S + places[static_cast<size_t>(i)],
                                                            b * S + places[static_cast<size_t>(i)] + 1));
    }
  }
  return out;
}

double max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_double_vector(), y = b.to_double_vector();
  if (x.size() != y.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

TEST(ContextAttention, ZigzagRanksTogetherGiveTheWholeAttention) {
  for (int cp : {2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << "cp " << cp);
    const int64_t B = 2, S = 4 * cp, Hq = 4, Hkv = 2, D = 6, Dv = 5;
    const ops::AttentionShape whole{B, S, Hq, Hkv, D, 0.4, Dv};
    const Tensor q = testing::random_tensor({B * S, Hq * D}, DType::F64, 11);
    const Tensor k = testing::random_tensor({B * S, Hkv * D}, DType::F64, 12);
    const Tensor v = testing::random_tensor({B * S, Hkv * Dv}, DType::F64, 13);
    const Tensor dout = testing::random_tensor({B * S, Hq * Dv}, DType::F64, 14);
    std::vector<int32_t> seg(static_cast<size_t>(B * S));
    // Sequence 0: documents of 3, S - 5 and 2 tokens (some queries then see none of a block's keys).
    for (int64_t i = 0; i < B * S; ++i) seg[static_cast<size_t>(i)] = i >= S ? 0 : i < 3 ? 0 : i < S - 2 ? 1 : 2;
    const Tensor segs = Tensor::from_vector(seg, {B * S});
    const ops::AttentionOut full = ops::attention_forward(q, k, v, segs, whole);
    const ops::AttentionGrads gfull = ops::attention_backward(dout, q, k, v, segs, full.out, full.lse, whole);
    testing::run_ranks(cp, [&](Communicator& c) {
      const std::vector<int32_t> mine = zigzag_places(S, cp, c.rank());
      std::vector<int32_t> sg;
      for (int64_t b = 0; b < B; ++b) {
        for (int32_t p : mine) sg.push_back(seg[static_cast<size_t>(b * S + p)]);
      }
      const int64_t n = static_cast<int64_t>(mine.size());
      const Tensor places = Tensor::from_vector(sg, {B * n});  // the documents at this rank's places
      ops::AttentionShape local = whole;
      local.seq = n;
      const ContextAttention attn(c);
      const Tensor qr = rows_at(q, mine, B, S), kr = rows_at(k, mine, B, S), vr = rows_at(v, mine, B, S);
      const ops::AttentionOut o = attn.forward(qr, kr, vr, places, local);
      EXPECT_LT(max_diff(o.out, rows_at(full.out, mine, B, S)), 1e-12) << "rank " << c.rank();
      const ops::AttentionGrads g = attn.backward(rows_at(dout, mine, B, S), qr, kr, vr, places, o.out, o.lse, local);
      EXPECT_LT(max_diff(g.dq, rows_at(gfull.dq, mine, B, S)), 1e-12) << "rank " << c.rank();
      EXPECT_LT(max_diff(g.dk, rows_at(gfull.dk, mine, B, S)), 1e-12) << "rank " << c.rank();
      EXPECT_LT(max_diff(g.dv, rows_at(gfull.dv, mine, B, S)), 1e-12) << "rank " << c.rank();
    });
  }
}

// The ring on two GPUs (ranks as threads, NCCL, the transfers on the ring's own stream):
// bf16 inputs at a size where the part kernels run many tiles (and the ring's own block is
// the Hopper kernels' causal case for head_dim 128), packed documents; each rank's out, dq,
// dk, dv against the whole sequences' attention on the CPU (f32 from the same bf16 values),
// within bf16's error (relative L2; one GPU's whole-sequence kernels measured 2.0-2.9e-3 on
// these inputs, the ring 2.1-2.9e-3).
TEST(ContextAttention, TwoGpuRingMatchesTheWholeAttention) {
  if (!nccl_built() || !cuda::available() || cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 GPUs and NCCL: "
                 << (!cuda::available() ? cuda::unavailable_reason() : std::string("this machine has fewer"));
  }
  for (const int64_t D : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << D);
    const int cp = 2;
    const int64_t B = 2, S = 2048, Hq = 8, Hkv = 2;
    const ops::AttentionShape whole{B, S, Hq, Hkv, D, 1.0 / std::sqrt(double(D)), 0};
    auto bf16_values = [](const Shape& shape, uint64_t seed) {
      return testing::random_tensor(shape, DType::F32, seed).to(DType::BF16).to(DType::F32);
    };
    const Tensor q = bf16_values({B * S, Hq * D}, 31), k = bf16_values({B * S, Hkv * D}, 32);
    const Tensor v = bf16_values({B * S, Hkv * D}, 33), dout = bf16_values({B * S, Hq * D}, 34);
    std::vector<int32_t> seg(static_cast<size_t>(B * S));
    for (int64_t i = 0; i < B * S; ++i) {  // sequence 0: documents of 300, 1200 and the rest
      const int64_t s = i % S;
      seg[static_cast<size_t>(i)] = i >= S ? 0 : s < 300 ? 0 : s < 1500 ? 1 : 2;
    }
    const Tensor segs = Tensor::from_vector(seg, {B * S});
    const ops::AttentionOut full = ops::attention_forward(q, k, v, segs, whole);
    const ops::AttentionGrads gfull = ops::attention_backward(dout, q, k, v, segs, full.out, full.lse, whole);

    auto store = Store::open("memory", 0, std::chrono::seconds(60));
    std::string errors[2];
    double worst[2] = {0, 0};
    std::latch done(2);
    std::thread threads[2];
    for (int r = 0; r < 2; ++r) {
      threads[r] = std::thread([&, r] {
        try {
          cuda::set_device(r);
          CommOptions opt;
          opt.timeout = std::chrono::seconds(60);
          std::unique_ptr<Communicator> comm = connect_nccl(store, r, 2, r, opt);
          const std::vector<int32_t> mine = zigzag_places(S, cp, r);
          const int64_t n = static_cast<int64_t>(mine.size());
          std::vector<int32_t> sg;
          for (int64_t b = 0; b < B; ++b) {
            for (int32_t p : mine) sg.push_back(seg[static_cast<size_t>(b * S + p)]);
          }
          const Device dev = Device::cuda(r);
          auto gpu = [&](const Tensor& x) { return rows_at(x, mine, B, S).to(DType::BF16).to(dev); };
          const Tensor docs = Tensor::from_vector(sg, {B * n}).to(dev);
          ops::AttentionShape local = whole;
          local.seq = n;
          {
            const ContextAttention attn(*comm);
            const ops::AttentionOut o = attn.forward(gpu(q), gpu(k), gpu(v), docs, local);
            const ops::AttentionGrads g = attn.backward(gpu(dout), gpu(q), gpu(k), gpu(v), docs, o.out, o.lse, local);
            const double e[4] = {testing::rel_error(o.out.to(Device::cpu()).to(DType::F32), rows_at(full.out, mine, B, S)),
                                 testing::rel_error(g.dq.to(Device::cpu()).to(DType::F32), rows_at(gfull.dq, mine, B, S)),
                                 testing::rel_error(g.dk.to(Device::cpu()).to(DType::F32), rows_at(gfull.dk, mine, B, S)),
                                 testing::rel_error(g.dv.to(Device::cpu()).to(DType::F32), rows_at(gfull.dv, mine, B, S))};
            for (double x : e) worst[r] = std::max(worst[r], std::isfinite(x) ? x : INFINITY);
            std::printf("rank %d: out %.2e dq %.2e dk %.2e dv %.2e (relative L2 against the CPU)\n", r, e[0], e[1],
                        e[2], e[3]);
          }
          comm->synchronize();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
        done.arrive_and_wait();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "") << "rank " << r;
      EXPECT_LT(worst[r], 1e-2) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace moetrain
