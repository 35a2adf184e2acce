// Attention over blocks of keys (ops.h: attention_block_forward / attention_merge /
// attention_block_backward), the arithmetic of context parallelism: each sequence cut into
// 2 x cp chunks in the zigzag order (rank r holds chunks r and 2cp-1-r), every rank's queries
// against every rank's keys block by block, merged. Against the whole sequence's causal
// attention (attention_forward / attention_backward, f64): each rank's outputs and lse are the
// whole's rows at its places, its dq (summed over the blocks) the whole's dq rows, and each
// key block's dk, dv summed over the query ranks the whole's rows; with grouped heads, value
// heads of another size and packed documents. A query that sees no key of a block (a chunk
// before all of it) gets out 0 and lse -inf, which the merge passes over.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

// Rows `places` (each [0, S) within every one of the B sequences) of x [B*S, W].
Tensor rows_at(const Tensor& x, const std::vector<int32_t>& places, int64_t B, int64_t S) {
  const int64_t W = x.size(1), n = static_cast<int64_t>(places.size());
  Tensor out = Tensor::empty({B * n, W}, x.dtype());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) out.slice(b * n + i, b * n + i + 1).copy_from(x.slice(b * S + places[i], b * S + places[i] + 1));
  }
  return out;
}

Tensor ints_at(const std::vector<int32_t>& all, const std::vector<int32_t>& places, int64_t B, int64_t S) {
  std::vector<int32_t> v;
  for (int64_t b = 0; b < B; ++b) {
    for (int32_t p : places) v.push_back(all[static_cast<size_t>(b * S + p)]);
  }
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

double max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_double_vector(), y = b.to_double_vector();
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

void check_zigzag(int64_t cp, bool packed) {
  SCOPED_TRACE(::testing::Message() << "cp " << cp << (packed ? ", packed" : ""));
  const int64_t B = 2, chunk = 3, S = 2 * cp * chunk, Hq = 4, Hkv = 2, D = 6, Dv = 5;
  ops::AttentionShape whole{B, S, Hq, Hkv, D, 1.0 / std::sqrt(6.0), Dv};
  const Tensor q = testing::random_tensor({B * S, Hq * D}, DType::F64, 1);
  const Tensor k = testing::random_tensor({B * S, Hkv * D}, DType::F64, 2);
  const Tensor v = testing::random_tensor({B * S, Hkv * Dv}, DType::F64, 3);
  const Tensor dout = testing::random_tensor({B * S, Hq * Dv}, DType::F64, 4);
  std::vector<int32_t> seg(static_cast<size_t>(B * S), 0);
  if (packed) {  // documents end at places 4 and S - 5 of the first sequence
    for (int64_t s = 0; s < S; ++s) seg[static_cast<size_t>(s)] = s < 4 ? 0 : s < S - 5 ? 1 : 2;
  }
  const Tensor seg_t = packed ? Tensor::from_vector(seg, {B * S}) : Tensor();
  const ops::AttentionOut full = ops::attention_forward(q, k, v, seg_t, whole);
  const ops::AttentionGrads gfull = ops::attention_backward(dout, q, k, v, seg_t, full.out, full.lse, whole);

  // Rank r's places: chunks r and 2cp-1-r, in order.
  std::vector<std::vector<int32_t>> places(static_cast<size_t>(cp));
  for (int64_t r = 0; r < cp; ++r) {
    for (int64_t c : {r, 2 * cp - 1 - r}) {
      for (int64_t i = 0; i < chunk; ++i) places[static_cast<size_t>(r)].push_back(static_cast<int32_t>(c * chunk + i));
    }
  }
  const int64_t n = 2 * chunk;
  std::vector<int32_t> index(static_cast<size_t>(B * S));
  for (int64_t i = 0; i < B * S; ++i) index[static_cast<size_t>(i)] = static_cast<int32_t>(i % S);
  auto place_of = [&](int64_t r) {
    const auto& p = places[static_cast<size_t>(r)];
    return ops::AttentionPlaces{ints_at(index, p, B, S), packed ? ints_at(seg, p, B, S) : Tensor()};
  };
  ops::AttentionShape local = whole;
  local.seq = n;
  std::vector<Tensor> dk_sum(static_cast<size_t>(cp)), dv_sum(static_cast<size_t>(cp));
  bool some_row_saw_nothing = false;
  for (int64_t r = 0; r < cp; ++r) {
    const auto& p = places[static_cast<size_t>(r)];
    const Tensor qr = rows_at(q, p, B, S), dor = rows_at(dout, p, B, S);
    ops::AttentionOut acc;
    for (int64_t kr = 0; kr < cp; ++kr) {  // the ring: this rank's keys first, then the others'
      const int64_t src = (r + kr) % cp;
      const auto& kp = places[static_cast<size_t>(src)];
      ops::AttentionOut blk = ops::attention_block_forward(qr, rows_at(k, kp, B, S), rows_at(v, kp, B, S),
                                                           place_of(r), place_of(src), local, n);
      for (double l : blk.lse.to_double_vector()) some_row_saw_nothing |= std::isinf(l);
      if (kr == 0) {
        acc = blk;
      } else {
        ops::attention_merge(acc, blk);
      }
    }
    EXPECT_LT(max_diff(acc.out, rows_at(full.out, p, B, S)), 1e-12) << "rank " << r << " out";
    // lse [B, Hq, n] against the whole's [B, Hq, S] at the rank's places
    const std::vector<double> got = acc.lse.to_double_vector(), want = full.lse.to_double_vector();
    double worst = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          worst = std::max(worst, std::abs(got[static_cast<size_t>((b * Hq + h) * n + i)] -
                                           want[static_cast<size_t>((b * Hq + h) * S + p[static_cast<size_t>(i)])]));
        }
      }
    }
    EXPECT_LT(worst, 1e-12) << "rank " << r << " lse";
    Tensor dq;
    for (int64_t src = 0; src < cp; ++src) {
      const auto& kp = places[static_cast<size_t>(src)];
      ops::AttentionGrads g = ops::attention_block_backward(dor, qr, rows_at(k, kp, B, S), rows_at(v, kp, B, S),
                                                            place_of(r), place_of(src), acc.out, acc.lse, local, n);
      if (!dq.defined()) {
        dq = g.dq;
      } else {
        ops::add_(dq, g.dq);
      }
      Tensor& dks = dk_sum[static_cast<size_t>(src)];
      Tensor& dvs = dv_sum[static_cast<size_t>(src)];
      if (!dks.defined()) {
        dks = g.dk;
        dvs = g.dv;
      } else {
        ops::add_(dks, g.dk);
        ops::add_(dvs, g.dv);
      }
    }
    EXPECT_LT(max_diff(dq, rows_at(gfull.dq, p, B, S)), 1e-12) << "rank " << r << " dq";
  }
  for (int64_t r = 0; r < cp; ++r) {
    const auto& p = places[static_cast<size_t>(r)];
    EXPECT_LT(max_diff(dk_sum[static_cast<size_t>(r)], rows_at(gfull.dk, p, B, S)), 1e-12) << "rank " << r << " dk";
    EXPECT_LT(max_diff(dv_sum[static_cast<size_t>(r)], rows_at(gfull.dv, p, B, S)), 1e-12) << "rank " << r << " dv";
  }
  EXPECT_TRUE(some_row_saw_nothing);  // the -inf rows were exercised
}

TEST(AttentionBlocks, ZigzagContextParallelBlocksMergeIntoTheWholeAttention) {
  for (int64_t cp : {2, 3}) {
    check_zigzag(cp, false);
    check_zigzag(cp, true);
  }
}

TEST(AttentionBlocks, BadPlacesAreNamed) {
  ops::AttentionShape a{1, 2, 2, 1, 4, 0.5, 0};
  const Tensor q = Tensor::zeros({2, 8}, DType::F32), k = Tensor::zeros({3, 4}, DType::F32);
  const ops::AttentionPlaces qp{Tensor::from_vector(std::vector<int32_t>{0, 1}, {2}), Tensor()};
  const ops::AttentionPlaces kp{Tensor::from_vector(std::vector<int32_t>{0, 1}, {2}), Tensor()};
  try {
    ops::attention_block_forward(q, k, k, qp, kp, a, 3);
    ADD_FAILURE() << "k_places of 2 for 3 keys";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_places"), std::string::npos) << e.what();
  }
  const ops::AttentionPlaces kp_seg{Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3}),
                                    Tensor::from_vector(std::vector<int32_t>{0, 0, 0}, {3})};
  EXPECT_THROW(ops::attention_block_forward(q, k, k, qp, kp_seg, a, 3), Error);  // segments on one side only
}

}  // namespace
}  // namespace moetrain
