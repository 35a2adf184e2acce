// Tests of the MoE ops (router, permutation, combine, grouped SwiGLU, auxiliary losses),
// AdamW and the element-wise helpers: float64 finite-difference gradient checks of every
// differentiable input, forward checks against naive loops, and bad-input errors.
// Each gradient check prints "GRADCHECK <op> <input> <rel_err>".
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::dot;
using testing::gradcheck;
using testing::random_tensor;
using ops::AdamWStep;
using ops::CombineGrads;
using ops::Permutation;
using ops::RouterOut;
using ops::SwigluInputGrads;
using ops::SwigluOut;
using ops::ZLossOut;

constexpr double kTol = 1e-6;

void report(const std::string& op, const std::string& input, double err) {
  std::printf("GRADCHECK %s %s %.3e\n", op.c_str(), input.c_str(), err);
  std::fflush(stdout);
  EXPECT_LT(err, kTol) << op << " " << input;
}

// Runs f and expects a moetrain::Error whose message contains `needle`.
template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected moetrain::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// Router logits whose sorted values are at least 0.2 apart in every row (a random
// permutation of 0, 0.4, 0.8, ... plus uniform noise in [-0.1, 0.1]), so a finite-difference
// step of 1e-6 cannot change the top-k selection.
Tensor gapped_logits(int64_t T, int64_t E, uint64_t seed) {
  Tensor t = Tensor::empty({T, E}, DType::F64);
  double* p = t.data<double>();
  Rng rng(mix64(seed));
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int>(e);
    for (int64_t e = E - 1; e > 0; --e) std::swap(perm[e], perm[rng.below(static_cast<uint64_t>(e + 1))]);
    for (int64_t e = 0; e < E; ++e) p[r * E + e] = 0.4 * perm[e] - 1.0 + 0.2 * (rng.uniform() - 0.5);
  }
  return t;
}

std::string shape_tag(const std::string& op, const std::vector<std::pair<const char*, int64_t>>& dims) {
  std::string s = op + "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ',';
    s += dims[i].first;
    s += '=';
    s += std::to_string(dims[i].second);
  }
  return s + "]";
}

Tensor counts_tensor(const std::vector<int64_t>& c) { return Tensor::from_vector(c, {static_cast<int64_t>(c.size())}); }

// ---------------------------------------------------------------------------------------
// Router

struct RouterShape {
  int64_t T, E, K;
};
const RouterShape kRouterShapes[] = {{5, 6, 2}, {9, 8, 3}};

TEST(OpsMoe, RouterForwardMatchesNaive) {
  for (auto [T, E, K] : kRouterShapes) {
    Tensor logits = random_tensor({T, E}, DType::F64, 11 + T);
    for (bool norm : {false, true}) {
      RouterOut f = ops::router_forward(logits, K, norm);
      ASSERT_EQ(f.probs.shape(), (Shape{T, E}));
      ASSERT_EQ(f.topk_idx.shape(), (Shape{T, K}));
      ASSERT_EQ(f.topk_idx.dtype(), DType::I32);
      ASSERT_EQ(f.topk_weight.dtype(), DType::F64);
      auto l = logits.to_double_vector();
      for (int64_t t = 0; t < T; ++t) {
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += std::exp(l[t * E + e]);
        std::vector<std::pair<double, int>> pe;
        for (int64_t e = 0; e < E; ++e) {
          double p = std::exp(l[t * E + e]) / z;
          EXPECT_NEAR(f.probs.item(t * E + e), p, 1e-15);
          pe.push_back({-p, static_cast<int>(e)});
        }
        std::sort(pe.begin(), pe.end());
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += -pe[k].first;
        for (int64_t k = 0; k < K; ++k) {
          EXPECT_EQ(f.topk_idx.item(t * K + k), pe[k].second);
          EXPECT_NEAR(f.topk_weight.item(t * K + k), -pe[k].first / (norm ? s : 1.0), 1e-15);
        }
      }
    }
  }
}

TEST(OpsMoe, RouterTiesGoToLowerExpert) {
  Tensor logits = Tensor::from_vector<float>({0, 0, 0, 0, 1, 2, 1, 2}, {2, 4});
  RouterOut f = ops::router_forward(logits, 3, true);
  EXPECT_EQ(f.topk_idx.to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2, 1, 3, 0}));
  EXPECT_EQ(f.probs.dtype(), DType::F32);
  EXPECT_NEAR(f.topk_weight.item(0), 1.0 / 3, 1e-7);
}

// A selection bias (aux-loss-free balancing) changes which experts are taken, ranked by
// prob + bias, but not their weights: still the probs (renormalised over the picks).
TEST(OpsMoe, RouterSelectionBiasSteersChoiceNotWeights) {
  for (auto [T, E, K] : kRouterShapes) {
    Tensor logits = gapped_logits(T, E, 23 + T);
    std::vector<float> b(static_cast<size_t>(E));
    Rng rng(mix64(99 + E));
    for (auto& v : b) v = static_cast<float>(0.6 * (rng.uniform() - 0.5));
    b[E - 1] = 2.0f;  // above any prob gap: expert E-1 is in every row's top-k
    Tensor bias = Tensor::from_vector(b, {E});
    for (bool norm : {false, true}) {
      RouterOut f = ops::router_forward(logits, K, norm, bias);
      RouterOut plain = ops::router_forward(logits, K, norm);
      EXPECT_EQ(f.probs.to_double_vector(), plain.probs.to_double_vector());
      auto p = f.probs.to_double_vector();
      int64_t rows_changed = 0;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<std::pair<double, int>> order;
        for (int64_t e = 0; e < E; ++e) order.push_back({-(p[t * E + e] + b[e]), static_cast<int>(e)});
        std::sort(order.begin(), order.end());
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += p[t * E + order[k].second];
        bool has_last = false, same = true;
        for (int64_t k = 0; k < K; ++k) {
          const int e = order[k].second;
          EXPECT_EQ(f.topk_idx.item(t * K + k), e);
          EXPECT_NEAR(f.topk_weight.item(t * K + k), p[t * E + e] / (norm ? s : 1.0), 1e-15);
          has_last |= e == E - 1;
          same &= plain.topk_idx.item(t * K + k) == e;
        }
        EXPECT_TRUE(has_last) << "row " << t;
        rows_changed += !same;
      }
      EXPECT_GT(rows_changed, 0);  // the bias did change choices
    }
  }
  Tensor logits = gapped_logits(3, 6, 1);
  expect_error([&] { ops::router_forward(logits, 2, true, Tensor::zeros({5}, DType::F32)); }, "selection_bias");
  expect_error([&] { ops::router_forward(logits, 2, true, Tensor::zeros({6}, DType::F64)); }, "selection_bias");
}

TEST(OpsMoe, RouterGradcheck) {
  for (auto [T, E, K] : kRouterShapes) {
    const std::string tag = shape_tag("", {{"T", T}, {"E", E}, {"K", K}});
    Tensor logits = gapped_logits(T, E, 100 + T);
    Tensor r_w = random_tensor({T, K}, DType::F64, 200 + T);
    Tensor r_p = random_tensor({T, E}, DType::F64, 300 + T);
    Tensor zero_w = Tensor::zeros({T, K}, DType::F64);
    for (bool norm : {false, true}) {
      RouterOut f = ops::router_forward(logits, K, norm);
      // d topk_weight only
      Tensor g = ops::router_backward(r_w, Tensor(), f, norm);
      double err = gradcheck(logits, g, [&] { return dot(r_w, ops::router_forward(logits, K, norm).topk_weight); });
      report(std::string(norm ? "router_topk_norm" : "router_topk_nonorm") + tag, "logits", err);
      // extra dprobs only (the load-balancing path)
      g = ops::router_backward(zero_w, r_p, f, norm);
      err = gradcheck(logits, g, [&] { return dot(r_p, ops::router_forward(logits, K, norm).probs); });
      report(std::string(norm ? "router_dprobs_norm" : "router_dprobs_nonorm") + tag, "logits", err);
      // both at once
      g = ops::router_backward(r_w, r_p, f, norm);
      err = gradcheck(logits, g, [&] {
        RouterOut o = ops::router_forward(logits, K, norm);
        return dot(r_w, o.topk_weight) + dot(r_p, o.probs);
      });
      report(std::string(norm ? "router_both_norm" : "router_both_nonorm") + tag, "logits", err);
    }
  }
}

// ---------------------------------------------------------------------------------------
// DeepSeek-V3's router: sigmoid scores, group-limited top-k

// A hand-worked row: 8 experts in 4 groups of 2, keep 2 groups, pick 3.
TEST(OpsMoe, RouterSigmoidHandWorkedRow) {
  // Scores s (by logit) chosen so that group sums and the picks are clear:
  //   group 0: 0.9, 0.1 (sum 1.0)   group 1: 0.6, 0.5 (1.1)
  //   group 2: 0.8, 0.05 (0.85)     group 3: 0.7, 0.45 (1.15)
  // kept: groups 3 and 1; picks by c: 0.7 (e6), 0.6 (e2), 0.5 (e3); expert 0 (0.9) is masked.
  const std::vector<double> s = {0.9, 0.1, 0.6, 0.5, 0.8, 0.05, 0.7, 0.45};
  Tensor logits = Tensor::empty({1, 8}, DType::F64);
  for (int e = 0; e < 8; ++e) logits.data<double>()[e] = std::log(s[e] / (1 - s[e]));
  for (bool norm : {false, true}) {
    RouterOut f = ops::router_sigmoid_forward(logits, Tensor(), 3, 4, 2, norm, 2.5);
    EXPECT_EQ(f.topk_idx.to_vector<int32_t>(), (std::vector<int32_t>{6, 2, 3}));
    const double sum = norm ? 0.7 + 0.6 + 0.5 : 1.0;
    const std::vector<double> w = f.topk_weight.to_vector<double>();
    EXPECT_NEAR(w[0], 2.5 * 0.7 / sum, 1e-12);
    EXPECT_NEAR(w[1], 2.5 * 0.6 / sum, 1e-12);
    EXPECT_NEAR(w[2], 2.5 * 0.5 / sum, 1e-12);
    EXPECT_NEAR(f.probs.to_vector<double>()[0], 0.9, 1e-12);
  }
  // A bias on expert 5 lifts group 2 (0.8 + 0.05 + 0.4 = 1.25) over group 1 and picks it
  // first, while its weight stays its unbiased score.
  Tensor bias = Tensor::zeros({8}, DType::F32);
  bias.data<float>()[5] = 0.4f;
  RouterOut f = ops::router_sigmoid_forward(logits, bias, 3, 4, 2, false, 1.0);
  EXPECT_EQ(f.topk_idx.to_vector<int32_t>(), (std::vector<int32_t>{4, 6, 5}));
  EXPECT_NEAR(f.topk_weight.to_vector<double>()[2], 0.05, 1e-7);
  // One group: a plain top-k over s.
  f = ops::router_sigmoid_forward(logits, Tensor(), 3, 1, 1, false, 1.0);
  EXPECT_EQ(f.topk_idx.to_vector<int32_t>(), (std::vector<int32_t>{0, 4, 6}));
  // As HF, the other groups' choices become 0, not -inf: with every kept score biased below
  // 0, a masked expert (the lowest id among them) is picked before them.
  Tensor low = Tensor::full({8}, -2.0, DType::F32);
  f = ops::router_sigmoid_forward(logits, low, 1, 4, 2, false, 1.0);
  EXPECT_EQ(f.topk_idx.to_vector<int32_t>(), (std::vector<int32_t>{0}));
  expect_error([&] { ops::router_sigmoid_forward(logits, Tensor(), 3, 3, 2, false, 1.0); }, "n_group = 3");
  expect_error([&] { ops::router_sigmoid_forward(logits, Tensor(), 3, 4, 5, false, 1.0); }, "topk_group = 5");
  expect_error([&] { ops::router_sigmoid_forward(logits, Tensor::zeros({7}, DType::F32), 3, 4, 2, false, 1.0); },
               "bias");
}

// On random rows: the picks are the K largest biased scores of the kept groups, which are
// the groups of the largest top-2 sums (checked from the definition, row by row).
TEST(OpsMoe, RouterSigmoidPicksTheBestOfTheBestGroups) {
  const int64_t T = 40, E = 16, G = 4, TG = 2, K = 4, per = E / G;
  Tensor logits = gapped_logits(T, E, 71);
  Tensor bias = random_tensor({E}, DType::F32, 72);
  ops::scale_(bias, 0.1);
  RouterOut f = ops::router_sigmoid_forward(logits, bias, K, G, TG, true, 1.0);
  const std::vector<double> s = f.probs.to_vector<double>();
  const std::vector<float> b = bias.to_vector<float>();
  const std::vector<int32_t> idx = f.topk_idx.to_vector<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> c(E), gsum(G);
    for (int64_t e = 0; e < E; ++e) c[e] = s[t * E + e] + b[e];
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gsum[g] = v[0] + v[1];
    }
    std::vector<double> sorted = gsum;
    std::sort(sorted.rbegin(), sorted.rend());
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[t * K + k];
      EXPECT_GE(gsum[e / per], sorted[TG - 1]) << "row " << t << ": expert " << e << " of a dropped group";
      for (int64_t o = 0; o < E; ++o) {  // nothing kept and not picked beats a pick
        bool picked = false;
        for (int64_t j = 0; j < K; ++j) picked |= idx[t * K + j] == o;
        if (!picked && gsum[o / per] >= sorted[TG - 1]) {
          EXPECT_LE(c[o], c[e]) << "row " << t;
        }
      }
      if (k > 0) {
        EXPECT_GE(c[idx[t * K + k - 1]], c[e]) << "row " << t << ": descending";
      }
    }
  }
}

TEST(OpsMoe, RouterSigmoidGradcheck) {
  for (auto [T, E, K] : kRouterShapes) {
    const std::string tag = shape_tag("", {{"T", T}, {"E", E}, {"K", K}});
    Tensor logits = gapped_logits(T, E, 400 + T);
    Tensor bias = random_tensor({E}, DType::F32, 500 + T);
    ops::scale_(bias, 0.05);
    Tensor r_w = random_tensor({T, K}, DType::F64, 600 + T);
    Tensor r_p = random_tensor({T, E}, DType::F64, 700 + T);
    const int64_t G = 2, TG = 1;  // both shapes' E are even; K fits one group of E / 2
    for (bool norm : {false, true}) {
      auto fwd = [&] { return ops::router_sigmoid_forward(logits, bias, K, G, TG, norm, 2.5); };
      RouterOut f = fwd();
      Tensor g = ops::router_sigmoid_backward(r_w, Tensor(), f, norm, 2.5);
      double err = gradcheck(logits, g, [&] { return dot(r_w, fwd().topk_weight); });
      report(std::string(norm ? "router_sigmoid_norm" : "router_sigmoid_nonorm") + tag, "logits", err);
      g = ops::router_sigmoid_backward(r_w, r_p, f, norm, 2.5);
      err = gradcheck(logits, g, [&] {
        RouterOut o = fwd();
        return dot(r_w, o.topk_weight) + dot(r_p, o.probs);
      });
      report(std::string(norm ? "router_sigmoid_both_norm" : "router_sigmoid_both_nonorm") + tag, "logits", err);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Permutation

struct PermShape {
  int64_t T, E, K, H;
};
const PermShape kPermShapes[] = {{7, 5, 2, 3}, {12, 8, 3, 4}};

TEST(OpsMoe, PermutationCountsAndOrder) {
  for (auto [T, E, K, H] : kPermShapes) {
    Tensor idx = ops::router_forward(random_tensor({T, E}, DType::F32, 5 + T), K, false).topk_idx;
    Permutation p = ops::permutation_by_expert(idx, E);
    EXPECT_EQ(p.num_tokens, T);
    EXPECT_EQ(p.top_k, K);
    auto iv = idx.to_vector<int32_t>();
    // Naive: list the (t, k) pairs expert by expert.
    std::vector<int64_t> counts(E, 0);
    std::vector<int32_t> src, slot(T * K);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < T * K; ++i) {
        if (iv[i] == e) {
          slot[i] = static_cast<int32_t>(src.size());
          src.push_back(static_cast<int32_t>(i / K));
          ++counts[e];
        }
      }
    }
    EXPECT_EQ(p.expert_counts.to_vector<int64_t>(), counts);
    EXPECT_EQ(p.source_token.to_vector<int32_t>(), src);
    EXPECT_EQ(p.slot_row.to_vector<int32_t>(), slot);

    // Round trip: unpermute(permute(x)) is x with each row repeated K times.
    Tensor x = random_tensor({T, H}, DType::F32, 7 + T);
    Tensor y = ops::unpermute_forward(ops::permute_forward(x, p), p);
    ASSERT_EQ(y.shape(), (Shape{T * K, H}));
    auto xv = x.to_vector<float>(), yv = y.to_vector<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t h = 0; h < H; ++h) EXPECT_EQ(yv[(t * K + k) * H + h], xv[t * H + h]);
    // Summing the K copies back gives K * x.
    Tensor dx = ops::permute_backward(ops::permute_forward(x, p), p);
    for (int64_t i = 0; i < T * H; ++i) EXPECT_FLOAT_EQ(dx.item(i), K * xv[i]);
    // unpermute_backward inverts unpermute_forward.
    Tensor yp = random_tensor({T * K, H}, DType::F64, 9);
    EXPECT_EQ(ops::unpermute_backward(ops::unpermute_forward(yp, p), p).to_vector<double>(), yp.to_vector<double>());
  }
}

TEST(OpsMoe, PermuteGradcheck) {
  for (auto [T, E, K, H] : kPermShapes) {
    const std::string tag = shape_tag("", {{"T", T}, {"E", E}, {"K", K}, {"H", H}});
    Tensor idx = ops::router_forward(random_tensor({T, E}, DType::F64, 40 + T), K, false).topk_idx;
    Permutation p = ops::permutation_by_expert(idx, E);
    Tensor x = random_tensor({T, H}, DType::F64, 41 + T);
    Tensor r = random_tensor({T * K, H}, DType::F64, 42 + T);
    double err = gradcheck(x, ops::permute_backward(r, p), [&] { return dot(r, ops::permute_forward(x, p)); });
    report("permute" + tag, "x", err);
    Tensor yp = random_tensor({T * K, H}, DType::F64, 43 + T);
    err = gradcheck(yp, ops::unpermute_backward(r, p), [&] { return dot(r, ops::unpermute_forward(yp, p)); });
    report("unpermute" + tag, "yp", err);
  }
}

// ---------------------------------------------------------------------------------------
// Combine

TEST(OpsMoe, CombineForwardMatchesNaive) {
  const int64_t T = 4, K = 3, H = 5;
  Tensor e = random_tensor({T * K, H}, DType::F64, 1), w = random_tensor({T, K}, DType::F64, 2);
  Tensor res = random_tensor({T, H}, DType::F64, 3);
  Tensor y = ops::combine_forward(e, w, res), y0 = ops::combine_forward(e, w, Tensor());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += w.item(t * K + k) * e.item((t * K + k) * H + h);
      EXPECT_NEAR(y0.item(t * H + h), s, 1e-14);
      EXPECT_NEAR(y.item(t * H + h), s + res.item(t * H + h), 1e-14);
    }
  }
}

TEST(OpsMoe, CombineGradcheck) {
  const std::vector<std::array<int64_t, 3>> shapes = {{4, 2, 5}, {7, 3, 6}};
  for (auto [T, K, H] : shapes) {
    const std::string tag = shape_tag("combine", {{"T", T}, {"K", K}, {"H", H}});
    Tensor e = random_tensor({T * K, H}, DType::F64, 50 + T), w = random_tensor({T, K}, DType::F64, 51 + T);
    Tensor res = random_tensor({T, H}, DType::F64, 52 + T), r = random_tensor({T, H}, DType::F64, 53 + T);
    CombineGrads g = ops::combine_backward(r, e, w);
    auto loss = [&] { return dot(r, ops::combine_forward(e, w, res)); };
    report(tag, "expert_out", gradcheck(e, g.dexpert_out, loss));
    report(tag, "weight", gradcheck(w, g.dweight, loss));
    report(tag, "residual", gradcheck(res, r, loss));  // d residual = dy
  }
}

// With an order (a routing's slot_row), combine reads the expert outputs in expert order:
// the same y, dweight and (in expert order) dexpert_out as unpermuting first, bit for bit.
TEST(OpsMoe, CombineWithOrderEqualsUnpermuteThenCombine) {
  const int64_t T = 9, K = 3, H = 6, E = 4;
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) idx[static_cast<size_t>(t * K + k)] = static_cast<int32_t>((t * 7 + k * 3) % E);
  }
  const Permutation p = ops::permutation_by_expert(Tensor::from_vector(idx, {T, K}), E);
  Tensor rows = random_tensor({T * K, H}, DType::F64, 70);  // expert order
  Tensor w = random_tensor({T, K}, DType::F64, 71), res = random_tensor({T, H}, DType::F64, 72);
  Tensor dy = random_tensor({T, H}, DType::F64, 73);
  const Tensor tk = ops::unpermute_forward(rows, p);  // (t, k) order
  EXPECT_TRUE(testing::bytes_equal(ops::combine_forward(rows, w, res, p.slot_row), ops::combine_forward(tk, w, res)));
  const CombineGrads placed = ops::combine_backward(dy, rows, w, p.slot_row), plain = ops::combine_backward(dy, tk, w);
  EXPECT_TRUE(testing::bytes_equal(placed.dweight, plain.dweight));
  EXPECT_TRUE(testing::bytes_equal(placed.dexpert_out, ops::unpermute_backward(plain.dexpert_out, p)));
  // not a permutation: an error naming the order
  std::vector<int32_t> bad(static_cast<size_t>(T * K), 0);
  expect_error([&] { ops::combine_forward(rows, w, res, Tensor::from_vector(bad, {T * K})); }, "order");
  expect_error([&] { ops::combine_forward(rows, w, res, Tensor::zeros({T}, DType::I32)); }, "order must be i32");
}

// A partial permutation (experts [first, first + count) of E, the other pairs absent), as
// expert parallelism by all-gather builds it: the kept rows are the full permutation's rows
// of those experts; the ops skip absent pairs, and their backwards are still the adjoints.
TEST(OpsMoe, PartialPermutationKeepsOneRangeOfExperts) {
  const int64_t T = 11, E = 6, K = 3, H = 4, first = 2, count = 3;
  Tensor idx = ops::router_forward(random_tensor({T, E}, DType::F64, 80), K, false).topk_idx;
  const std::vector<int32_t> iv = idx.to_vector<int32_t>();
  Tensor local = ops::expert_ids_in_range(idx, first, count);
  const std::vector<int32_t> lv = local.to_vector<int32_t>();
  for (size_t i = 0; i < iv.size(); ++i) {
    EXPECT_EQ(lv[i], iv[i] >= first && iv[i] < first + count ? iv[i] - first : count) << "pair " << i;
  }
  Permutation full = ops::permutation_by_expert(idx, E);
  Permutation p = ops::permutation_by_expert(local, count + 1);
  const std::vector<int64_t> fc = full.expert_counts.to_vector<int64_t>(), pc = p.expert_counts.to_vector<int64_t>();
  int64_t before = 0, R = 0;
  for (int64_t e = 0; e < first; ++e) before += fc[e];
  for (int64_t e = 0; e < count; ++e) R += pc[e];
  for (int64_t e = 0; e < count; ++e) EXPECT_EQ(pc[e], fc[first + e]) << "expert " << first + e;
  p.rows = R;
  ASSERT_GT(R, 0);
  ASSERT_LT(R, T * K);

  Tensor x = random_tensor({T, H}, DType::F64, 81);
  Tensor xp = ops::permute_forward(x, p);
  ASSERT_EQ(xp.shape(), (Shape{R, H}));
  EXPECT_TRUE(testing::bytes_equal(xp, ops::permute_forward(x, full).slice(before, before + R)));
  // unpermute: the kept rows where their pairs are, zero for the absent ones
  Tensor yp = random_tensor({R, H}, DType::F64, 82);
  Tensor y = ops::unpermute_forward(yp, p);
  ASSERT_EQ(y.shape(), (Shape{T * K, H}));
  const std::vector<int32_t> slot = p.slot_row.to_vector<int32_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(y.item(i * H + h), slot[i] < R ? yp.item(slot[i] * H + h) : 0.0) << "pair " << i;
    }
  }
  // the backwards are the adjoints of the forwards (float64 finite differences)
  Tensor r = random_tensor({R, H}, DType::F64, 83), ry = random_tensor({T * K, H}, DType::F64, 84);
  report("permute[partial]", "x", gradcheck(x, ops::permute_backward(r, p), [&] { return dot(r, ops::permute_forward(x, p)); }));
  report("unpermute[partial]", "yp",
         gradcheck(yp, ops::unpermute_backward(ry, p), [&] { return dot(ry, ops::unpermute_forward(yp, p)); }));
  // combine over the kept rows: absent slots add nothing and get a zero d weight
  Tensor w = random_tensor({T, K}, DType::F64, 85), res = random_tensor({T, H}, DType::F64, 86);
  Tensor dy = random_tensor({T, H}, DType::F64, 87);
  EXPECT_TRUE(testing::bytes_equal(ops::combine_forward(yp, w, res, p.slot_row), ops::combine_forward(y, w, res)));
  const CombineGrads g = ops::combine_backward(dy, yp, w, p.slot_row);
  ASSERT_EQ(g.dexpert_out.shape(), (Shape{R, H}));
  for (int64_t i = 0; i < T * K; ++i) {
    if (slot[i] >= R) {
      EXPECT_EQ(g.dweight.item(i), 0.0) << "absent pair " << i;
    }
  }
  auto loss = [&] { return dot(dy, ops::combine_forward(yp, w, res, p.slot_row)); };
  report("combine[partial]", "expert_out", gradcheck(yp, g.dexpert_out, loss));
  report("combine[partial]", "weight", gradcheck(w, g.dweight, loss));
  // more rows than pairs: an error naming the shapes
  expect_error([&] { ops::combine_forward(random_tensor({T * K + 1, H}, DType::F64, 88), w, res, p.slot_row); },
               "expert_out must be [at most T*K");
}

// ---------------------------------------------------------------------------------------
// Grouped SwiGLU

struct SwigluCase {
  std::vector<int64_t> counts;
  int64_t H, I;
};
const SwigluCase kSwigluCases[] = {{{3, 0, 4}, 5, 6}, {{1, 5, 0, 2}, 4, 3}, {{0, 6}, 3, 7}};

double silu(double g) { return g / (1 + std::exp(-g)); }

TEST(OpsMoe, SwigluForwardMatchesNaive) {
  for (const auto& c : kSwigluCases) {
    const int64_t E = static_cast<int64_t>(c.counts.size()), H = c.H, I = c.I;
    int64_t N = 0;
    for (int64_t n : c.counts) N += n;
    Tensor x = random_tensor({N, H}, DType::F64, 60), wg = random_tensor({E, I, H}, DType::F64, 61, 0.5);
    Tensor wu = random_tensor({E, I, H}, DType::F64, 62, 0.5), wd = random_tensor({E, H, I}, DType::F64, 63, 0.5);
    Tensor counts = counts_tensor(c.counts);
    SwigluOut o = ops::grouped_swiglu_forward(x, counts, wg, wu, wd);
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t n = 0; n < c.counts[e]; ++n, ++row) {
        std::vector<double> a(I);
        for (int64_t i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (int64_t h = 0; h < H; ++h) {
            g += x.item(row * H + h) * wg.item((e * I + i) * H + h);
            u += x.item(row * H + h) * wu.item((e * I + i) * H + h);
          }
          EXPECT_NEAR(o.gate.item(row * I + i), g, 1e-13);
          EXPECT_NEAR(o.up.item(row * I + i), u, 1e-13);
          a[i] = silu(g) * u;
        }
        for (int64_t h = 0; h < H; ++h) {
          double y = 0;
          for (int64_t i = 0; i < I; ++i) y += a[i] * wd.item((e * H + h) * I + i);
          EXPECT_NEAR(o.y.item(row * H + h), y, 1e-13);
        }
      }
    }
    // f32 agrees with f64 to f32 precision.
    SwigluOut o32 = ops::grouped_swiglu_forward(x.to(DType::F32), counts, wg.to(DType::F32), wu.to(DType::F32),
                                                wd.to(DType::F32));
    EXPECT_LT(testing::rel_error(o32.y, o.y), 1e-5);
  }
}

TEST(OpsMoe, SwigluGradcheck) {
  for (const auto& c : kSwigluCases) {
    const int64_t E = static_cast<int64_t>(c.counts.size()), H = c.H, I = c.I;
    int64_t N = 0;
    for (int64_t n : c.counts) N += n;
    const std::string tag = shape_tag("grouped_swiglu", {{"N", N}, {"E", E}, {"H", H}, {"I", I}});
    Tensor x = random_tensor({N, H}, DType::F64, 70 + N), wg = random_tensor({E, I, H}, DType::F64, 71 + N, 0.5);
    Tensor wu = random_tensor({E, I, H}, DType::F64, 72 + N, 0.5), wd = random_tensor({E, H, I}, DType::F64, 73 + N, 0.5);
    Tensor r = random_tensor({N, H}, DType::F64, 74 + N);
    Tensor counts = counts_tensor(c.counts);
    SwigluOut o = ops::grouped_swiglu_forward(x, counts, wg, wu, wd);
    SwigluInputGrads gi = ops::grouped_swiglu_backward_input(r, counts, o.gate, o.up, wg, wu, wd);
    Tensor dwg = Tensor::zeros(wg.shape(), DType::F64), dwu = Tensor::zeros(wu.shape(), DType::F64);
    Tensor dwd = Tensor::zeros(wd.shape(), DType::F64);
    ops::grouped_swiglu_backward_weight(r, x, counts, o.gate, o.up, gi.dgate, gi.dup, dwg, dwu, dwd);
    auto loss = [&] { return dot(r, ops::grouped_swiglu_forward(x, counts, wg, wu, wd).y); };
    report(tag, "x", gradcheck(x, gi.dx, loss));
    report(tag, "w_gate", gradcheck(wg, dwg, loss));
    report(tag, "w_up", gradcheck(wu, dwu, loss));
    report(tag, "w_down", gradcheck(wd, dwd, loss));
    // With the forward's act handed over, the weight gradients are the same, bit for bit.
    Tensor ag = Tensor::zeros(wg.shape(), DType::F64), au = Tensor::zeros(wu.shape(), DType::F64);
    Tensor ad = Tensor::zeros(wd.shape(), DType::F64);
    ops::grouped_swiglu_backward_weight(r, x, counts, o.gate, o.up, gi.dgate, gi.dup, ag, au, ad, true, {}, o.act);
    EXPECT_TRUE(testing::bytes_equal(ad, dwd)) << tag;
    EXPECT_TRUE(testing::bytes_equal(ag, dwg)) << tag;
    // The gradient of an expert with no rows is exactly zero.
    for (int64_t e = 0; e < E; ++e) {
      if (c.counts[e] != 0) continue;
      for (int64_t i = 0; i < I * H; ++i) {
        EXPECT_EQ(dwg.item(e * I * H + i), 0.0);
        EXPECT_EQ(dwd.item(e * I * H + i), 0.0);
      }
    }
  }
}

TEST(OpsMoe, SwigluWeightGradsAccumulate) {
  const std::vector<int64_t> cv = {2, 3};
  Tensor counts = counts_tensor(cv);
  Tensor x = random_tensor({5, 4}, DType::F32, 1), wg = random_tensor({2, 3, 4}, DType::F32, 2);
  Tensor wu = random_tensor({2, 3, 4}, DType::F32, 3), wd = random_tensor({2, 4, 3}, DType::F32, 4);
  Tensor dy = random_tensor({5, 4}, DType::F32, 5);
  SwigluOut o = ops::grouped_swiglu_forward(x, counts, wg, wu, wd);
  SwigluInputGrads gi = ops::grouped_swiglu_backward_input(dy, counts, o.gate, o.up, wg, wu, wd);
  Tensor dwg = Tensor::zeros(wg.shape(), DType::F32), dwu = Tensor::zeros(wu.shape(), DType::F32);
  Tensor dwd = Tensor::zeros(wd.shape(), DType::F32);
  ops::grouped_swiglu_backward_weight(dy, x, counts, o.gate, o.up, gi.dgate, gi.dup, dwg, dwu, dwd);
  Tensor once_g = dwg.clone(), once_u = dwu.clone(), once_d = dwd.clone();
  ops::grouped_swiglu_backward_weight(dy, x, counts, o.gate, o.up, gi.dgate, gi.dup, dwg, dwu, dwd);
  for (int64_t i = 0; i < dwg.numel(); ++i) {
    EXPECT_FLOAT_EQ(dwg.item(i), 2 * once_g.item(i));
    EXPECT_FLOAT_EQ(dwu.item(i), 2 * once_u.item(i));
    EXPECT_FLOAT_EQ(dwd.item(i), 2 * once_d.item(i));
  }
}

// ---------------------------------------------------------------------------------------
// Load balancing (HF Qwen3-MoE) over two layers, and the z-loss

struct LbCase {
  std::vector<int64_t> rows;  // per layer
  int64_t E, K;
  bool norm;
};
const LbCase kLbCases[] = {{{6, 4}, 8, 2, true}, {{5, 5}, 6, 3, false}};
constexpr double kLbCoef = 0.7;

// The scalar loss as the engine forms it: accumulate n_e and P_e over the layers.
double lb_loss(std::vector<Tensor>& logits, int64_t K, bool norm) {
  const int64_t E = logits[0].size(1);
  Tensor sel = Tensor::zeros({E}, DType::F64), ps = Tensor::zeros({E}, DType::F64);
  int64_t R = 0;
  for (Tensor& l : logits) {
    RouterOut f = ops::router_forward(l, K, norm);
    ops::load_balance_accumulate(f.probs, f.topk_idx, sel, ps);
    R += l.size(0);
  }
  return kLbCoef * E * dot(sel, ps) / (static_cast<double>(R) * R);
}

// transformers' load_balancing_loss_func, step by step on the concatenated logits.
double lb_loss_hf(const std::vector<Tensor>& logits, int64_t K) {
  const int64_t E = logits[0].size(1);
  std::vector<std::vector<double>> rows;
  for (const Tensor& l : logits) {
    auto v = l.to_double_vector();
    for (int64_t r = 0; r < l.size(0); ++r) rows.emplace_back(v.begin() + r * E, v.begin() + (r + 1) * E);
  }
  const double R = static_cast<double>(rows.size());
  std::vector<std::vector<double>> tokens_per_expert(K, std::vector<double>(E, 0));  // mean of the mask
  std::vector<double> router_prob_per_expert(E, 0);
  for (auto& l : rows) {
    double z = 0;
    for (double x : l) z += std::exp(x);
    std::vector<std::pair<double, int>> pe;
    for (int64_t e = 0; e < E; ++e) {
      router_prob_per_expert[e] += std::exp(l[e]) / z / R;
      pe.push_back({-l[e], static_cast<int>(e)});
    }
    std::sort(pe.begin(), pe.end());
    for (int64_t k = 0; k < K; ++k) tokens_per_expert[k][pe[k].second] += 1.0 / R;
  }
  double s = 0;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t e = 0; e < E; ++e) s += tokens_per_expert[k][e] * router_prob_per_expert[e];
  return kLbCoef * s * E;
}

TEST(OpsMoe, LoadBalanceLossMatchesHfAndGradcheck) {
  for (const auto& c : kLbCases) {
    std::vector<Tensor> logits;
    int64_t R = 0;
    for (size_t i = 0; i < c.rows.size(); ++i) {
      logits.push_back(gapped_logits(c.rows[i], c.E, 80 + 7 * i + c.E));
      R += c.rows[i];
    }
    const double loss = lb_loss(logits, c.K, c.norm);
    EXPECT_NEAR(loss, lb_loss_hf(logits, c.K), 1e-14);
    EXPECT_GT(loss, 0.0);

    // Forward all layers, then each layer's gradient from the accumulated selections.
    Tensor sel = Tensor::zeros({c.E}, DType::F64), ps = Tensor::zeros({c.E}, DType::F64);
    std::vector<RouterOut> fwd;
    for (Tensor& l : logits) {
      fwd.push_back(ops::router_forward(l, c.K, c.norm));
      ops::load_balance_accumulate(fwd.back().probs, fwd.back().topk_idx, sel, ps);
    }
    double nsel = 0;
    for (double s : sel.to_vector<double>()) nsel += s;
    EXPECT_EQ(nsel, static_cast<double>(R * c.K));
    for (size_t i = 0; i < logits.size(); ++i) {
      const int64_t T = c.rows[i];
      Tensor dprobs = ops::load_balance_backward(sel, T, R, kLbCoef);
      ASSERT_EQ(dprobs.shape(), (Shape{T, c.E}));
      Tensor dlogits = ops::router_backward(Tensor::zeros({T, c.K}, DType::F64), dprobs, fwd[i], c.norm);
      const double err = gradcheck(logits[i], dlogits, [&] { return lb_loss(logits, c.K, c.norm); });
      report(shape_tag("load_balance", {{"R", R}, {"E", c.E}, {"K", c.K}, {"norm", c.norm}}),
             "logits_layer" + std::to_string(i), err);
    }
  }
}

// Router entropy: log E per row for uniform probs, 0 for one-hot rows, and -sum p log p of
// each row of random softmax probs, summed.
TEST(OpsMoe, RouterEntropySum) {
  const int64_t R = 7, E = 5;
  Tensor uniform = Tensor::full({R, E}, 1.0 / E, DType::F64);
  EXPECT_NEAR(ops::router_entropy_sum(uniform).item(0), R * std::log(5.0), 1e-12);
  Tensor one_hot = Tensor::zeros({R, E}, DType::F64);
  for (int64_t r = 0; r < R; ++r) one_hot.data<double>()[r * E + r % E] = 1.0;
  EXPECT_EQ(ops::router_entropy_sum(one_hot).item(0), 0.0);
  Tensor probs = ops::router_forward(random_tensor({R, E}, DType::F64, 3, 2.0), 1, false).probs;
  const std::vector<double> p = probs.to_double_vector();
  double want = 0;
  for (double v : p) want -= v * std::log(v);
  EXPECT_NEAR(ops::router_entropy_sum(probs).item(0), want, 1e-12);
  expect_error([&] { ops::router_entropy_sum(Tensor::zeros({5}, DType::F32)); }, "probs must be [R, E]");
}

TEST(OpsMoe, RouterZLossForwardAndGradcheck) {
  for (auto [T, E, K] : kRouterShapes) {
    Tensor logits = random_tensor({T, E}, DType::F64, 90 + T, 2.0);
    ZLossOut z = ops::router_z_loss_forward(logits);
    ASSERT_EQ(z.lse.shape(), (Shape{T}));
    ASSERT_EQ(z.loss_sum.shape(), (Shape{1}));
    double naive = 0;
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += std::exp(logits.item(t * E + e));
      EXPECT_NEAR(z.lse.item(t), std::log(s), 1e-14);
      naive += std::log(s) * std::log(s);
    }
    EXPECT_NEAR(z.loss_sum.item(), naive, 1e-12);
    const double scale = 0.3 / T;
    Tensor probs = ops::router_forward(logits, 1, false).probs;
    Tensor g = ops::router_z_loss_backward(probs, z.lse, scale);
    const double err = gradcheck(logits, g, [&] { return scale * ops::router_z_loss_forward(logits).loss_sum.item(); });
    report(shape_tag("router_z_loss", {{"R", T}, {"E", E}}), "logits", err);
  }
}

// DeepSeek-V3's sequence-wise balance loss: the loss against the formula written out per
// sequence (counts, then means), and its gradient against finite differences (sigmoid
// scores: rows that do not sum to 1).
TEST(OpsMoe, SeqBalanceLossAndGradcheck) {
  for (auto [B, S, E, K] : {std::array<int64_t, 4>{2, 5, 6, 2}, {3, 4, 8, 3}, {1, 7, 4, 3}}) {
    Tensor logits = random_tensor({B * S, E}, DType::F64, 300 + S, 1.5);
    const ops::RouterOut r = ops::router_sigmoid_forward(logits, Tensor(), K, 1, 1, true, 1.0);
    Tensor probs = r.probs.clone();
    double want = 0;
    for (int64_t b = 0; b < B; ++b) {
      std::vector<double> f(E, 0.0), P(E, 0.0);
      for (int64_t t = b * S; t < (b + 1) * S; ++t) {
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += probs.item(t * E + e);
        for (int64_t e = 0; e < E; ++e) P[e] += probs.item(t * E + e) / z / static_cast<double>(S);
        for (int64_t k = 0; k < K; ++k) f[static_cast<size_t>(r.topk_idx.item(t * K + k))] += 1.0;
      }
      for (int64_t e = 0; e < E; ++e) want += static_cast<double>(E) / static_cast<double>(K * S) * f[e] * P[e];
    }
    const std::string op = shape_tag("seq_balance", {{"B", B}, {"S", S}, {"E", E}, {"K", K}});
    EXPECT_NEAR(ops::seq_balance_loss_sum(probs, r.topk_idx, B).item(), want, 1e-12) << op;
    const double scale = 0.7;
    Tensor g = ops::seq_balance_backward(probs, r.topk_idx, B, scale);
    const double err = gradcheck(probs, g, [&] { return scale * ops::seq_balance_loss_sum(probs, r.topk_idx, B).item(); });
    report(op, "probs", err);
  }
  // Parts of sequences (context parallelism): each sequence's rows cut into two parts held
  // apart; with the whole sequences' selections and length, the parts' loss sums add up to
  // the whole loss and their gradients are the whole gradient's rows.
  {
    const int64_t B = 2, S = 6, E = 5, K = 2, half = S / 2;
    Tensor logits = random_tensor({B * S, E}, DType::F64, 77, 1.5);
    const ops::RouterOut r = ops::router_sigmoid_forward(logits, Tensor(), K, 1, 1, true, 1.0);
    const double whole_loss = ops::seq_balance_loss_sum(r.probs, r.topk_idx, B).item();
    const Tensor whole_grad = ops::seq_balance_backward(r.probs, r.topk_idx, B, 0.5);
    const ops::SeqBalanceWhole whole{ops::seq_balance_counts(r.topk_idx, B, E), S};
    double parts = 0;
    for (int64_t part = 0; part < 2; ++part) {
      Tensor p = Tensor::empty({B * half, E}, DType::F64), idx = Tensor::empty({B * half, K}, DType::I32);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t from = b * S + part * half;
        p.slice(b * half, (b + 1) * half).copy_from(r.probs.slice(from, from + half));
        idx.slice(b * half, (b + 1) * half).copy_from(r.topk_idx.slice(from, from + half));
      }
      parts += ops::seq_balance_loss_sum(p, idx, B, whole).item();
      const Tensor g = ops::seq_balance_backward(p, idx, B, 0.5, whole);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t from = b * S + part * half;
        EXPECT_LT(testing::rel_error(g.slice(b * half, (b + 1) * half), whole_grad.slice(from, from + half)), 1e-13)
            << "part " << part << " sequence " << b;
      }
      EXPECT_NE(ops::seq_balance_loss_sum(p, idx, B).item(), ops::seq_balance_loss_sum(p, idx, B, whole).item())
          << "a part's own counts are not the whole's";
    }
    EXPECT_NEAR(parts, whole_loss, 1e-14);
  }
  Tensor p = random_tensor({6, 4}, DType::F64, 1);
  expect_error([&] { ops::seq_balance_loss_sum(p, testing::random_ints({6, 2}, 0, 4, 2), 4); }, "not 4 sequences");
  expect_error([&] { ops::seq_balance_loss_sum(p, testing::random_ints({6, 2}, 0, 9, 2), 2); }, "not an expert");
}

// ---------------------------------------------------------------------------------------
// AdamW and element-wise helpers

template <typename F>
void adamw_three_steps(double tol) {
  const std::vector<double> p0 = {0.5, -1.25, 2.0, 0.0}, m0 = {0, 0, 0, 0}, v0 = {0, 0, 0, 0};
  const std::vector<std::vector<double>> grads = {{0.1, -0.2, 0.3, 1.5}, {-0.05, 0.4, 0.3, -2.0}, {0.2, 0.0, -0.1, 0.5}};
  AdamWStep s;
  s.lr = 1e-2;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  auto to_f = [](const std::vector<double>& v) { return Tensor::from_vector(std::vector<F>(v.begin(), v.end()), {4}); };
  Tensor p = to_f(p0), m = to_f(m0), v = to_f(v0);
  std::vector<double> hp = p0, hm = m0, hv = v0;
  for (int step = 1; step <= 3; ++step) {
    s.step = step;
    Tensor g = to_f(grads[step - 1]);
    ops::adamw_update(p, g, m, v, s);
    for (int i = 0; i < 4; ++i) {
      const double gi = grads[step - 1][i];
      hm[i] = 0.9 * hm[i] + 0.1 * gi;
      hv[i] = 0.95 * hv[i] + 0.05 * gi * gi;
      const double mhat = hm[i] / (1 - std::pow(0.9, step)), vhat = hv[i] / (1 - std::pow(0.95, step));
      hp[i] = hp[i] - 1e-2 * (mhat / (std::sqrt(vhat) + 1e-8) + 0.1 * hp[i]);
      EXPECT_NEAR(m.item(i), hm[i], tol) << "step " << step << " elem " << i;
      EXPECT_NEAR(v.item(i), hv[i], tol) << "step " << step << " elem " << i;
      EXPECT_NEAR(p.item(i), hp[i], tol) << "step " << step << " elem " << i;
    }
    if (step == 1) {
      // First step: m_hat = g, v_hat = g^2, so the update is lr * (sign(g) + wd * p).
      EXPECT_NEAR(p.item(0), 0.5 - 1e-2 * (1 + 0.1 * 0.5), 1e-6);
      EXPECT_NEAR(p.item(1), -1.25 - 1e-2 * (-1 + 0.1 * -1.25), 1e-6);
    }
  }
}

TEST(OpsMoe, AdamWThreeStepsMatchHandComputation) {
  adamw_three_steps<double>(1e-15);
  adamw_three_steps<float>(1e-6);
}

// bf16 moments with beta2 = 0.9999 and a constant gradient 1: v_t = 1 - beta2^t exactly.
// Each step adds 1e-4 to a v of ~0.1, under half a bf16 ulp (~2e-4 there), so
// round-to-nearest storage stalls far below the true value (the simulation below checks
// that it would); stochastic rounding keeps the mean over elements on it. The parameter
// update itself uses the unrounded moments, so params follow the f32-moment run closely.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_double_vector(), y = b.to_double_vector();
  double d = x.size() == y.size() ? 0 : INFINITY;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) d = std::max(d, std::fabs(x[i] - y[i]));
  return d;
}

TEST(OpsMoe, AdamWBf16MomentsStayUnbiased) {
  constexpr int64_t n = 4096;
  constexpr int steps = 2000;
  AdamWStep s;
  s.lr = 1e-4;
  s.beta1 = 0.9;
  s.beta2 = 0.9999;
  s.weight_decay = 0;
  Tensor p = Tensor::zeros({n}, DType::F32), g = Tensor::full({n}, 1.0, DType::F32);
  Tensor m = Tensor::zeros({n}, DType::BF16), v = Tensor::zeros({n}, DType::BF16);
  Tensor p32 = Tensor::zeros({n}, DType::F32), m32 = Tensor::zeros({n}, DType::F32), v32 = Tensor::zeros({n}, DType::F32);
  float v_nearest = 0;  // the same recursion stored with round-to-nearest bf16
  for (int step = 1; step <= steps; ++step) {
    s.step = step;
    ops::adamw_update(p, g, m, v, s);
    ops::adamw_update(p32, g, m32, v32, s);
    v_nearest = static_cast<float>(bf16(static_cast<float>(0.9999 * v_nearest + 1e-4)));
  }
  const double exact = 1.0 - std::pow(0.9999, steps);
  double mean_v = 0, mean_m = 0;
  for (double x : v.to_double_vector()) mean_v += x / n;
  for (double x : m.to_double_vector()) mean_m += x / n;
  EXPECT_GT(std::fabs(v_nearest - exact) / exact, 0.2) << "round-to-nearest would not stall: the test proves nothing";
  EXPECT_LT(std::fabs(mean_v - exact) / exact, 5e-3) << "mean v " << mean_v << " vs " << exact;
  EXPECT_LT(std::fabs(mean_m - 1.0) / 1.0, 5e-3) << "mean m " << mean_m;
  // Per element the stored moments random-walk (each step's rounding error is remembered for
  // ~1/(1 - beta2) steps), so single parameters wander a few percent of their movement at this
  // beta2; the mean over elements stays on the f32-moment run.
  const double moved = std::fabs(p32.to_double_vector()[0]);
  double mean_p = 0;
  for (double x : p.to_double_vector()) mean_p += x / n;
  std::printf("bf16 moments, beta2 0.9999, %d steps: mean v %.5f (exact %.5f, round-to-nearest %.5f), "
              "param mean %.6f vs f32 moments %.6f, worst element off by %.2f%% of the movement\n",
              steps, mean_v, exact, v_nearest, mean_p, -moved, 100 * max_abs_diff(p, p32) / moved);
  EXPECT_LT(std::fabs(std::fabs(mean_p) - moved) / moved, 2e-3) << "mean param " << mean_p << " vs " << -moved;
  EXPECT_LT(max_abs_diff(p, p32), 0.1 * moved) << "a parameter drifts far from the f32-moment run";
  // Deterministic: the same steps again round the same way.
  Tensor m2 = Tensor::zeros({n}, DType::BF16), v2 = Tensor::zeros({n}, DType::BF16), p2 = Tensor::zeros({n}, DType::F32);
  for (int step = 1; step <= 5; ++step) {
    s.step = step;
    ops::adamw_update(p2, g, m2, v2, s);
  }
  Tensor m3 = Tensor::zeros({n}, DType::BF16), v3 = Tensor::zeros({n}, DType::BF16), p3 = Tensor::zeros({n}, DType::F32);
  for (int step = 1; step <= 5; ++step) {
    s.step = step;
    ops::adamw_update(p3, g, m3, v3, s);
  }
  EXPECT_EQ(max_abs_diff(v2, v3), 0.0);
  EXPECT_EQ(max_abs_diff(p2, p3), 0.0);
}

TEST(OpsMoe, ElementwiseHelpers) {
  Tensor x = Tensor::from_vector<float>({1, -2, 3, 0.5f}, {2, 2});
  EXPECT_DOUBLE_EQ(ops::sum_squares(x), 1 + 4 + 9 + 0.25);
  ops::scale_(x, 2.0);
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{2, -4, 6, 1}));
  ops::add_(x, Tensor::from_vector<float>({1, 1, 1, 1}, {2, 2}));
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{3, -3, 7, 2}));
  EXPECT_TRUE(ops::all_finite(x));
  Tensor big = random_tensor({100001}, DType::F64, 3);
  EXPECT_TRUE(ops::all_finite(big));
  big.data<double>()[77777] = NAN;
  EXPECT_FALSE(ops::all_finite(big));
  big.data<double>()[77777] = -INFINITY;
  EXPECT_FALSE(ops::all_finite(big));
  big.data<double>()[77777] = 0;
  double naive = 0;
  for (double d : big.to_vector<double>()) naive += d * d;
  EXPECT_NEAR(ops::sum_squares(big), naive, 1e-9 * naive);
}

TEST(OpsMoe, DeterministicAcrossThreadCounts) {
  Tensor big = random_tensor({300007}, DType::F32, 4);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double s1 = ops::sum_squares(big);
  const int64_t T = 257, E = 16, K = 4, H = 33;
  Tensor logits = random_tensor({T, E}, DType::F32, 5);
  RouterOut f1 = ops::router_forward(logits, K, true);
  Permutation p1 = ops::permutation_by_expert(f1.topk_idx, E);
  Tensor dxp = random_tensor({T * K, H}, DType::F32, 6);
  Tensor dx1 = ops::permute_backward(dxp, p1);
  omp_set_num_threads(std::max(2, saved));
  const double s2 = ops::sum_squares(big);
  RouterOut f2 = ops::router_forward(logits, K, true);
  Tensor dx2 = ops::permute_backward(dxp, ops::permutation_by_expert(f2.topk_idx, E));
  omp_set_num_threads(saved);
  EXPECT_EQ(std::memcmp(&s1, &s2, sizeof(double)), 0);
  EXPECT_EQ(f1.topk_idx.to_vector<int32_t>(), f2.topk_idx.to_vector<int32_t>());
  EXPECT_EQ(f1.topk_weight.to_vector<float>(), f2.topk_weight.to_vector<float>());
  EXPECT_EQ(dx1.to_vector<float>(), dx2.to_vector<float>());
}

// ---------------------------------------------------------------------------------------
// Bad input

TEST(OpsMoe, BadInputThrows) {
  Tensor logits = random_tensor({4, 5}, DType::F32, 1);
  expect_error([&] { ops::router_forward(logits, 6, false); }, "top_k = 6");
  expect_error([&] { ops::router_forward(logits, 0, false); }, "top_k = 0");
  expect_error([&] { ops::router_forward(random_tensor({20}, DType::F32, 1), 2, false); }, "logits");
  expect_error([&] { ops::router_forward(Tensor::zeros({4, 5}, DType::I32), 2, false); }, "f32 or f64");
  RouterOut f = ops::router_forward(logits, 2, true);
  expect_error([&] { ops::router_backward(Tensor::zeros({4, 3}, DType::F32), Tensor(), f, true); }, "dtopk_weight");
  expect_error([&] { ops::router_backward(Tensor::zeros({4, 2}, DType::F64), Tensor(), f, true); }, "mixed dtypes");
  expect_error([&] { ops::router_backward(Tensor::zeros({4, 2}, DType::F32), Tensor::zeros({4, 4}, DType::F32), f, true); },
               "dprobs");

  Tensor idx = Tensor::from_vector<int32_t>({0, 1, 2, 7}, {2, 2});
  expect_error([&] { ops::permutation_by_expert(idx, 4); }, "topk_idx[1, 1] = 7");
  expect_error([&] { ops::permutation_by_expert(Tensor::from_vector<int32_t>({0, -1}, {1, 2}), 4); }, "= -1");
  expect_error([&] { ops::permutation_by_expert(Tensor::from_vector<int64_t>({0, 1}, {1, 2}), 4); }, "i32");
  Permutation p = ops::permutation_by_expert(Tensor::from_vector<int32_t>({0, 1, 2, 3}, {2, 2}), 4);
  expect_error([&] { ops::permute_forward(Tensor::zeros({3, 4}, DType::F32), p); }, "x must be [2, H]");
  expect_error([&] { ops::permute_backward(Tensor::zeros({3, 4}, DType::F32), p); }, "dxp");
  expect_error([&] { ops::unpermute_forward(Tensor::zeros({2, 4}, DType::F32), p); }, "yp");

  Tensor e = Tensor::zeros({6, 4}, DType::F32);
  expect_error([&] { ops::combine_forward(e, Tensor::zeros({2, 2}, DType::F32), Tensor()); }, "expert_out");
  expect_error([&] { ops::combine_forward(e, Tensor::zeros({3, 2}, DType::F32), Tensor::zeros({3, 5}, DType::F32)); },
               "residual");
  expect_error([&] { ops::combine_forward(e, Tensor::zeros({3, 2}, DType::F64), Tensor()); }, "mixed dtypes");
  expect_error([&] { ops::combine_backward(Tensor::zeros({2, 4}, DType::F32), e, Tensor::zeros({3, 2}, DType::F32)); },
               "dy");

  Tensor x = Tensor::zeros({5, 4}, DType::F32), wg = Tensor::zeros({2, 3, 4}, DType::F32);
  Tensor wu = wg.clone(), wd = Tensor::zeros({2, 4, 3}, DType::F32);
  expect_error([&] { ops::grouped_swiglu_forward(x, counts_tensor({2, 4}), wg, wu, wd); }, "sum to 6");
  expect_error([&] { ops::grouped_swiglu_forward(x, counts_tensor({6, -1}), wg, wu, wd); }, "counts[1] = -1");
  expect_error([&] { ops::grouped_swiglu_forward(x, Tensor::from_vector<int32_t>({2, 3}, {2}), wg, wu, wd); },
               "counts");
  expect_error([&] { ops::grouped_swiglu_forward(x, counts_tensor({2, 3, 0}), wg, wu, wd); }, "counts");
  expect_error([&] { ops::grouped_swiglu_forward(x, counts_tensor({2, 3}), wg, wu, Tensor::zeros({2, 3, 4}, DType::F32)); },
               "w_down");
  expect_error([&] { ops::grouped_swiglu_forward(x, counts_tensor({2, 3}), wg, wu.to(DType::F64), wd); }, "mixed dtypes");

  Tensor probs = f.probs;
  Tensor sel = Tensor::zeros({5}, DType::F64), ps = Tensor::zeros({5}, DType::F32);
  expect_error([&] { ops::load_balance_accumulate(probs, f.topk_idx, sel, ps); }, "mixed dtypes");
  Tensor sel32 = Tensor::zeros({4}, DType::F32);
  expect_error([&] { ops::load_balance_accumulate(probs, f.topk_idx, sel32, ps); }, "selections");
  expect_error([&] { ops::load_balance_backward(ps, 4, 0, 0.01); }, "total_rows");
  expect_error([&] { ops::router_z_loss_backward(probs, Tensor::zeros({3}, DType::F32), 1.0); }, "lse");

  Tensor param = Tensor::zeros({4}, DType::F32), m = param.clone(), v = param.clone();
  AdamWStep s;
  s.lr = 1e-3;
  expect_error([&] { ops::adamw_update(param, Tensor::zeros({5}, DType::F32), m, v, s); }, "grad");
  expect_error([&] { ops::adamw_update(param, param.to(DType::F64), m, v, s); }, "mixed dtypes");
  s.step = 0;
  expect_error([&] { ops::adamw_update(param, param.clone(), m, v, s); }, "step = 0");
  expect_error([&] { ops::add_(param, Tensor::zeros({2, 2}, DType::F32)); }, "add_");
  expect_error([&] { ops::sum_squares(Tensor::zeros({2}, DType::I32)); }, "sum_squares");
}

}  // namespace
}  // namespace moetrain
