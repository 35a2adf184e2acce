// Tests of the dense CPU ops: embedding, linear, RMSNorm, RoPE, attention, cross-entropy.
//
// For each op: a float64 central-finite-difference check of every differentiable input
// (loss = sum(R * output) for a fixed random R, so the analytic gradient is the backward
// with dy = R), a forward check against an independent naive computation, f32 vs f64
// agreement, bad-input errors, and (where work is split over threads) bitwise equality
// between 1 and 2 OpenMP threads. Each gradient check prints
// `GRADCHECK <op> <input> <rel_err>`.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "test_util.h"

namespace {

namespace ops = moetrain::ops;
using moetrain::DType;
using moetrain::Error;
using moetrain::Rng;
using moetrain::Shape;
using moetrain::Tensor;
using moetrain::testing::dot;
using moetrain::testing::gradcheck;
using moetrain::testing::random_ints;
using moetrain::testing::random_tensor;
using moetrain::testing::rel_error;

constexpr double kGradTol = 1e-6;
constexpr uint64_t kSeeds[] = {11, 22, 33};

void check_grad(const std::string& op, const char* input, Tensor& x, const Tensor& analytic,
                const std::function<double()>& loss) {
  const double err = gradcheck(x, analytic, loss);
  std::printf("GRADCHECK %s %s %.3e\n", op.c_str(), input, err);
  std::fflush(stdout);
  EXPECT_LT(err, kGradTol) << op << " d" << input;
}

// A dimension in [lo, hi] drawn from rng.
int64_t dim(Rng& rng, int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng.below(hi - lo + 1)); }

// Runs f with 1 and then 2 OpenMP threads and returns both results.
template <typename F>
auto with_threads(F f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  auto a = f();
  omp_set_num_threads(2);
  auto b = f();
  omp_set_num_threads(saved);
  return std::make_pair(a, b);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Expects `f` to throw moetrain::Error whose message contains every string in `parts`.
void expect_error(const std::function<void()>& f, std::vector<std::string> parts = {}) {
  try {
    f();
    ADD_FAILURE() << "expected moetrain::Error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

Tensor f32(const Tensor& t) { return t.to(DType::F32); }

// ---- embedding ----------------------------------------------------------------------

TEST(DenseEmbedding, GradCheck) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t V = dim(rng, 2, 7), H = dim(rng, 1, 6), T = dim(rng, 1, 12);
    Tensor ids = random_ints({T}, 0, static_cast<int32_t>(V), seed + 1);
    Tensor w = random_tensor({V, H}, DType::F64, seed + 2);
    Tensor r = random_tensor({T, H}, DType::F64, seed + 3);
    Tensor dw = Tensor::zeros({V, H}, DType::F64);
    ops::embedding_backward_weight(ids, r, dw);
    check_grad(fmt::format("embedding[T={},V={},H={}]", T, V, H), "weight", w, dw, [&] { return dot(r, ops::embedding_forward(ids, w)); });
  }
}

TEST(DenseEmbedding, ForwardNaiveAndF32) {
  const int64_t V = 9, H = 5, T = 13;
  Tensor ids = random_ints({T}, 0, V, 5);
  Tensor w = random_tensor({V, H}, DType::F64, 6);
  Tensor y = ops::embedding_forward(ids, w);
  ASSERT_EQ(y.shape(), (Shape{T, H}));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(y.item(t * H + h), w.item(ids.data<int32_t>()[t] * H + h));
  EXPECT_TRUE(bitwise_equal(ops::embedding_forward(ids, f32(w)), f32(y)));
}

TEST(DenseEmbedding, BackwardAccumulatesDeterministically) {
  const int64_t V = 50, H = 300, T = 4000;
  Tensor ids = random_ints({T}, 0, V, 7);
  Tensor dy = random_tensor({T, H}, DType::F32, 8);
  Tensor init = random_tensor({V, H}, DType::F32, 9);
  auto [a, b] = with_threads([&] {
    Tensor dw = init.clone();
    ops::embedding_backward_weight(ids, dy, dw);
    return dw;
  });
  EXPECT_TRUE(bitwise_equal(a, b));
  // dw = init + scatter-add of dy, checked in double.
  std::vector<double> ref = init.to_double_vector(), g = dy.to_double_vector();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) ref[ids.data<int32_t>()[t] * H + h] += g[t * H + h];
  EXPECT_LT(rel_error(a, Tensor::from_vector(ref, {V, H})), 1e-6);
}

// A vocabulary-parallel embedding: the shards' lookups (zero rows for ids another shard
// holds) sum to the whole lookup, and each shard's gradient is the whole gradient's rows.
TEST(DenseEmbedding, VocabularyShardsGiveTheWholeLookupAndGradient) {
  const int64_t V = 12, H = 5, T = 40;
  Tensor ids = random_ints({T}, 0, V, 11);
  Tensor w = random_tensor({V, H}, DType::F64, 12);
  Tensor dy = random_tensor({T, H}, DType::F64, 13);
  Tensor whole_dw = Tensor::zeros({V, H}, DType::F64);
  ops::embedding_backward_weight(ids, dy, whole_dw);
  const Tensor whole = ops::embedding_forward(ids, w);
  for (int64_t shards : {2, 3, 4}) {
    const int64_t Vs = V / shards;
    Tensor sum = Tensor::zeros({T, H}, DType::F64);
    for (int64_t r = 0; r < shards; ++r) {
      const ops::VocabShard shard{r * Vs, V};
      Tensor piece = w.slice(r * Vs, (r + 1) * Vs).clone();
      Tensor y = ops::embedding_forward(ids, piece, shard);
      for (int64_t t = 0; t < T; ++t) {  // another shard's id: a zero row
        const int32_t id = ids.data<int32_t>()[t];
        if (id >= r * Vs && id < (r + 1) * Vs) continue;
        for (int64_t h = 0; h < H; ++h) EXPECT_EQ(y.item(t * H + h), 0.0) << "shard " << r << " token " << t;
      }
      ops::add_(sum, y);
      Tensor dw = Tensor::full({Vs, H}, 7.0, DType::F64);  // overwritten (accumulate off)
      ops::embedding_backward_weight(ids, dy, dw, /*accumulate=*/false, shard);
      EXPECT_TRUE(bitwise_equal(dw, whole_dw.slice(r * Vs, (r + 1) * Vs))) << shards << " shards, shard " << r;
    }
    EXPECT_TRUE(bitwise_equal(sum, whole)) << shards << " shards";
  }
  // A shard that does not fit its vocabulary, and an id outside the whole vocabulary, are named.
  expect_error([&] { ops::embedding_forward(ids, w.slice(0, 6).clone(), {8, V}); }, {"does not fit", "12"});
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 12}, {2});
  expect_error([&] { ops::embedding_forward(bad, w.slice(0, 6).clone(), {6, V}); }, {"12", "[0, 12)"});
}

TEST(DenseEmbedding, Errors) {
  Tensor w = random_tensor({4, 3}, DType::F32, 1);
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 4, 1}, {3});
  expect_error([&] { ops::embedding_forward(bad, w); }, {"4", "position 1", "[0, 4)"});
  Tensor neg = Tensor::from_vector(std::vector<int32_t>{-1}, {1});
  expect_error([&] { ops::embedding_forward(neg, w); }, {"-1"});
  Tensor ids = Tensor::from_vector(std::vector<int32_t>{0, 3}, {2});
  expect_error([&] { ops::embedding_forward(ids.to(DType::I64), w); });
  expect_error([&] { ops::embedding_forward(ids, w.view({12})); });
  Tensor dw = Tensor::zeros({4, 3}, DType::F32);
  expect_error([&] { ops::embedding_backward_weight(ids, random_tensor({2, 4}, DType::F32, 2), dw); }, {"dy"});
  expect_error([&] { ops::embedding_backward_weight(bad, random_tensor({3, 3}, DType::F32, 2), dw); }, {"4"});
  expect_error([&] { ops::embedding_backward_weight(ids, random_tensor({2, 3}, DType::F64, 2), dw); });
}

// ---- linear -------------------------------------------------------------------------

// Multi-token prediction's shifted ids: k ahead within each row and, with segments, within
// each document; the fill elsewhere.
TEST(DenseEmbedding, ShiftTokensStaysInRowAndDocument) {
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{10, 11, 12, 13, 14, 20, 21, 22, 23, 24}, {10});
  EXPECT_EQ(ops::shift_tokens(ids, Tensor(), 2, 0, -1).to_vector<int32_t>(), ids.to_vector<int32_t>());
  EXPECT_EQ(ops::shift_tokens(ids, Tensor(), 2, 2, -100).to_vector<int32_t>(),
            (std::vector<int32_t>{12, 13, 14, -100, -100, 22, 23, 24, -100, -100}));
  // Row 0 packs documents [10, 11, 12] and [13, 14]; row 1 is one document.
  const Tensor seg = Tensor::from_vector(std::vector<int32_t>{0, 0, 0, 1, 1, 0, 0, 0, 0, 0}, {10});
  EXPECT_EQ(ops::shift_tokens(ids, seg, 2, 1, 0).to_vector<int32_t>(),
            (std::vector<int32_t>{11, 12, 0, 14, 0, 21, 22, 23, 24, 0}));
  EXPECT_EQ(ops::shift_tokens(ids, seg, 2, 5, 7).to_vector<int32_t>(), std::vector<int32_t>(10, 7));
  EXPECT_THROW(ops::shift_tokens(ids, Tensor(), 3, 1, 0), Error);  // 10 ids are not 3 rows
  EXPECT_THROW(ops::shift_tokens(ids, Tensor(), 2, -1, 0), Error);
  EXPECT_THROW(ops::shift_tokens(ids.to(DType::F32), Tensor(), 2, 1, 0), Error);
  EXPECT_THROW(ops::shift_tokens(ids, seg.slice(0, 5), 2, 1, 0), Error);
}

TEST(DenseLinear, GradCheck) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 1, 7), in = dim(rng, 1, 8), out = dim(rng, 1, 8);
    Tensor x = random_tensor({T, in}, DType::F64, seed + 1);
    Tensor w = random_tensor({out, in}, DType::F64, seed + 2);
    Tensor r = random_tensor({T, out}, DType::F64, seed + 3);
    auto loss = [&] { return dot(r, ops::linear_forward(x, w)); };
    Tensor dx = ops::linear_backward_input(r, w);
    Tensor dw = Tensor::zeros({out, in}, DType::F64);
    ops::linear_backward_weight(r, x, dw);
    const std::string op = fmt::format("linear[T={},in={},out={}]", T, in, out);
    check_grad(op, "x", x, dx, loss);
    check_grad(op, "w", w, dw, loss);
  }
}

TEST(DenseLinear, ForwardNaiveAndF32) {
  const int64_t T = 17, in = 33, out = 9;
  Tensor x = random_tensor({T, in}, DType::F64, 1), w = random_tensor({out, in}, DType::F64, 2);
  Tensor y = ops::linear_forward(x, w);
  std::vector<double> ref(T * out, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) ref[t * out + o] += x.item(t * in + i) * w.item(o * in + i);
  EXPECT_LT(rel_error(y, Tensor::from_vector(ref, {T, out})), 1e-14);
  EXPECT_LT(rel_error(ops::linear_forward(f32(x), f32(w)), y), 1e-6);
  // The backward GEMMs in f32 against f64 too.
  Tensor dy = random_tensor({T, out}, DType::F64, 3);
  EXPECT_LT(rel_error(ops::linear_backward_input(f32(dy), f32(w)), ops::linear_backward_input(dy, w)), 1e-6);
}

TEST(DenseLinear, WeightGradAccumulates) {
  Tensor x = random_tensor({5, 4}, DType::F64, 1), dy = random_tensor({5, 3}, DType::F64, 2);
  Tensor once = Tensor::zeros({3, 4}, DType::F64);
  ops::linear_backward_weight(dy, x, once);
  Tensor acc = random_tensor({3, 4}, DType::F64, 3);
  std::vector<double> expect = acc.to_double_vector(), g = once.to_double_vector();
  for (size_t i = 0; i < expect.size(); ++i) expect[i] += g[i];
  ops::linear_backward_weight(dy, x, acc);
  EXPECT_LT(rel_error(acc, Tensor::from_vector(expect, {3, 4})), 1e-15);
  // No tokens: y is empty and dw is left unchanged.
  Tensor x0 = Tensor::zeros({0, 4}, DType::F64), dy0 = Tensor::zeros({0, 3}, DType::F64);
  EXPECT_EQ(ops::linear_forward(x0, once).shape(), (Shape{0, 3}));
  Tensor before = acc.clone();
  ops::linear_backward_weight(dy0, x0, acc);
  EXPECT_TRUE(bitwise_equal(acc, before));
}

TEST(DenseLinear, ResidualAndInputGradAccumulate) {
  Tensor x = random_tensor({5, 4}, DType::F64, 11), w = random_tensor({3, 4}, DType::F64, 12);
  Tensor r = random_tensor({5, 3}, DType::F64, 13), dy = random_tensor({5, 3}, DType::F64, 14);
  Tensor expect_y = ops::linear_forward(x, w);
  ops::add_(expect_y, r);
  EXPECT_LT(rel_error(ops::linear_forward(x, w, r), expect_y), 1e-15);
  Tensor dx = random_tensor({5, 4}, DType::F64, 15);
  Tensor expect_dx = dx.clone();
  ops::add_(expect_dx, ops::linear_backward_input(dy, w));
  ops::linear_backward_input_add(dy, w, dx);
  EXPECT_LT(rel_error(dx, expect_dx), 1e-15);
  expect_error([&] { ops::linear_forward(x, w, r.slice(0, 4)); }, {"residual"});
  Tensor wrong = Tensor::zeros({5, 3}, DType::F64);
  expect_error([&] { ops::linear_backward_input_add(dy, w, wrong); }, {"dx"});
}

TEST(DenseLinear, Errors) {
  Tensor x = random_tensor({4, 3}, DType::F32, 1), w = random_tensor({5, 3}, DType::F32, 2);
  expect_error([&] { ops::linear_forward(x, random_tensor({5, 4}, DType::F32, 3)); }, {"w", "[5, 3]"});
  expect_error([&] { ops::linear_forward(x.view({12}), w); }, {"x"});
  expect_error([&] { ops::linear_forward(x, w.to(DType::F64)); }, {"f32", "f64"});
  expect_error([&] { ops::linear_backward_input(random_tensor({4, 4}, DType::F32, 3), w); }, {"dy"});
  Tensor dw = Tensor::zeros({5, 4}, DType::F32);
  expect_error([&] { ops::linear_backward_weight(random_tensor({4, 5}, DType::F32, 3), x, dw); }, {"dw"});
  expect_error([&] { ops::linear_forward(x.to(DType::I32), w.to(DType::I32)); }, {"i32"});
}

// ---- RMSNorm ------------------------------------------------------------------------

TEST(DenseRmsNorm, GradCheck) {
  const double eps = 1e-6;
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    // x [T, heads * D] with w [D]: heads = 1 is the plain norm, heads > 1 Qwen3's q/k norm.
    // D >= 2: with D = 1 the map is y ~ sign(x) w, whose true dx (~eps/|x|^3) is below the
    // finite-difference rounding noise, so a relative error would measure only noise.
    const int64_t T = dim(rng, 1, 5), heads = dim(rng, 1, 3), D = dim(rng, 2, 8);
    Tensor x = random_tensor({T, heads * D}, DType::F64, seed + 1);
    Tensor w = random_tensor({D}, DType::F64, seed + 2);
    Tensor r = random_tensor({T, heads * D}, DType::F64, seed + 3);
    auto loss = [&] { return dot(r, ops::rmsnorm_forward(x, w, eps).y); };
    auto fwd = ops::rmsnorm_forward(x, w, eps);
    Tensor dx = ops::rmsnorm_backward_input(r, x, w, fwd.rstd);
    Tensor dw = Tensor::zeros({D}, DType::F64);
    ops::rmsnorm_backward_weight(r, x, fwd.rstd, dw);
    const std::string op = fmt::format("rmsnorm[R={},D={}]", T * heads, D);
    check_grad(op, "x", x, dx, loss);
    check_grad(op, "w", w, dw, loss);
    // a residual gradient handed in is added: dx + res, to f64 rounding
    Tensor res = random_tensor({T, heads * D}, DType::F64, seed + 4);
    Tensor dx_res = ops::rmsnorm_backward_input(r, x, w, fwd.rstd, res);
    Tensor sum = dx.clone();
    ops::add_(sum, res);
    EXPECT_LT(rel_error(dx_res, sum), 1e-14) << op;
  }
}

TEST(DenseRmsNorm, ForwardNaiveAndF32) {
  const int64_t T = 6, heads = 2, D = 16;
  const double eps = 1e-5;
  Tensor x = random_tensor({T, heads * D}, DType::F64, 1), w = random_tensor({D}, DType::F64, 2);
  auto fwd = ops::rmsnorm_forward(x, w, eps);
  ASSERT_EQ(fwd.y.shape(), x.shape());
  ASSERT_EQ(fwd.rstd.shape(), (Shape{T * heads}));
  std::vector<double> y(T * heads * D), rstd(T * heads);
  for (int64_t r = 0; r < T * heads; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < D; ++i) ms += x.item(r * D + i) * x.item(r * D + i) / D;
    rstd[r] = 1 / std::sqrt(ms + eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = x.item(r * D + i) * rstd[r] * w.item(i);
  }
  EXPECT_LT(rel_error(fwd.y, Tensor::from_vector(y, x.shape())), 1e-14);
  EXPECT_LT(rel_error(fwd.rstd, Tensor::from_vector(rstd, {T * heads})), 1e-14);
  auto f = ops::rmsnorm_forward(f32(x), f32(w), eps);
  EXPECT_LT(rel_error(f.y, fwd.y), 1e-6);
  EXPECT_LT(rel_error(f.rstd, fwd.rstd), 1e-6);
}

TEST(DenseRmsNorm, WeightGradDeterministicAndAccumulates) {
  const int64_t R = 20000, D = 24;  // many row blocks
  Tensor x = random_tensor({R, D}, DType::F32, 1), w = random_tensor({D}, DType::F32, 2);
  Tensor dy = random_tensor({R, D}, DType::F32, 3), init = random_tensor({D}, DType::F32, 4);
  auto fwd = ops::rmsnorm_forward(x, w, 1e-6);
  auto [a, b] = with_threads([&] {
    Tensor dw = init.clone();
    ops::rmsnorm_backward_weight(dy, x, fwd.rstd, dw);
    return dw;
  });
  EXPECT_TRUE(bitwise_equal(a, b));
  std::vector<double> ref = init.to_double_vector();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i) ref[i] += dy.item(r * D + i) * x.item(r * D + i) * fwd.rstd.item(r);
  EXPECT_LT(rel_error(a, Tensor::from_vector(ref, {D})), 1e-6);
}

TEST(DenseRmsNorm, Errors) {
  Tensor x = random_tensor({4, 6}, DType::F32, 1), w = random_tensor({4}, DType::F32, 2);
  expect_error([&] { ops::rmsnorm_forward(x, w, 1e-6); }, {"x", "4"});  // 6 is not a multiple of 4
  Tensor w3 = random_tensor({3}, DType::F32, 2);
  auto fwd = ops::rmsnorm_forward(x, w3, 1e-6);
  expect_error([&] { ops::rmsnorm_backward_input(random_tensor({4, 3}, DType::F32, 3), x, w3, fwd.rstd); },
               {"dy"});
  expect_error([&] { ops::rmsnorm_backward_input(x, x, w3, random_tensor({4}, DType::F32, 3)); }, {"rstd"});
  Tensor dw = Tensor::zeros({3}, DType::F64);
  expect_error([&] { ops::rmsnorm_backward_weight(x, x, fwd.rstd, dw); }, {"f64", "f32"});
}

// ---- RoPE ---------------------------------------------------------------------------

// HF's formulation, written independently: y = x * [cos, cos] + rotate_half(x) * [sin, sin]
// with rotate_half(x) = [-x2, x1] and inv_freq_i = 1 / theta^(2i / hd).
Tensor rope_naive(const Tensor& x, const Tensor& pos, int64_t hd, double theta) {
  const int64_t T = x.size(0), W = x.size(1);
  std::vector<double> y(T * W);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < W; ++c) {
      const int64_t base = c / hd * hd, e = c % hd, i = e % (hd / 2);
      const double ang = pos.item(t) / std::pow(theta, 2.0 * i / hd);
      const double rot = e < hd / 2 ? -x.item(t * W + base + e + hd / 2) : x.item(t * W + base + e - hd / 2);
      y[t * W + c] = x.item(t * W + c) * std::cos(ang) + rot * std::sin(ang);
    }
  }
  return Tensor::from_vector(y, x.shape());
}

TEST(DenseRope, GradCheck) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 1, 6), heads = dim(rng, 1, 3), hd = 2 * dim(rng, 1, 4);
    const double theta = seed == 11 ? 10000.0 : 1e6;
    Tensor x = random_tensor({T, heads * hd}, DType::F64, seed + 1);
    Tensor pos = random_ints({T}, 0, 4096, seed + 2);
    Tensor r = random_tensor({T, heads * hd}, DType::F64, seed + 3);
    Tensor dx = ops::rope_backward(r, pos, hd, theta);
    check_grad(fmt::format("rope[T={},heads={},hd={},theta={:g}]", T, heads, hd, theta), "x", x, dx, [&] { return dot(r, ops::rope_forward(x, pos, hd, theta)); });
  }
}

TEST(DenseRope, ForwardNaiveInverseAndF32) {
  const int64_t T = 9, heads = 3, hd = 8;
  Tensor x = random_tensor({T, heads * hd}, DType::F64, 1);
  Tensor pos = random_ints({T}, 0, 40000, 2);
  pos.data<int32_t>()[0] = 0;
  Tensor y = ops::rope_forward(x, pos, hd, 1e6);
  EXPECT_LT(rel_error(y, rope_naive(x, pos, hd, 1e6)), 1e-13);
  EXPECT_LT(rel_error(y.slice(0, 1), x.slice(0, 1)), 1e-16);  // position 0 is the identity
  EXPECT_LT(rel_error(ops::rope_backward(y, pos, hd, 1e6), x), 1e-14);
  EXPECT_LT(rel_error(ops::rope_forward(f32(x), pos, hd, 1e6), y), 1e-6);
}

// DeepSeek-V3's rope as HF writes it, independently: each head's last hd dims (after `pass`
// copied ones) permuted to (evens, odds) when interleaved, then rotate-half with the given
// frequencies and cos/sin times scale. Returns the rotary dims in HF's order (permuted);
// unpermute_interleaved maps them back to the op's order.
Tensor rope_hf_deepseek(const Tensor& x, const Tensor& pos, const ops::RopeSpec& r) {
  const int64_t T = x.size(0), W = x.size(1), hd = r.head_dim, half = hd / 2, stride = r.head_stride();
  const int64_t pass = stride - hd;
  std::vector<double> y(T * W);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h0 = 0; h0 < W; h0 += stride) {
      std::vector<double> q(hd);
      for (int64_t e = 0; e < hd; ++e) {
        const int64_t src = r.interleaved ? (e < half ? 2 * e : 2 * (e - half) + 1) : e;
        q[e] = x.item(t * W + h0 + pass + src);
      }
      for (int64_t j = 0; j < pass; ++j) y[t * W + h0 + j] = x.item(t * W + h0 + j);
      for (int64_t e = 0; e < hd; ++e) {
        const int64_t i = e % half;
        const double ang = pos.item(t) * r.inv_freq[i];
        const double rot = e < half ? -q[e + half] : q[e - half];
        y[t * W + h0 + pass + e] = r.scale * (q[e] * std::cos(ang) + rot * std::sin(ang));
      }
    }
  }
  return Tensor::from_vector(y, x.shape());
}

// The op's order of the rotary dims from HF's (evens, odds).
Tensor unpermute_interleaved(const Tensor& y_hf, const ops::RopeSpec& r) {
  const int64_t T = y_hf.size(0), W = y_hf.size(1), hd = r.head_dim, half = hd / 2, stride = r.head_stride();
  std::vector<double> y = y_hf.to_double_vector();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h0 = t * W + stride - hd; h0 < (t + 1) * W; h0 += stride) {
      for (int64_t e = 0; e < hd; ++e) {
        y[h0 + (e < half ? 2 * e : 2 * (e - half) + 1)] = y_hf.item(h0 + e);
      }
    }
  }
  return Tensor::from_vector(y, y_hf.shape());
}

ops::RopeSpec yarn_like_spec(int64_t hd, int64_t stride, bool interleaved, uint64_t seed) {
  ops::RopeSpec r;
  r.head_dim = hd;
  r.stride = stride;
  r.interleaved = interleaved;
  r.scale = 1.3;
  Rng rng(seed);
  for (int64_t i = 0; i < hd / 2; ++i) r.inv_freq.push_back(std::pow(10000.0, -2.0 * i / hd) * (0.5 + rng.uniform()));
  return r;
}

TEST(DenseRope, SpecGradCheckAndHfDeepseekForm) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 1, 5), heads = dim(rng, 1, 3), hd = 2 * dim(rng, 1, 4);
    const int64_t stride = hd + (seed % 2 ? 3 : 0);
    for (bool interleaved : {false, true}) {
      const ops::RopeSpec r = yarn_like_spec(hd, stride, interleaved, seed);
      Tensor x = random_tensor({T, heads * stride}, DType::F64, seed + 1);
      Tensor pos = random_ints({T}, 0, 4096, seed + 2);
      Tensor g = random_tensor({T, heads * stride}, DType::F64, seed + 3);
      const std::string op = fmt::format("rope[T={},heads={},hd={},stride={},interleaved={}]", T, heads, hd, stride,
                                         interleaved);
      check_grad(op, "x", x, ops::rope_backward(g, pos, r), [&] { return dot(g, ops::rope_forward(x, pos, r)); });
      Tensor y = ops::rope_forward(x, pos, r);
      Tensor hf = rope_hf_deepseek(x, pos, r);
      EXPECT_LT(rel_error(y, interleaved ? unpermute_interleaved(hf, r) : hf), 1e-13) << op;
    }
  }
}

TEST(DenseRope, SpecInterleavedScoresMatchHf) {
  // What attention sees: per head q.k is the same whether both are in HF's permuted order
  // or the op's.
  const int64_t T = 5, heads = 2, hd = 8, stride = 12;
  const ops::RopeSpec r = yarn_like_spec(hd, stride, true, 3);
  Tensor q = random_tensor({T, heads * stride}, DType::F64, 4), k = random_tensor({T, heads * stride}, DType::F64, 5);
  Tensor pos = random_ints({T}, 0, 100, 6);
  Tensor qo = ops::rope_forward(q, pos, r), ko = ops::rope_forward(k, pos, r);
  Tensor qh = rope_hf_deepseek(q, pos, r), kh = rope_hf_deepseek(k, pos, r);
  for (int64_t a = 0; a < T; ++a) {
    for (int64_t b = 0; b < T; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        double so = 0, sh = 0;
        for (int64_t e = 0; e < stride; ++e) {
          so += qo.item(a * heads * stride + h * stride + e) * ko.item(b * heads * stride + h * stride + e);
          sh += qh.item(a * heads * stride + h * stride + e) * kh.item(b * heads * stride + h * stride + e);
        }
        EXPECT_NEAR(so, sh, 1e-12 * (1 + std::abs(sh)));
      }
    }
  }
}

TEST(DenseRope, SpecErrors) {
  Tensor x = random_tensor({4, 12}, DType::F32, 1), pos = random_ints({4}, 0, 10, 2);
  ops::RopeSpec r{4, 1e4};
  r.stride = 5;
  expect_error([&] { ops::rope_forward(x, pos, r); }, {"width 12", "head width 5"});
  r.stride = 2;
  expect_error([&] { ops::rope_forward(x, pos, r); }, {"stride", "2"});
  r.stride = 6;
  r.inv_freq = {1.0, 0.5, 0.25};
  expect_error([&] { ops::rope_forward(x, pos, r); }, {"inv_freq", "2", "3"});
}

// ---- MLA keys and values -------------------------------------------------------------

TEST(DenseMlaKv, LayoutAndGradCheck) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 1, 4), heads = dim(rng, 1, 3), nope = dim(rng, 1, 4), rope = dim(rng, 1, 3),
                  dv = dim(rng, 1, 4);
    Tensor kv = random_tensor({T, heads * (nope + dv)}, DType::F64, seed + 1);
    Tensor kr = random_tensor({T, rope}, DType::F64, seed + 2);
    const ops::MlaKv o = ops::mla_kv_forward(kv, kr, heads, nope, dv);
    ASSERT_EQ(o.k.shape(), (Shape{T, heads * (nope + rope)}));
    ASSERT_EQ(o.v.shape(), (Shape{T, heads * dv}));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < nope + rope; ++j) {
          const double want = j < nope ? kv.item(t * heads * (nope + dv) + h * (nope + dv) + j) : kr.item(t * rope + j - nope);
          ASSERT_EQ(o.k.item(t * heads * (nope + rope) + h * (nope + rope) + j), want);
        }
        for (int64_t j = 0; j < dv; ++j) {
          ASSERT_EQ(o.v.item(t * heads * dv + h * dv + j), kv.item(t * heads * (nope + dv) + h * (nope + dv) + nope + j));
        }
      }
    }
    Tensor gk = random_tensor(o.k.shape(), DType::F64, seed + 3), gv = random_tensor(o.v.shape(), DType::F64, seed + 4);
    const ops::MlaKvGrads g = ops::mla_kv_backward(gk, gv, heads, nope, dv);
    auto loss = [&] {
      const ops::MlaKv f = ops::mla_kv_forward(kv, kr, heads, nope, dv);
      return dot(gk, f.k) + dot(gv, f.v);
    };
    const std::string op = fmt::format("mla_kv[T={},heads={},nope={},rope={},dv={}]", T, heads, nope, rope, dv);
    check_grad(op, "kv", kv, g.dkv, loss);
    check_grad(op, "k_rot", kr, g.dk_rot, loss);
  }
}

TEST(DenseMlaKv, Errors) {
  Tensor kv = random_tensor({3, 2 * (4 + 5)}, DType::F32, 1), kr = random_tensor({3, 2}, DType::F32, 2);
  expect_error([&] { ops::mla_kv_forward(kv, kr, 2, 4, 6); }, {"kv", "[T, 20]"});
  expect_error([&] { ops::mla_kv_forward(kv, random_tensor({2, 2}, DType::F32, 3), 2, 4, 5); }, {"k_rot", "T=3"});
  Tensor dk = random_tensor({3, 2 * 6}, DType::F32, 4);
  expect_error([&] { ops::mla_kv_backward(dk, random_tensor({3, 9}, DType::F32, 5), 2, 4, 5); }, {"dv"});
  expect_error([&] { ops::mla_kv_backward(dk, random_tensor({3, 10}, DType::F32, 5), 2, 6, 5); }, {"dk", "6"});
}

// ---- per-head norm then RoPE (one op) ---------------------------------------------------

TEST(DenseRmsNormRope, GradCheckAndTheOpsInTurn) {
  const double eps = 1e-6;
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 1, 5), heads = dim(rng, 1, 3), hd = 2 * dim(rng, 1, 4);
    Tensor x = random_tensor({T, heads * hd}, DType::F64, seed + 1);
    Tensor w = random_tensor({hd}, DType::F64, seed + 2);
    Tensor pos = random_ints({T}, 0, 4096, seed + 3);
    Tensor r = random_tensor({T, heads * hd}, DType::F64, seed + 4);
    const double theta = 1e6;
    auto loss = [&] { return dot(r, ops::rmsnorm_rope_forward(x, w, eps, pos, hd, theta).y); };
    const ops::RmsNormOut fwd = ops::rmsnorm_rope_forward(x, w, eps, pos, hd, theta);
    const ops::RmsNormRopeGrads g = ops::rmsnorm_rope_backward(r, x, w, fwd.rstd, pos, hd, theta);
    const std::string op = fmt::format("rmsnorm_rope[T={},heads={},hd={}]", T, heads, hd);
    check_grad(op, "x", x, g.dx, loss);
    check_grad(op, "w", w, g.dw, loss);
    // the same as the two ops in turn
    const ops::RmsNormOut n = ops::rmsnorm_forward(x, w, eps);
    EXPECT_LT(rel_error(fwd.y, ops::rope_forward(n.y, pos, hd, theta)), 1e-15) << op;
    EXPECT_LT(rel_error(fwd.rstd, n.rstd), 1e-15) << op;
  }
}

TEST(DenseRope, Errors) {
  Tensor x = random_tensor({4, 12}, DType::F32, 1), pos = random_ints({4}, 0, 10, 2);
  expect_error([&] { ops::rope_forward(x, pos, 5, 1e4); }, {"head_dim"});
  expect_error([&] { ops::rope_forward(x, pos, 8, 1e4); }, {"head_dim", "8"});
  expect_error([&] { ops::rope_forward(x, random_ints({3}, 0, 10, 2), 4, 1e4); }, {"positions"});
  expect_error([&] { ops::rope_backward(x, pos.to(DType::I64), 4, 1e4); }, {"positions"});
}

// ---- attention ----------------------------------------------------------------------

// Packed-document segment ids: each sequence cut at random points into nondecreasing ids.
Tensor random_segments(int64_t B, int64_t S, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> seg(B * S);
  for (int64_t b = 0; b < B; ++b) {
    int32_t id = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (s > 0 && rng.below(3) == 0) ++id;
      seg[b * S + s] = id;
    }
  }
  return Tensor::from_vector(seg, {B * S});
}

// Explicit softmax(scale QK^T + mask) V with a full score matrix per (b, h).
std::pair<Tensor, Tensor> attention_naive(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                                          const ops::AttentionShape& a) {
  const int64_t B = a.batch, S = a.seq, Hq = a.q_heads, Hkv = a.kv_heads, D = a.head_dim, Dv = a.value_dim();
  std::vector<double> out(B * S * Hq * Dv), lse(B * Hq * S);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h * Hkv / Hq;
      std::vector<double> score(S * S, -std::numeric_limits<double>::infinity());
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          const bool visible = j <= i && (!seg.defined() || seg.item(b * S + i) == seg.item(b * S + j));
          if (!visible) continue;
          double s = 0;
          for (int64_t d = 0; d < D; ++d)
            s += q.item((b * S + i) * Hq * D + h * D + d) * k.item((b * S + j) * Hkv * D + g * D + d);
          score[i * S + j] = a.scale * s;
        }
        double mx = -std::numeric_limits<double>::infinity(), z = 0;
        for (int64_t j = 0; j < S; ++j) mx = std::max(mx, score[i * S + j]);
        for (int64_t j = 0; j < S; ++j) z += std::exp(score[i * S + j] - mx);
        lse[(b * Hq + h) * S + i] = mx + std::log(z);
        for (int64_t d = 0; d < Dv; ++d) {
          double o = 0;
          for (int64_t j = 0; j < S; ++j)
            o += std::exp(score[i * S + j] - mx) / z * v.item((b * S + j) * Hkv * Dv + g * Dv + d);
          out[(b * S + i) * Hq * Dv + h * Dv + d] = o;
        }
      }
    }
  }
  return {Tensor::from_vector(out, {B * S, Hq * Dv}), Tensor::from_vector(lse, {B, Hq, S})};
}

struct AttnCase {
  ops::AttentionShape shape;
  Tensor q, k, v, seg;
};

// Random GQA case (q_heads = group * kv_heads), batch >= 2, segments optional; value heads
// of head_dim + dv_extra (MLA's shape when not 0).
AttnCase attn_case(uint64_t seed, int64_t group, bool segments, DType dt = DType::F64, int64_t dv_extra = 0) {
  Rng rng(seed);
  AttnCase c;
  auto& a = c.shape;
  a.batch = dim(rng, 2, 3);
  a.seq = dim(rng, 3, 6);
  a.kv_heads = dim(rng, 1, 2);
  a.q_heads = group * a.kv_heads;
  a.head_dim = dim(rng, 2, 4);
  a.scale = 1 / std::sqrt(double(a.head_dim));
  if (dv_extra != 0) a.v_head_dim = a.head_dim + dv_extra;
  const int64_t T = a.batch * a.seq;
  c.q = random_tensor({T, a.q_heads * a.head_dim}, dt, seed + 1);
  c.k = random_tensor({T, a.kv_heads * a.head_dim}, dt, seed + 2);
  c.v = random_tensor({T, a.kv_heads * a.value_dim()}, dt, seed + 3);
  if (segments) c.seg = random_segments(a.batch, a.seq, seed + 4);
  return c;
}

TEST(DenseAttention, GradCheck) {
  // dv_extra: value heads wider (+3) and narrower (-1) than query/key heads (DeepSeek-V3's MLA)
  for (int64_t dv_extra : {0, 3, -1}) {
  for (bool segments : {false, true}) {
    for (uint64_t seed : kSeeds) {
      AttnCase c = attn_case(seed, 2, segments, DType::F64, dv_extra);
      const auto& a = c.shape;
      const std::string op = fmt::format("{}[B={},S={},Hq={},Hkv={},D={},Dv={}]",
                                         segments ? "attention_gqa_seg" : "attention_gqa", a.batch, a.seq, a.q_heads,
                                         a.kv_heads, a.head_dim, a.value_dim());
      Tensor r = random_tensor({a.batch * a.seq, a.q_heads * a.value_dim()}, DType::F64, seed + 5);
      auto fwd = ops::attention_forward(c.q, c.k, c.v, c.seg, c.shape);
      auto g = ops::attention_backward(r, c.q, c.k, c.v, c.seg, fwd.out, fwd.lse, c.shape);
      auto loss = [&] { return dot(r, ops::attention_forward(c.q, c.k, c.v, c.seg, c.shape).out); };
      check_grad(op, "q", c.q, g.dq, loss);
      check_grad(op, "k", c.k, g.dk, loss);
      check_grad(op, "v", c.v, g.dv, loss);
    }
  }
  }
}

TEST(DenseAttention, ForwardNaive) {
  for (int64_t group : {1, 2, 3}) {  // MHA, GQA, and MQA when kv_heads = 1
    for (bool segments : {false, true}) {
      // group 2 with value heads wider than query/key heads (MLA's shape)
      AttnCase c = attn_case(100 + group, group, segments, DType::F64, group == 2 ? 2 : 0);
      auto fwd = ops::attention_forward(c.q, c.k, c.v, c.seg, c.shape);
      auto [out, lse] = attention_naive(c.q, c.k, c.v, c.seg, c.shape);
      EXPECT_LT(rel_error(fwd.out, out), 1e-13) << "group " << group << " segments " << segments;
      EXPECT_LT(rel_error(fwd.lse, lse), 1e-13) << "group " << group << " segments " << segments;
    }
  }
}

// Two packed documents give the same result as each document run on its own.
TEST(DenseAttention, SegmentsMatchSeparateSequences) {
  ops::AttentionShape a{.batch = 1, .seq = 7, .q_heads = 4, .kv_heads = 2, .head_dim = 4, .scale = 0.5};
  const int64_t split = 3;
  Tensor q = random_tensor({7, 16}, DType::F64, 1), k = random_tensor({7, 8}, DType::F64, 2);
  Tensor v = random_tensor({7, 8}, DType::F64, 3);
  Tensor seg = Tensor::from_vector(std::vector<int32_t>{5, 5, 5, 9, 9, 9, 9}, {7});
  auto packed = ops::attention_forward(q, k, v, seg, a);
  for (auto [b0, b1] : {std::pair<int64_t, int64_t>{0, split}, {split, 7}}) {
    ops::AttentionShape one = a;
    one.seq = b1 - b0;
    auto alone = ops::attention_forward(q.slice(b0, b1), k.slice(b0, b1), v.slice(b0, b1), Tensor(), one);
    EXPECT_LT(rel_error(packed.out.slice(b0, b1), alone.out), 1e-15);
  }
}

TEST(DenseAttention, F32MatchesF64AndIsDeterministic) {
  AttnCase c = attn_case(7, 2, true);
  c.shape.seq = 64;  // larger than the gradcheck shapes
  c.shape.batch = 3;
  const int64_t T = c.shape.batch * c.shape.seq;
  c.q = random_tensor({T, c.shape.q_heads * c.shape.head_dim}, DType::F64, 1);
  c.k = random_tensor({T, c.shape.kv_heads * c.shape.head_dim}, DType::F64, 2);
  c.v = random_tensor({T, c.shape.kv_heads * c.shape.head_dim}, DType::F64, 3);
  c.seg = random_segments(c.shape.batch, c.shape.seq, 4);
  Tensor dout = random_tensor(c.q.shape(), DType::F64, 5);
  auto f64 = ops::attention_forward(c.q, c.k, c.v, c.seg, c.shape);
  auto g64 = ops::attention_backward(dout, c.q, c.k, c.v, c.seg, f64.out, f64.lse, c.shape);
  Tensor q = f32(c.q), k = f32(c.k), v = f32(c.v), d = f32(dout);
  auto f = ops::attention_forward(q, k, v, c.seg, c.shape);
  EXPECT_LT(rel_error(f.out, f64.out), 1e-6);
  EXPECT_LT(rel_error(f.lse, f64.lse), 1e-6);
  auto [a, b] = with_threads([&] { return ops::attention_backward(d, q, k, v, c.seg, f.out, f.lse, c.shape); });
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq) && bitwise_equal(a.dk, b.dk) && bitwise_equal(a.dv, b.dv));
  EXPECT_LT(rel_error(a.dq, g64.dq), 1e-5);
  EXPECT_LT(rel_error(a.dk, g64.dk), 1e-5);
  EXPECT_LT(rel_error(a.dv, g64.dv), 1e-5);
}

TEST(DenseAttention, Errors) {
  AttnCase c = attn_case(3, 2, true, DType::F32);
  auto a = c.shape;
  auto fwd = ops::attention_forward(c.q, c.k, c.v, c.seg, a);
  auto bad = a;
  bad.q_heads = a.kv_heads * 2 + 1;
  expect_error([&] { ops::attention_forward(c.q, c.k, c.v, c.seg, bad); }, {"q_heads"});
  bad = a;
  bad.scale = 0;
  expect_error([&] { ops::attention_forward(c.q, c.k, c.v, c.seg, bad); }, {"scale"});
  expect_error([&] { ops::attention_forward(c.q, c.q, c.v, c.seg, a); }, {"tensor k"});
  expect_error([&] { ops::attention_forward(c.q, c.k, c.v, c.seg.slice(0, 1), a); }, {"segment_ids"});
  expect_error([&] { ops::attention_forward(c.q, c.k, c.v.to(DType::F64), c.seg, a); }, {"f32", "f64"});
  expect_error([&] { ops::attention_backward(c.q, c.q, c.k, c.v, c.seg, fwd.out, fwd.out, a); }, {"lse"});
  expect_error([&] { ops::attention_backward(c.k, c.q, c.k, c.v, c.seg, fwd.out, fwd.lse, a); }, {"dout"});
}

// ---- cross-entropy ------------------------------------------------------------------

// Targets in [0, V) with about a quarter set to the ignore index.
Tensor random_targets(int64_t T, int64_t V, uint64_t seed) {
  Tensor t = random_ints({T}, 0, static_cast<int32_t>(V), seed);
  Rng rng(seed + 100);
  for (int64_t i = 0; i < T; ++i)
    if (rng.below(4) == 0) t.data<int32_t>()[i] = ops::kIgnoreIndex;
  return t;
}

TEST(DenseCrossEntropy, GradCheck) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 2, 8), V = dim(rng, 2, 9);
    Tensor logits = random_tensor({T, V}, DType::F64, seed + 1, 2.0);
    Tensor targets = random_targets(T, V, seed + 2);
    const double r = 0.5 + rng.uniform();  // loss = r * loss_sum
    auto fwd = ops::cross_entropy_forward(logits, targets);
    Tensor dlogits = ops::cross_entropy_backward(logits, targets, fwd.lse, r);
    check_grad(fmt::format("cross_entropy[T={},V={}]", T, V), "logits", logits, dlogits,
               [&] { return r * ops::cross_entropy_forward(logits, targets).loss_sum.item(); });
  }
}

// The vocabulary split over R ranks (ops.h's vocab_shard_*): the shards' stats stacked give
// the whole rows' loss and lse, and the shards' gradients side by side the whole gradient;
// the parallel loss against finite differences of the shards' logits.
TEST(DenseCrossEntropy, VocabularyShardsGiveTheWholeLoss) {
  const int64_t T = 9, V = 23;
  const std::vector<int64_t> begins = {0, 8, 16, V};  // three shards: 8, 8 and 7 columns
  Tensor logits = random_tensor({T, V}, DType::F64, 31, 2.0);
  Tensor targets = random_targets(T, V, 32);
  const double scale = 0.3;
  const auto whole = ops::cross_entropy_forward(logits, targets);
  const Tensor dwhole = ops::cross_entropy_backward(logits, targets, whole.lse, scale);
  const int64_t R = static_cast<int64_t>(begins.size()) - 1;
  std::vector<Tensor> shards;
  for (int64_t r = 0; r < R; ++r) {
    Tensor s = Tensor::empty({T, begins[r + 1] - begins[r]}, DType::F64);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t v = begins[r]; v < begins[r + 1]; ++v) s.data<double>()[t * s.size(1) + v - begins[r]] = logits.data<double>()[t * V + v];
    }
    shards.push_back(s);
  }
  auto parallel_loss = [&](ops::CrossEntropyOut* out) {
    Tensor lse = Tensor::empty({R, T}, DType::F64), tl = Tensor::empty({R, T}, DType::F64);
    for (int64_t r = 0; r < R; ++r) {
      const ops::VocabShardStats st = ops::vocab_shard_stats(shards[r], targets, {begins[r], V});
      lse.slice(r, r + 1).copy_from(st.lse.view({1, T}));
      tl.slice(r, r + 1).copy_from(st.target_logit.view({1, T}));
    }
    *out = ops::vocab_parallel_loss(lse, tl, targets);
    return out->loss_sum.item();
  };
  ops::CrossEntropyOut par;
  EXPECT_NEAR(parallel_loss(&par), whole.loss_sum.item(), 1e-12);
  EXPECT_LT(rel_error(par.lse, whole.lse), 1e-14);
  for (int64_t r = 0; r < R; ++r) {
    const Tensor d = ops::vocab_shard_backward(shards[r], targets, par.lse, {begins[r], V}, scale);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t v = begins[r]; v < begins[r + 1]; ++v) {
        EXPECT_NEAR(d.data<double>()[t * d.size(1) + v - begins[r]], dwhole.data<double>()[t * V + v], 1e-14)
            << "shard " << r << " row " << t << " column " << v;
      }
    }
    check_grad(fmt::format("vocab_parallel_loss[shard {}]", r), "logits", shards[r], d, [&] {
      ops::CrossEntropyOut o;
      return scale * parallel_loss(&o);
    });
  }
  // The shard's columns and the targets are checked by name.
  EXPECT_THROW(ops::vocab_shard_stats(shards[2], targets, {16, 22}), Error);  // columns [16, 23) in 22
  Tensor bad = targets.clone();
  bad.data<int32_t>()[0] = static_cast<int32_t>(V);
  try {
    ops::vocab_shard_stats(shards[0], bad, {0, V});
    ADD_FAILURE() << "a target outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 23 at position 0 is outside [0, 23)"), std::string::npos) << e.what();
  }
}

// The one-pass op: the forward's outputs and, over the logits, the backward's gradient.
TEST(DenseCrossEntropy, ForwardBackwardInPlaceEqualsTheTwo) {
  const int64_t T = 9, V = 23;
  Tensor logits = random_tensor({T, V}, DType::F64, 3, 2.0);
  Tensor targets = random_targets(T, V, 4);
  auto fwd = ops::cross_entropy_forward(logits, targets);
  Tensor d = ops::cross_entropy_backward(logits, targets, fwd.lse, 0.25);
  Tensor x = logits.clone();
  auto both = ops::cross_entropy_forward_backward_(x, targets, 0.25);
  EXPECT_EQ(both.loss_sum.item(), fwd.loss_sum.item());
  EXPECT_EQ(rel_error(both.lse, fwd.lse), 0.0);
  EXPECT_EQ(rel_error(x, d), 0.0);
  EXPECT_GT(rel_error(x, logits), 0.5);  // the logits were overwritten
}

TEST(DenseCrossEntropy, ForwardNaiveAndF32) {
  const int64_t T = 11, V = 37;
  Tensor logits = random_tensor({T, V}, DType::F64, 1, 3.0);
  Tensor targets = random_targets(T, V, 2);
  auto fwd = ops::cross_entropy_forward(logits, targets);
  ASSERT_EQ(fwd.loss_sum.shape(), (Shape{1}));
  ASSERT_EQ(fwd.lse.shape(), (Shape{T}));
  double loss = 0;
  std::vector<double> lse(T);
  for (int64_t t = 0; t < T; ++t) {
    double z = 0;
    for (int64_t i = 0; i < V; ++i) z += std::exp(logits.item(t * V + i));
    lse[t] = std::log(z);
    const int32_t y = static_cast<int32_t>(targets.item(t));
    if (y != ops::kIgnoreIndex) loss += -std::log(std::exp(logits.item(t * V + y)) / z);
  }
  EXPECT_NEAR(fwd.loss_sum.item(), loss, 1e-12 * std::abs(loss));
  EXPECT_LT(rel_error(fwd.lse, Tensor::from_vector(lse, {T})), 1e-14);
  auto f = ops::cross_entropy_forward(f32(logits), targets);
  EXPECT_EQ(f.loss_sum.dtype(), DType::F32);
  EXPECT_NEAR(f.loss_sum.item(), loss, 1e-6 * std::abs(loss));
  EXPECT_LT(rel_error(f.lse, fwd.lse), 1e-6);
  // Ignored rows get a zero gradient; other rows sum to zero.
  Tensor d = ops::cross_entropy_backward(f32(logits), targets, f.lse, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    double s = 0, abs_sum = 0;
    for (int64_t i = 0; i < V; ++i) s += d.item(t * V + i), abs_sum += std::abs(d.item(t * V + i));
    if (targets.item(t) == ops::kIgnoreIndex) EXPECT_EQ(abs_sum, 0.0);
    else EXPECT_NEAR(s, 0.0, 1e-6);
  }
}

// The fused head: gradients of r * loss_sum w.r.t. x and W against finite differences,
// for chunkings that split the rows unevenly, and dW accumulating into what is there.
TEST(DenseLinearCrossEntropy, GradCheckAcrossChunkings) {
  for (uint64_t seed : kSeeds) {
    Rng rng(seed);
    const int64_t T = dim(rng, 3, 9), H = dim(rng, 2, 6), V = dim(rng, 2, 9);
    Tensor x = random_tensor({T, H}, DType::F64, seed + 1);
    Tensor w = random_tensor({V, H}, DType::F64, seed + 2);
    Tensor targets = random_targets(T, V, seed + 3);
    const double r = 0.5 + rng.uniform();
    auto loss = [&] { return r * ops::linear_cross_entropy(x, w, targets, 1.0, nullptr, nullptr).loss_sum.item(); };
    Tensor dx0, dw0 = Tensor::zeros({V, H}, DType::F64);
    ops::linear_cross_entropy(x, w, targets, r, &dx0, &dw0, T);  // one chunk
    for (int64_t chunk : {int64_t{1}, int64_t{2}, T - 1}) {
      Tensor dx, dw = Tensor::full({V, H}, 0.25, DType::F64);
      auto out = ops::linear_cross_entropy(x, w, targets, r, &dx, &dw, chunk);
      EXPECT_NEAR(r * out.loss_sum.item(), loss(), 1e-12 * std::abs(loss()));
      EXPECT_LT(rel_error(dx, dx0), 1e-13) << "chunk " << chunk;
      ops::add_(dw0, Tensor::full({V, H}, 0.25, DType::F64));
      EXPECT_LT(rel_error(dw, dw0), 1e-13) << "chunk " << chunk << ": dw must accumulate";
      ops::add_(dw0, Tensor::full({V, H}, -0.25, DType::F64));
    }
    const std::string op = fmt::format("linear_cross_entropy[T={},H={},V={}]", T, H, V);
    check_grad(op, "x", x, dx0, loss);
    check_grad(op, "w", w, dw0, loss);
  }
}

TEST(DenseCrossEntropy, LargeLogitsStayFinite) {
  Tensor logits = Tensor::from_vector(std::vector<float>{1000.f, 0.f, -1000.f, 3000.f, 3000.f, 2990.f}, {2, 3});
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{1, 0}, {2});
  auto fwd = ops::cross_entropy_forward(logits, targets);
  EXPECT_NEAR(fwd.loss_sum.item(), 1000.0 + std::log(2.0 + std::exp(-10.0)), 1e-3);
  Tensor d = ops::cross_entropy_backward(logits, targets, fwd.lse, 1.0);
  for (double x : d.to_double_vector()) EXPECT_TRUE(std::isfinite(x));
}

TEST(DenseCrossEntropy, Errors) {
  Tensor logits = random_tensor({3, 5}, DType::F32, 1);
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, -100, 5}, {3});
  expect_error([&] { ops::cross_entropy_forward(logits, bad); }, {"target 5", "position 2"});
  Tensor neg = Tensor::from_vector(std::vector<int32_t>{0, -1, 2}, {3});
  expect_error([&] { ops::cross_entropy_forward(logits, neg); }, {"-1", "position 1"});
  Tensor ok = Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3});
  expect_error([&] { ops::cross_entropy_forward(logits, ok.slice(0, 2)); }, {"targets"});
  expect_error([&] { ops::cross_entropy_backward(logits, bad, Tensor::zeros({3}, DType::F32), 1.0); }, {"5"});
  expect_error([&] { ops::cross_entropy_backward(logits, ok, Tensor::zeros({2}, DType::F32), 1.0); }, {"lse"});
}

// ---- split f32 masters ---------------------------------------------------------------

// Finite f32 values from random bits, with the cases that matter appended: signed zeros,
// +inf,
// the largest finite value, denormals, and exact ties (low 16 bits 0x8000, high half even
// and odd, both signs).
std::vector<uint32_t> master_bit_cases(int64_t n, uint64_t seed) {
  std::vector<uint32_t> bits;
  Rng rng(seed);
  while (static_cast<int64_t>(bits.size()) < n) {
    const uint32_t u = static_cast<uint32_t>(rng.next_u64());
    if ((u & 0x7f800000u) != 0x7f800000u) bits.push_back(u);  // not inf or NaN
  }
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x80008000u, 0x3f808000u,
                     0x3f818000u, 0xbf808000u, 0xbf818000u, 0x3f807fffu, 0x3f808001u, 0x7f800000u}) {
    bits.push_back(u);
  }
  return bits;
}

TEST(DenseMasterSplit, JoinGivesBackEveryBitAndTheWeightIsTheNearestBf16) {
  const std::vector<uint32_t> bits = master_bit_cases(100000, 7);
  const int64_t n = static_cast<int64_t>(bits.size());
  Tensor master = Tensor::empty({n}, DType::F32);
  std::memcpy(master.raw(), bits.data(), bits.size() * 4);
  Tensor high = Tensor::empty({n}, DType::BF16), low = Tensor::empty({n}, DType::I16);
  Tensor back = Tensor::full({n}, NAN, DType::F32);
  ops::master_split_into(master, high, low);
  ops::master_join_into(back, high, low);
  EXPECT_TRUE(moetrain::testing::bytes_equal(back, master)) << "join(split(x)) is not x";
  const float* m = master.data<float>();
  const moetrain::bf16* h = high.data<moetrain::bf16>();
  int ties = 0;
  for (int64_t i = 0; i < n; ++i) {
    const moetrain::bf16 rne(m[i]);
    if ((bits[i] & 0xffffu) != 0x8000u) {
      ASSERT_EQ(h[i].bits, rne.bits) << "not the nearest bf16 for bits " << std::hex << bits[i];
    } else {  // a tie: away from zero, the neighbour of larger magnitude
      ++ties;
      ASSERT_EQ(h[i].bits, static_cast<uint16_t>((bits[i] >> 16) + 1)) << "tie of bits " << std::hex << bits[i];
      ASSERT_GE(std::fabs(static_cast<float>(h[i])), std::fabs(m[i]));
    }
  }
  EXPECT_GE(ties, 5);
  // NaN masters (CUDA's canonical 0x7fffffff among them) stay NaN weights, never an
  // infinity or a zero from the carry.
  const std::vector<uint32_t> nans = {0x7fffffffu, 0xffffffffu, 0x7f800001u, 0xff807fffu, 0x7fc00000u, 0xffff8000u};
  Tensor nm = Tensor::empty({6}, DType::F32), nh = Tensor::empty({6}, DType::BF16), nl = Tensor::empty({6}, DType::I16);
  std::memcpy(nm.raw(), nans.data(), 24);
  ops::master_split_into(nm, nh, nl);
  Tensor nj = Tensor::empty({6}, DType::F32);
  ops::master_join_into(nj, nh, nl);
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(std::isnan(static_cast<float>(nh.data<moetrain::bf16>()[i]))) << std::hex << nans[i];
    EXPECT_TRUE(std::isnan(nj.data<float>()[i])) << std::hex << nans[i];
  }
}

// AdamW on a split master gives the bits of AdamW on the f32 master, then split.
TEST(DenseMasterSplit, AdamWOnSplitMastersEqualsF32Masters) {
  const int64_t n = 4099;
  Tensor f32 = random_tensor({n}, DType::F32, 11, 0.5);
  Tensor high = Tensor::empty({n}, DType::BF16), low = Tensor::empty({n}, DType::I16);
  ops::master_split_into(f32, high, low);
  Tensor value = Tensor::empty({n}, DType::BF16);
  Tensor m1 = Tensor::zeros({n}, DType::F32), v1 = Tensor::zeros({n}, DType::F32);
  Tensor m2 = m1.clone(), v2 = v1.clone();
  ops::AdamWTensors a{{f32}, {Tensor()}, {m1}, {v1}, {value}, {}, {true}};
  ops::AdamWTensors b{{high}, {Tensor()}, {m2}, {v2}, {Tensor()}, {low}, {true}};
  ops::AdamWStep s;
  s.lr = 1e-2, s.weight_decay = 0.1, s.grad_scale = 0.7;
  for (int step = 1; step <= 3; ++step) {
    a.grads[0] = b.grads[0] = random_tensor({n}, DType::F32, 20 + step);
    s.step = step;
    ops::adamw_update_all(a, s);
    ops::adamw_update_all(b, s);
    Tensor joined = Tensor::empty({n}, DType::F32);
    ops::master_join_into(joined, high, low);
    ASSERT_TRUE(moetrain::testing::bytes_equal(joined, f32)) << "step " << step << ": the masters differ";
    ASSERT_TRUE(moetrain::testing::bytes_equal(m1, m2) && moetrain::testing::bytes_equal(v1, v2)) << "step " << step;
  }
  // The weight: the nearest bf16 of the master (the RNE copy where the master is no tie).
  Tensor rne = f32.to(DType::BF16);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += high.data<moetrain::bf16>()[i].bits != rne.data<moetrain::bf16>()[i].bits;
  EXPECT_LE(differ, 2) << "the split weight should differ from round-to-nearest-even only at exact ties";
  // A split master is a bf16 param with an i16 low half and no value to refresh.
  ops::AdamWTensors bad{{high}, {a.grads[0]}, {m2}, {v2}, {value}, {low}, {true}};
  expect_error([&] { ops::adamw_update_all(bad, s); }, {"split master"});
  Tensor wrong = Tensor::empty({n}, DType::I32);
  expect_error([&] { ops::master_join_into(f32, high, wrong); }, {"i16"});
}

}  // namespace
