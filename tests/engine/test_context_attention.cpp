// ContextAttention over a Gloo group of 2, 3 and 4 ranks (threads): every rank holds its zigzag
// chunks (zigzag_batch's places) of two sequences; its out and dq, and its keys' dk and dv
// (summed over every rank's queries on their way round the ring, or in the whole-sequence
// form the GPUs run, reduce-scattered), equal the whole sequences' causal
// attention at its places within 1e-12 (f64), with grouped heads, value heads of another size
// and packed documents.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "comm/comm_test_util.h"
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
    for (int64_t i = 0; i < B * S; ++i) seg[static_cast<size_t>(i)] = i < S && i >= 3 ? 1 : 0;  // row 0: docs 3 + rest
    const Tensor segs = Tensor::from_vector(seg, {B * S});
    const ops::AttentionOut full = ops::attention_forward(q, k, v, segs, whole);
    const ops::AttentionGrads gfull = ops::attention_backward(dout, q, k, v, segs, full.out, full.lse, whole);
    testing::run_ranks(cp, [&](Communicator& c) {
      const std::vector<int32_t> mine = zigzag_places(S, cp, c.rank());
      std::vector<int32_t> idx, sg;
      for (int64_t b = 0; b < B; ++b) {
        for (int32_t p : mine) {
          idx.push_back(p);
          sg.push_back(seg[static_cast<size_t>(b * S + p)]);
        }
      }
      const int64_t n = static_cast<int64_t>(mine.size());
      const ops::AttentionPlaces places{Tensor::from_vector(idx, {B * n}), Tensor::from_vector(sg, {B * n})};
      ops::AttentionShape local = whole;
      local.seq = n;
      for (ContextAttention::Form form : {ContextAttention::Form::kRing, ContextAttention::Form::kWhole}) {
        SCOPED_TRACE(form == ContextAttention::Form::kRing ? "ring" : "whole sequences");
        const ContextAttention attn(c, form);
        const Tensor qr = rows_at(q, mine, B, S), kr = rows_at(k, mine, B, S), vr = rows_at(v, mine, B, S);
        const ops::AttentionOut o = attn.forward(qr, kr, vr, places, local);
        EXPECT_LT(max_diff(o.out, rows_at(full.out, mine, B, S)), 1e-12) << "rank " << c.rank();
        const ops::AttentionGrads g =
            attn.backward(rows_at(dout, mine, B, S), qr, kr, vr, places, o.out, o.lse, local);
        EXPECT_LT(max_diff(g.dq, rows_at(gfull.dq, mine, B, S)), 1e-12) << "rank " << c.rank();
        EXPECT_LT(max_diff(g.dk, rows_at(gfull.dk, mine, B, S)), 1e-12) << "rank " << c.rank();
        EXPECT_LT(max_diff(g.dv, rows_at(gfull.dv, mine, B, S)), 1e-12) << "rank " << c.rank();
      }
    });
  }
}

}  // namespace
}  // namespace moetrain
