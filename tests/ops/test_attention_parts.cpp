// Attention between parts of the sequences (ops.h: attention_part_forward / attention_merge /
// attention_part_backward), the arithmetic of context parallelism's ring, on the CPU (f64):
// - each part against a brute-force softmax over an explicit mask (query rows of the part,
//   key rows of the part, causal or not, the queries' and keys' documents apart), with rows
//   outside the part or seeing no key at out 0 and lse -inf;
// - its backward against central finite differences of sum(out * dout);
// - two parts that split a rectangle's keys, merged, against the rectangle itself, and
//   their backwards (from the merged out and lse) adding up to the rectangle's.
// The zigzag ring built from these parts is checked against whole-sequence attention in
// tests/engine/test_context_attention.cpp; the CUDA kernels against this reference in
// test_backend_attention.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

double max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_double_vector(), y = b.to_double_vector();
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(x[i]) && x[i] == y[i]) continue;
    m = std::max(m, std::abs(x[i] - y[i]));
  }
  return m;
}

constexpr int64_t B = 2, S = 10, Hq = 4, Hkv = 2, D = 3, Dv = 5;
const ops::AttentionShape kShape{B, S, Hq, Hkv, D, 0.7, Dv};

// Documents: the queries' rows cut at 4 and 7, the keys' (another rank's rows) at 2 and 8.
Tensor documents(bool keys) {
  std::vector<int32_t> seg(static_cast<size_t>(B * S));
  for (int64_t i = 0; i < B * S; ++i) {
    const int64_t s = i % S;
    seg[static_cast<size_t>(i)] = keys ? (s < 2 ? 0 : s < 8 ? 1 : 2) : (s < 4 ? 0 : s < 7 ? 1 : 2);
  }
  return Tensor::from_vector(seg, {B * S});
}

// out and lse by the definition: an explicit mask, a softmax per (sequence, head, row).
ops::AttentionOut brute_force(const Tensor& q, const Tensor& k, const Tensor& v, const ops::AttentionPart& p) {
  const std::vector<double> Q = q.to_double_vector(), K = k.to_double_vector(), V = v.to_double_vector();
  std::vector<double> qs, ks;
  if (p.q_segments.defined()) qs = p.q_segments.to_double_vector(), ks = p.k_segments.to_double_vector();
  std::vector<double> out(static_cast<size_t>(B * S * Hq * Dv), 0.0),
      lse(static_cast<size_t>(B * Hq * S), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      for (int64_t i = p.q_begin; i < p.q_end; ++i) {
        std::vector<double> w(static_cast<size_t>(S), 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        std::vector<bool> seen(static_cast<size_t>(S), false);
        for (int64_t j = p.k_begin; j < p.k_end; ++j) {
          if (p.causal && j > i) continue;
          if (!qs.empty() && qs[static_cast<size_t>(b * S + i)] != ks[static_cast<size_t>(b * S + j)]) continue;
          double d = 0;
          for (int64_t e = 0; e < D; ++e) {
            d += Q[static_cast<size_t>((b * S + i) * Hq * D + h * D + e)] *
                 K[static_cast<size_t>((b * S + j) * Hkv * D + g * D + e)];
          }
          w[static_cast<size_t>(j)] = kShape.scale * d;
          seen[static_cast<size_t>(j)] = true;
          mx = std::max(mx, w[static_cast<size_t>(j)]);
        }
        if (std::isinf(mx)) continue;
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += seen[static_cast<size_t>(j)] ? std::exp(w[static_cast<size_t>(j)] - mx) : 0;
        for (int64_t j = 0; j < S; ++j) {
          if (!seen[static_cast<size_t>(j)]) continue;
          const double pj = std::exp(w[static_cast<size_t>(j)] - mx) / sum;
          for (int64_t e = 0; e < Dv; ++e) {
            out[static_cast<size_t>((b * S + i) * Hq * Dv + h * Dv + e)] +=
                pj * V[static_cast<size_t>((b * S + j) * Hkv * Dv + g * Dv + e)];
          }
        }
        lse[static_cast<size_t>((b * Hq + h) * S + i)] = mx + std::log(sum);
      }
    }
  }
  return {Tensor::from_vector(out, {B * S, Hq * Dv}), Tensor::from_vector(lse, {B, Hq, S})};
}

struct Inputs {
  Tensor q = testing::random_tensor({B * S, Hq * D}, DType::F64, 21);
  Tensor k = testing::random_tensor({B * S, Hkv * D}, DType::F64, 22);
  Tensor v = testing::random_tensor({B * S, Hkv * Dv}, DType::F64, 23);
  Tensor dout = testing::random_tensor({B * S, Hq * Dv}, DType::F64, 24);
};

// The parts the zigzag ring makes, and odd ones besides.
std::vector<ops::AttentionPart> parts(bool documents_on) {
  std::vector<ops::AttentionPart> all = {
      {0, S, 0, S, true}, {0, S, 0, S / 2, false}, {S / 2, S, 0, S, false}, {3, 8, 1, 9, false},
      {2, 7, 2, 7, true}, {4, 4, 0, S, false},     {0, S, 5, 5, false},
  };
  if (documents_on) {
    for (auto& p : all) p.q_segments = documents(false), p.k_segments = documents(true);
  }
  return all;
}

std::string name(const ops::AttentionPart& p) {
  return "q [" + std::to_string(p.q_begin) + ", " + std::to_string(p.q_end) + ") k [" + std::to_string(p.k_begin) +
         ", " + std::to_string(p.k_end) + ")" + (p.causal ? " causal" : "") +
         (p.q_segments.defined() ? " documents" : "");
}

TEST(AttentionParts, ForwardIsTheSoftmaxOverThePartsKeys) {
  Inputs in;
  bool some_row_saw_nothing = false;
  for (bool docs : {false, true}) {
    for (const ops::AttentionPart& p : parts(docs)) {
      SCOPED_TRACE(name(p));
      const ops::AttentionOut got = ops::attention_part_forward(in.q, in.k, in.v, p, kShape);
      const ops::AttentionOut want = brute_force(in.q, in.k, in.v, p);
      EXPECT_LT(max_diff(got.out, want.out), 1e-12);
      EXPECT_LT(max_diff(got.lse, want.lse), 1e-12);
      for (double l : got.lse.to_double_vector()) some_row_saw_nothing |= std::isinf(l);
    }
  }
  EXPECT_TRUE(some_row_saw_nothing);
}

TEST(AttentionParts, BackwardMatchesFiniteDifferences) {
  for (bool docs : {false, true}) {
    for (const ops::AttentionPart& p : parts(docs)) {
      SCOPED_TRACE(name(p));
      Inputs in;
      const ops::AttentionOut o = ops::attention_part_forward(in.q, in.k, in.v, p, kShape);
      const ops::AttentionGrads g = ops::attention_part_backward(in.dout, in.q, in.k, in.v, p, o.out, o.lse, kShape);
      const std::vector<double> dy = in.dout.to_double_vector();
      auto loss = [&] {
        const std::vector<double> y = ops::attention_part_forward(in.q, in.k, in.v, p, kShape).out.to_double_vector();
        double l = 0;
        for (size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
        return l;
      };
      EXPECT_LT(testing::gradcheck(in.q, g.dq, loss), 1e-7) << "dq";
      EXPECT_LT(testing::gradcheck(in.k, g.dk, loss), 1e-7) << "dk";
      EXPECT_LT(testing::gradcheck(in.v, g.dv, loss), 1e-7) << "dv";
    }
  }
}

// A rectangle's keys in two parts: merged, they give the rectangle; their backwards from the
// merged out and lse give its dq as a sum and its dk, dv row by row.
TEST(AttentionParts, MergedPartsAreTheWhole) {
  Inputs in;
  for (bool docs : {false, true}) {
    SCOPED_TRACE(docs ? "documents" : "no documents");
    ops::AttentionPart whole{0, S, 0, S, false}, first{0, S, 0, 6, false}, second{0, S, 6, S, false};
    for (ops::AttentionPart* p : {&whole, &first, &second}) {
      if (docs) p->q_segments = documents(false), p->k_segments = documents(true);
    }
    const ops::AttentionOut w = ops::attention_part_forward(in.q, in.k, in.v, whole, kShape);
    ops::AttentionOut acc = ops::attention_part_forward(in.q, in.k, in.v, first, kShape);
    ops::attention_merge(acc, ops::attention_part_forward(in.q, in.k, in.v, second, kShape));
    EXPECT_LT(max_diff(acc.out, w.out), 1e-12);
    EXPECT_LT(max_diff(acc.lse, w.lse), 1e-12);
    const ops::AttentionGrads gw = ops::attention_part_backward(in.dout, in.q, in.k, in.v, whole, w.out, w.lse, kShape);
    ops::AttentionGrads g1 = ops::attention_part_backward(in.dout, in.q, in.k, in.v, first, acc.out, acc.lse, kShape);
    const ops::AttentionGrads g2 =
        ops::attention_part_backward(in.dout, in.q, in.k, in.v, second, acc.out, acc.lse, kShape);
    ops::add_(g1.dq, g2.dq);
    ops::add_(g1.dk, g2.dk);  // rows apart: zero where the other part's keys are
    ops::add_(g1.dv, g2.dv);
    EXPECT_LT(max_diff(g1.dq, gw.dq), 1e-12);
    EXPECT_LT(max_diff(g1.dk, gw.dk), 1e-12);
    EXPECT_LT(max_diff(g1.dv, gw.dv), 1e-12);
  }
}

TEST(AttentionParts, BadPartsAreNamed) {
  Inputs in;
  auto message = [&](const ops::AttentionPart& p) {
    try {
      ops::attention_part_forward(in.q, in.k, in.v, p, kShape);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_TRUE(testing::has(message({0, S + 1, 0, S, false}), "must lie in [0, 10)")) << message({0, S + 1, 0, S});
  EXPECT_TRUE(testing::has(message({0, S, 0, 5, true}), "a causal part takes the same rows"));
  ops::AttentionPart one_sided{0, S, 0, S, false};
  one_sided.q_segments = documents(false);
  EXPECT_TRUE(testing::has(message(one_sided), "segments given for the queries or the keys only"));
  ops::AttentionPart short_docs{0, S, 0, S, false};
  short_docs.q_segments = documents(false);
  short_docs.k_segments = Tensor::from_vector(std::vector<int32_t>{0, 1}, {2});
  EXPECT_TRUE(testing::has(message(short_docs), "k_segments"));
}

}  // namespace
}  // namespace moetrain
