// FP8 (e4m3) on the CPU: the conversion against a brute-force nearest search over every
// e4m3 value, the block quantizers' scales, layouts and error bound, the transposed
// quantizer against quantizing x^T, and the block-scaled GEMM against the float64 product
// of its dequantized operands.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/rng.h"
#include "ops/arg_checks.h"
#include "ops/ops.h"
#include "backend_compare.h"
#include "test_util.h"

namespace moetrain {
namespace {

// The e4m3 code nearest to f by search over all finite codes (ties to the even mantissa),
// saturated to +-448.
uint8_t nearest_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(f));
  uint8_t best = 0;
  double best_d = INFINITY;
  for (int code = 0; code < 0x7f; ++code) {  // 0x7f is NaN
    const double v = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (code & 1) == 0)) {
      best = static_cast<uint8_t>(code);
      best_d = d;
    }
  }
  if (best == 0 && a == 0) return sign;  // keep the sign of zero
  return sign | best;
}

TEST(Fp8, ConversionRoundsToNearestEvenAndSaturates) {
  // Every finite code round-trips.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
  // Midpoints between neighbours go to the even one; just off them, to the nearer.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = fp8_e4m3_to_float(static_cast<uint8_t>(code)), hi = fp8_e4m3_to_float(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2;  // exact in f32
    EXPECT_EQ(float_to_fp8_e4m3(mid), (code & 1) ? code + 1 : code) << lo << " .. " << hi;
    EXPECT_EQ(float_to_fp8_e4m3(std::nextafter(mid, 0.0f)), code);
    EXPECT_EQ(float_to_fp8_e4m3(std::nextafter(mid, 1000.0f)), code + 1);
  }
  EXPECT_EQ(float_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7e);  // past 448 (even 480 would round to NaN's code): saturated
  EXPECT_EQ(float_to_fp8_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(1e-30f), 0x00);
  // Random floats over the whole range against the search.
  Rng rng(5);
  for (int i = 0; i < 20000; ++i) {
    const float f = static_cast<float>((rng.uniform() * 2 - 1) * std::pow(2.0, rng.uniform() * 24 - 14));
    ASSERT_EQ(float_to_fp8_e4m3(f), nearest_e4m3(f)) << f;
  }
}

Tensor with_zero_tile(Tensor x) {  // the first 1 x 128 tile (and so the first block's share) all zeros
  float* p = x.data<float>();
  for (int64_t c = 0; c < std::min<int64_t>(128, x.size(1)); ++c) p[c] = 0;
  return x;
}

TEST(Fp8, QuantizersScaleEachTileByItsMaximum) {
  const int64_t R = 130, C = 300;  // neither a multiple of 128
  const Tensor x = with_zero_tile(testing::random_tensor({R, C}, DType::F32, 3, 2.0));
  const std::vector<float> v = x.to_vector<float>();
  for (const ops::Fp8Blocks mode : {ops::Fp8Blocks::kRows, ops::Fp8Blocks::kBlocks}) {
    const ops::Fp8Tensor q = ops::quantize_fp8(x, mode);
    ASSERT_EQ(q.scale.shape(), ops::fp8_scale_shape(R, C, mode));
    const bool rows = mode == ops::Fp8Blocks::kRows;
    EXPECT_EQ(q.scale.shape(), rows ? (Shape{3, 130}) : (Shape{2, 4})) << "rows: [C/128, R]; blocks: padded to 4";
    const std::vector<float> s = q.scale.to_vector<float>();
    const int64_t tr = rows ? 1 : 128;
    for (int64_t r0 = 0; r0 < R; r0 += tr) {
      for (int64_t kb = 0; kb < 3; ++kb) {
        float amax = 0;
        for (int64_t r = r0; r < std::min(R, r0 + tr); ++r) {
          for (int64_t c = kb * 128; c < std::min(C, kb * 128 + 128); ++c) amax = std::max(amax, std::fabs(v[r * C + c]));
        }
        const float got = rows ? s[kb * R + r0] : s[(r0 / 128) * 4 + kb];
        EXPECT_EQ(got, amax > 0 ? amax / 448.0f : 1.0f) << r0 << "," << kb;
      }
    }
    if (!rows) {
      EXPECT_EQ(s[3], 1.0f) << "padding";
    }
    // Within half an e4m3 step of each element (relative 2^-4 of the normal range, 2^-10 of
    // the tile scale below it), and the tile's largest element exactly its scale x 448.
    const std::vector<double> back = ops::dequantize_fp8(q, DType::F64).to_double_vector();
    for (int64_t i = 0; i < R * C; ++i) {
      const int64_t kb = (i % C) / 128, r = i / C;
      const double scale = rows ? s[kb * R + r] : s[(r / 128) * 4 + kb];
      EXPECT_LE(std::fabs(back[i] - v[i]), std::max(std::fabs(static_cast<double>(v[i])) / 16, scale / 1024) * (1 + 1e-6)) << i;
    }
  }
  // All-zero tile: scale 1, zero codes.
  const ops::Fp8Tensor q = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
  EXPECT_EQ(q.scale.item(0), 1.0);
  EXPECT_EQ(static_cast<const uint8_t*>(q.q.raw())[5], 0);
}

TEST(Fp8, TransposedQuantizerIsTheTransposeQuantized) {
  const int64_t R = 300, C = 70;
  const Tensor x = testing::random_tensor({R, C}, DType::F32, 4);
  std::vector<float> t(R * C);
  const std::vector<float> v = x.to_vector<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) t[c * R + r] = v[r * C + c];
  }
  for (const ops::Fp8Blocks mode : {ops::Fp8Blocks::kRows, ops::Fp8Blocks::kBlocks}) {
    const ops::Fp8Tensor a = ops::quantize_fp8_transposed(x, mode);
    const ops::Fp8Tensor b = ops::quantize_fp8(Tensor::from_vector(t, {C, R}), mode);
    ASSERT_EQ(a.q.shape(), (Shape{C, R}));
    EXPECT_EQ(0, std::memcmp(a.q.raw(), b.q.raw(), a.q.nbytes()));
    EXPECT_EQ(a.scale.to_vector<float>(), b.scale.to_vector<float>());
  }
  // A weight's blocks are W^T's blocks: the same scales, transposed on the grid.
  const ops::Fp8Tensor w = ops::quantize_fp8(x, ops::Fp8Blocks::kBlocks);
  const ops::Fp8Tensor wt = ops::quantize_fp8_transposed(x, ops::Fp8Blocks::kBlocks);
  EXPECT_EQ(w.scale.item(0 * 4 + 0), wt.scale.item(0 * 4 + 0));
  EXPECT_EQ(w.scale.item(2 * 4 + 0), wt.scale.item(0 * 4 + 2));  // row block 2 of x is column block 2 of x^T
}

// The experts' rows quantized by quantizing each token once and gathering codes and scales
// (the dispatch's rows_q) are the bits of quantizing the gathered rows, for a whole
// permutation and for one that keeps only a range of experts' rows (expert parallelism's
// local part). Widths with a partial last tile (300 = 2 x 128 + 44).
TEST(Fp8, PermutedTokenCodesAreTheCodesOfThePermutedRows) {
  const int64_t T = 37, E = 6, K = 3, H = 300;
  const Tensor idx = ops::router_forward(testing::random_tensor({T, E}, DType::F64, 90), K, false).topk_idx;
  const Tensor x = testing::random_tensor({T, H}, DType::F32, 91);
  ops::Permutation part = ops::permutation_by_expert(ops::expert_ids_in_range(idx, 2, 3), 4);
  part.rows = 0;
  for (int64_t c : part.expert_counts.to_vector<int64_t>()) part.rows += c;
  part.rows -= part.expert_counts.to_vector<int64_t>()[3];  // the rows of the other experts dropped
  ASSERT_GT(part.rows, 0);
  ASSERT_LT(part.rows, T * K);
  for (const ops::Permutation& p : {ops::permutation_by_expert(idx, E), part}) {
    const ops::Fp8Tensor got = ops::permute_forward_fp8(ops::quantize_fp8(x, ops::Fp8Blocks::kRows), p);
    const ops::Fp8Tensor want = ops::quantize_fp8(ops::permute_forward(x, p), ops::Fp8Blocks::kRows);
    ASSERT_EQ(got.q.shape(), (Shape{p.permuted_rows(), H}));
    ASSERT_EQ(got.scale.shape(), want.scale.shape());
    EXPECT_EQ(0, std::memcmp(got.q.raw(), want.q.raw(), want.q.nbytes()));
    EXPECT_EQ(got.scale.to_vector<float>(), want.scale.to_vector<float>());
    // with the rows' values in the same pass: the same codes, and their dequantized values
    const ops::UnpackedFp8Rows v = ops::permute_forward_fp8_values(ops::quantize_fp8(x, ops::Fp8Blocks::kRows), p,
                                                                   DType::BF16);
    EXPECT_EQ(0, std::memcmp(v.q.q.raw(), want.q.raw(), want.q.nbytes()));
    EXPECT_EQ(v.q.scale.to_vector<float>(), want.scale.to_vector<float>());
    EXPECT_EQ(v.values.to_double_vector(), ops::dequantize_fp8(want, DType::BF16).to_double_vector());
  }
  // Weights' blocks are refused, naming what is expected.
  try {
    ops::permute_forward_fp8(ops::quantize_fp8(x, ops::Fp8Blocks::kBlocks), ops::permutation_by_expert(idx, E));
    ADD_FAILURE() << "blocks mode taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows mode"), std::string::npos) << e.what();
  }
}

// The packed rows an expert dispatch moves: row r is its codes, then its tiles' scales as
// little-endian f32 bytes (read back here byte by byte, so a transposed or misplaced scale
// fails); unpacking gives the codes and scales back bit for bit and the values dequantize_fp8
// makes, in every dtype. Widths: a partial last tile, whole tiles, and no columns.
TEST(Fp8, PackedRowsHoldEachRowsCodesThenItsScales) {
  for (const int64_t C : {300, 256, 0}) {
    SCOPED_TRACE("C = " + std::to_string(C));
    const int64_t R = 23, L = (C + 127) / 128, W = C + 4 * L;
    const ops::Fp8Tensor x = ops::quantize_fp8(testing::random_tensor({R, C}, DType::F32, 96 + C), ops::Fp8Blocks::kRows);
    const Tensor packed = ops::pack_fp8_rows(x);
    ASSERT_EQ(packed.shape(), (Shape{R, W}));
    ASSERT_EQ(packed.dtype(), DType::F8E4M3);
    const uint8_t* p = static_cast<const uint8_t*>(packed.raw());
    const uint8_t* q = static_cast<const uint8_t*>(x.q.raw());
    const std::vector<float> s = x.scale.to_vector<float>();
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) ASSERT_EQ(p[r * W + c], q[r * C + c]) << "code (" << r << ", " << c << ")";
      for (int64_t l = 0; l < L; ++l) {
        uint32_t bits = 0;
        for (int b = 0; b < 4; ++b) bits |= static_cast<uint32_t>(p[r * W + C + 4 * l + b]) << (8 * b);
        float v;
        std::memcpy(&v, &bits, 4);
        ASSERT_EQ(v, s[static_cast<size_t>(l * R + r)]) << "scale of tile " << l << " of row " << r;
      }
    }
    for (DType dt : {DType::F32, DType::BF16, DType::F64}) {
      const ops::UnpackedFp8Rows u = ops::unpack_fp8_rows(packed, C, dt);
      ASSERT_EQ(u.q.q.shape(), x.q.shape());
      EXPECT_EQ(0, std::memcmp(u.q.q.raw(), x.q.raw(), x.q.nbytes()));
      EXPECT_EQ(u.q.scale.to_vector<float>(), s);
      EXPECT_EQ(u.q.blocks, ops::Fp8Blocks::kRows);
      ASSERT_EQ(u.values.dtype(), dt);
      EXPECT_EQ(u.values.to_double_vector(), ops::dequantize_fp8(x, dt).to_double_vector());
    }
  }
  // A width that does not match the packed rows is refused, naming both.
  const Tensor packed = ops::pack_fp8_rows(ops::quantize_fp8(testing::random_tensor({4, 256}, DType::F32, 1),
                                                             ops::Fp8Blocks::kRows));
  try {
    ops::unpack_fp8_rows(packed, 200, DType::F32);
    ADD_FAILURE() << "a width of 200 taken for rows of 256";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("packed must be f8e4m3 [R, 208] (the codes and scales of 200 columns), got"),
              std::string::npos)
        << e.what();
  }
  try {
    ops::pack_fp8_rows(ops::quantize_fp8(testing::random_tensor({4, 256}, DType::F32, 1), ops::Fp8Blocks::kBlocks));
    ADD_FAILURE() << "blocks mode taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows mode"), std::string::npos) << e.what();
  }
}

// RMSNorm's fused quantization: y as rmsnorm_forward makes it, and its codes and scales
// quantize_fp8's of that y; a width of partial tiles is refused, naming it.
TEST(Fp8, RmsNormOutputQuantizedIsTheQuantizersOfItsOutput) {
  const Tensor x = testing::random_tensor({9, 256}, DType::F32, 70), w = testing::random_tensor({256}, DType::F32, 71);
  const ops::RmsNormOut got = ops::rmsnorm_forward_fp8(x, w, 1e-6), plain = ops::rmsnorm_forward(x, w, 1e-6);
  EXPECT_EQ(got.y.to_vector<float>(), plain.y.to_vector<float>());
  const ops::Fp8Tensor want = ops::quantize_fp8(plain.y, ops::Fp8Blocks::kRows);
  ASSERT_EQ(got.y_q.q.shape(), want.q.shape());
  EXPECT_EQ(0, std::memcmp(got.y_q.q.raw(), want.q.raw(), want.q.nbytes()));
  EXPECT_EQ(got.y_q.scale.to_vector<float>(), want.scale.to_vector<float>());
  try {
    ops::rmsnorm_forward_fp8(testing::random_tensor({9, 512}, DType::F32, 74), w, 1e-6);
    ADD_FAILURE() << "rows of 512 taken for a norm of 256";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm_forward_fp8: x must be rows [R, 256]"), std::string::npos) << e.what();
  }
  try {
    ops::rmsnorm_forward_fp8(testing::random_tensor({9, 200}, DType::F32, 72),
                             testing::random_tensor({200}, DType::F32, 73), 1e-6);
    ADD_FAILURE() << "a width of 200 taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm_forward_fp8: the row width (w's length) must be a multiple of 128"),
              std::string::npos)
        << e.what();
  }
}

// Each expert's W^T blocks moved from W's are the blocks of W^T quantized: codes and scales
// bit for bit, for experts whose weights are wider than tall and taller than wide.
TEST(Fp8, TransposedExpertBlocksAreEachExpertsTransposeQuantized) {
  for (const auto& [E, n, k] : {std::tuple<int64_t, int64_t, int64_t>{3, 256, 384}, {2, 640, 128}}) {
    const Tensor w = testing::random_tensor({E, n, k}, DType::F32, 95 + n);
    const ops::Fp8Tensor t = ops::transpose_fp8_experts(ops::quantize_fp8_experts(w), E);
    ASSERT_EQ(t.q.shape(), (Shape{E * k, n}));
    const int64_t lt = t.scale.size(1);
    for (int64_t e = 0; e < E; ++e) {
      const ops::Fp8Tensor want = ops::quantize_fp8_transposed(w.select(e), ops::Fp8Blocks::kBlocks);
      EXPECT_EQ(0, std::memcmp(static_cast<const uint8_t*>(t.q.raw()) + e * k * n, want.q.raw(), want.q.nbytes()))
          << "expert " << e;
      const std::vector<float> ws = want.scale.to_vector<float>(), ts = t.scale.to_vector<float>();
      ASSERT_EQ(want.scale.size(1), lt);
      for (size_t i = 0; i < ws.size(); ++i) EXPECT_EQ(ts[e * (k / 128) * lt + i], ws[i]) << "expert " << e << " scale " << i;
    }
  }
}

// Both ways in one op: an output gradient's 1 x 128 tiles (quantize_fp8_both_ways) are the
// rows quantizer's and the transposed one's; a weight's blocks (quantize_fp8_weight): a
// matrix's are quantize_fp8's and quantize_fp8_transposed's in blocks mode, ragged blocks
// included; an expert weight's are quantize_fp8_experts' and their transpose_fp8_experts; an
// expert weight whose experts are not whole blocks either way is refused with the op and the
// shape named.
TEST(Fp8, BothWaysAreTheTwoQuantizers) {
  auto same = [](const ops::Fp8Tensor& a, const ops::Fp8Tensor& b) {
    return a.q.shape() == b.q.shape() && std::memcmp(a.q.raw(), b.q.raw(), a.q.nbytes()) == 0 &&
           a.scale.to_vector<float>() == b.scale.to_vector<float>();
  };
  const Tensor m = testing::random_tensor({200, 328}, DType::F32, 97);
  const ops::Fp8WeightBlocks mb = ops::quantize_fp8_weight(m);
  EXPECT_TRUE(same(mb.w, ops::quantize_fp8(m, ops::Fp8Blocks::kBlocks)));
  EXPECT_TRUE(same(mb.w_t, ops::quantize_fp8_transposed(m, ops::Fp8Blocks::kBlocks)));
  const ops::Fp8BothWays ways = ops::quantize_fp8_both_ways(m);
  EXPECT_TRUE(same(ways.rows, ops::quantize_fp8(m, ops::Fp8Blocks::kRows)));
  EXPECT_TRUE(same(ways.tokens, ops::quantize_fp8_transposed(m)));
  const Tensor w = testing::random_tensor({2, 256, 384}, DType::F32, 98);
  const ops::Fp8WeightBlocks wb = ops::quantize_fp8_weight(w);
  const ops::Fp8Tensor blocks = ops::quantize_fp8_experts(w);
  EXPECT_TRUE(same(wb.w, blocks));
  EXPECT_TRUE(same(wb.w_t, ops::transpose_fp8_experts(blocks, 2)));
  EXPECT_FALSE(same(wb.w, wb.w_t));
  const std::string err = testing::error_of([] { ops::quantize_fp8_weight(Tensor::zeros({2, 200, 128}, DType::F32)); });
  for (const char* part : {"quantize_fp8_weight", "[200, 128]", "multiples of 128"}) {
    EXPECT_NE(err.find(part), std::string::npos) << err;
  }
}

// The experts' FP8 input gradient (CPU reference) against the BF16 op in f64 on the same
// dequantized operands: dgate and dup equal to f32 rounding, dx the product of dgate and dup
// quantized per 1 x 128 tile (their own quantization error shows against the unquantized
// dx). The weights come in as transpose_fp8_experts of the forward's blocks, so a transposed
// read of them errs by O(1).
Tensor transposed(const Tensor& m) {  // an f64 [R, C] matrix -> [C, R]
  const int64_t R = m.size(0), C = m.size(1);
  const std::vector<double> v = m.to_double_vector();
  std::vector<double> t(v.size());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) t[c * R + r] = v[r * C + c];
  }
  return Tensor::from_vector(t, {C, R});
}

TEST(Fp8, ExpertInputGradientIsTheProductOfTheDequantizedOperands) {
  const int64_t E = 3, H = 256, I = 384;
  const std::vector<int64_t> c{50, 0, 77};
  const int64_t N = 127;
  const Tensor dy = testing::random_tensor({N, H}, DType::F32, 96);
  const Tensor gate = testing::random_tensor({N, I}, DType::F32, 97), up = testing::random_tensor({N, I}, DType::F32, 98);
  const Tensor wg = testing::random_tensor({E, I, H}, DType::F32, 99, 0.05);
  const Tensor wu = testing::random_tensor({E, I, H}, DType::F32, 100, 0.05);
  const Tensor wd = testing::random_tensor({E, H, I}, DType::F32, 101, 0.05);
  const Tensor counts = Tensor::from_vector(c, {E});
  const ops::Fp8Tensor dyq = ops::quantize_fp8(dy, ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor gq = ops::quantize_fp8_experts(wg), uq = ops::quantize_fp8_experts(wu);
  const ops::Fp8Tensor dq = ops::quantize_fp8_experts(wd);
  const ops::SwigluInputGrads got = ops::grouped_swiglu_backward_input_fp8(
      dyq, counts, gate, up, ops::transpose_fp8_experts(gq, E), ops::transpose_fp8_experts(uq, E),
      ops::transpose_fp8_experts(dq, E), E);
  auto deq = [&](const ops::Fp8Tensor& q, const Shape& s) { return ops::dequantize_fp8(q, DType::F64).view(s); };
  const Tensor wgd = deq(gq, {E, I, H}), wud = deq(uq, {E, I, H}), wdd = deq(dq, {E, H, I});
  const ops::SwigluInputGrads ref = ops::grouped_swiglu_backward_input(
      deq(dyq, {N, H}), counts, gate.to(DType::F64), up.to(DType::F64), wgd, wud, wdd);
  EXPECT_LT(testing::backend_error(got.dgate, ref.dgate), 1e-5);
  EXPECT_LT(testing::backend_error(got.dup, ref.dup), 1e-5);
  const double unquantized = testing::backend_error(got.dx, ref.dx);
  EXPECT_GT(unquantized, 1e-4) << "dx did not see dgate's and dup's quantization";
  EXPECT_LT(unquantized, 0.1);
  // dx from the quantized dgate and dup, in f64
  const Tensor qg = ops::dequantize_fp8(ops::quantize_fp8(got.dgate, ops::Fp8Blocks::kRows), DType::F64);
  const Tensor qu = ops::dequantize_fp8(ops::quantize_fp8(got.dup, ops::Fp8Blocks::kRows), DType::F64);
  Tensor dx = Tensor::zeros({N, H}, DType::F64);
  int64_t r0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r1 = r0 + c[e];
    if (r1 > r0) {  // dgate Wg[e] = linear(dgate, Wg[e]^T)
      Tensor part = ops::linear_forward(qg.slice(r0, r1), transposed(wgd.select(e)));
      ops::add_(part, ops::linear_forward(qu.slice(r0, r1), transposed(wud.select(e))));
      dx.slice(r0, r1).copy_from(part);
    }
    r0 = r1;
  }
  EXPECT_LT(testing::backend_error(got.dx, dx), 1e-5);
}

// The experts' weight-gradient operands: each tile of 128 columns holds rows of one expert
// only, as quantize_fp8_transposed of those rows (the same codes and scales, bit for bit),
// zero codes past the expert's rows and whole zero tiles (scale 1) past the last expert's.
TEST(Fp8, ExpertColumnsHoldEachExpertsRowsInItsOwnTiles) {
  const std::vector<int64_t> c{129, 0, 128, 5, 1};
  const int64_t E = 5, N = 263, C = 200;
  const int64_t T = ops::fp8_expert_tiles(N, E), P = 128 * T;
  ASSERT_EQ(T, 3 + 5);
  for (DType dt : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = testing::random_tensor({N, C}, dt, 301);
    const ops::Fp8Tensor q = ops::quantize_fp8_expert_columns(x, Tensor::from_vector(c, {E}));
    ASSERT_EQ(q.q.shape(), (Shape{C, P}));
    ASSERT_EQ(q.scale.shape(), (Shape{T, C}));
    ASSERT_EQ(q.blocks, ops::Fp8Blocks::kRows);
    const uint8_t* code = static_cast<const uint8_t*>(q.q.raw());
    const std::vector<float> sc = q.scale.to_vector<float>();
    int64_t row = 0, tile = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r0 = row; r0 < row + c[e]; r0 += 128, ++tile) {
        const int64_t rows = std::min<int64_t>(128, row + c[e] - r0);
        const ops::Fp8Tensor ref = ops::quantize_fp8_transposed(x.slice(r0, r0 + rows));  // [C, rows]
        const uint8_t* rq = static_cast<const uint8_t*>(ref.q.raw());
        const std::vector<float> rs = ref.scale.to_vector<float>();
        for (int64_t k = 0; k < C; ++k) {
          for (int64_t i = 0; i < 128; ++i) {
            ASSERT_EQ(code[k * P + tile * 128 + i], i < rows ? rq[k * rows + i] : 0)
                << "expert " << e << " tile " << tile << " column " << k << " row " << i;
          }
          ASSERT_EQ(sc[tile * C + k], rs[k]) << "scale of tile " << tile << " column " << k;
        }
      }
      row += c[e];
    }
    ASSERT_EQ(tile, 2 + 0 + 1 + 1 + 1);
    for (; tile < T; ++tile) {  // past the last expert's tiles: zeros, scale 1
      for (int64_t k = 0; k < C; ++k) {
        for (int64_t i = 0; i < 128; ++i) ASSERT_EQ(code[k * P + tile * 128 + i], 0);
        ASSERT_EQ(sc[tile * C + k], 1.0f);
      }
    }
  }
  // Counts that do not cover the rows are refused, naming them.
  try {
    ops::quantize_fp8_expert_columns(testing::random_tensor({10, 128}, DType::F32, 1),
                                     Tensor::from_vector(std::vector<int64_t>{4, 5}, {2}));
    ADD_FAILURE() << "counts summing to 9 taken for 10 rows";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("quantize_fp8_expert_columns: counts sum to 9 but there are 10 rows"),
              std::string::npos)
        << e.what();
  }
}

// dW_e = A_e B_e^T over each expert's tiles, against the float64 sum over the expert's rows
// of the dequantized operands' products (the padding adds nothing); accumulating adds to dw
// and leaves an expert without rows as it was, writing gives it zeros.
TEST(Fp8, GroupedWgradIsTheProductOfTheDequantizedOperands) {
  const std::vector<int64_t> c{70, 0, 200, 1};
  const int64_t E = 4, N = 271, Ca = 256, Cb = 384;
  const Tensor counts = Tensor::from_vector(c, {E});
  const Tensor a = testing::random_tensor({N, Ca}, DType::F32, 311), b = testing::random_tensor({N, Cb}, DType::F32, 312);
  const ops::Fp8Tensor at = ops::quantize_fp8_expert_columns(a, counts), bt = ops::quantize_fp8_expert_columns(b, counts);
  const int64_t P = at.q.size(1);
  const std::vector<double> ad = ops::dequantize_fp8(at, DType::F64).to_double_vector();
  const std::vector<double> bd = ops::dequantize_fp8(bt, DType::F64).to_double_vector();
  std::vector<double> ref(static_cast<size_t>(E * Ca * Cb), 0.0);
  int64_t tile = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t tiles = (c[e] + 127) / 128;
    for (int64_t m = 0; m < Ca; ++m) {
      for (int64_t n = 0; n < Cb; ++n) {
        double sum = 0;
        for (int64_t j = tile * 128; j < (tile + tiles) * 128; ++j) sum += ad[m * P + j] * bd[n * P + j];
        ref[(e * Ca + m) * Cb + n] = sum;
      }
    }
    tile += tiles;
  }
  const Tensor want = Tensor::from_vector(ref, {E, Ca, Cb});
  Tensor dw = Tensor::full({E, Ca, Cb}, 7.0, DType::F32);
  ops::grouped_wgrad_fp8(at, bt, counts, dw, /*accumulate=*/false);
  EXPECT_LT(testing::backend_error(dw, want), 1e-6);
  const std::vector<float> got = dw.to_vector<float>();
  for (int64_t i = Ca * Cb; i < 2 * Ca * Cb; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], 0.0f) << "expert 1, written";
  // the product is not the unquantized one
  double sum0 = 0;
  const std::vector<double> av = a.to_double_vector(), bv = b.to_double_vector();
  for (int64_t r = 0; r < c[0]; ++r) sum0 += av[r * Ca] * bv[r * Cb];
  EXPECT_NE(sum0, ref[0]);
  EXPECT_LT(std::fabs(sum0 - ref[0]), 0.1 * std::sqrt(static_cast<double>(c[0])));
  // accumulating: + the same product; expert 1 keeps what it had
  Tensor acc = Tensor::full({E, Ca, Cb}, 0.5, DType::F32);
  ops::grouped_wgrad_fp8(at, bt, counts, acc, /*accumulate=*/true);
  std::vector<double> plus = ref;
  for (double& v : plus) v += 0.5;
  EXPECT_LT(testing::backend_error(acc, Tensor::from_vector(plus, {E, Ca, Cb})), 1e-6);
  const std::vector<float> accv = acc.to_vector<float>();
  for (int64_t i = Ca * Cb; i < 2 * Ca * Cb; ++i) ASSERT_EQ(accv[static_cast<size_t>(i)], 0.5f) << "expert 1, added";
  // operands of other layouts are refused, naming the shapes
  Tensor small = Tensor::zeros({E, Ca, Cb + 1}, DType::F32);
  EXPECT_THROW(ops::grouped_wgrad_fp8(at, bt, counts, small, false), Error);
  const ops::Fp8Tensor rows = ops::quantize_fp8(testing::random_tensor({Ca, 128}, DType::F32, 1), ops::Fp8Blocks::kRows);
  EXPECT_THROW(ops::grouped_wgrad_fp8(rows, bt, counts, dw, false), Error);
}

// Several sources (micro-batches) in one call: the sum of each one's product, written once or
// added; the same as calling once per source with the later calls accumulating.
TEST(Fp8, GroupedWgradOfSeveralSourcesIsTheSumOfTheirs) {
  const int64_t E = 3, Ca = 128, Cb = 256;
  const std::vector<std::vector<int64_t>> counts{{5, 0, 130}, {0, 0, 0}, {64, 64, 1}};
  std::vector<ops::Fp8WgradOperands> sources;
  for (size_t i = 0; i < counts.size(); ++i) {
    int64_t N = 0;
    for (int64_t c : counts[i]) N += c;
    const Tensor cnt = Tensor::from_vector(counts[i], {E});
    sources.push_back({ops::quantize_fp8_expert_columns(testing::random_tensor({N, Ca}, DType::F32, 400 + i), cnt),
                       ops::quantize_fp8_expert_columns(testing::random_tensor({N, Cb}, DType::F32, 500 + i), cnt),
                       cnt});
  }
  for (const bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulating" : "writing");
    const Tensor start = testing::random_tensor({E, Ca, Cb}, DType::F32, 9);
    Tensor want = start.clone();
    for (size_t i = 0; i < sources.size(); ++i) {
      ops::grouped_wgrad_fp8(sources[i].a_t, sources[i].b_t, sources[i].counts, want, accumulate || i > 0);
    }
    Tensor got = start.clone();
    ops::grouped_wgrad_fp8(sources, got, accumulate);
    EXPECT_LT(testing::backend_error(got, want), 1e-6);
    EXPECT_GT(testing::backend_error(got, start), 0.1);
  }
  // sources of other widths or expert counts are refused, naming the source
  std::vector<ops::Fp8WgradOperands> bad = sources;
  bad[2].counts = Tensor::from_vector(std::vector<int64_t>{64, 65}, {2});
  Tensor dw = Tensor::zeros({E, Ca, Cb}, DType::F32);
  try {
    ops::grouped_wgrad_fp8(bad, dw, false);
    ADD_FAILURE() << "a source of 2 experts taken among sources of 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("source 2's counts must be i64 [E = 3]"), std::string::npos) << e.what();
  }
}

TEST(Fp8, LinearMatchesTheProductOfTheDequantizedOperands) {
  for (const ops::Fp8Blocks wmode : {ops::Fp8Blocks::kRows, ops::Fp8Blocks::kBlocks}) {
    const int64_t M = 36, N = 140, K = 272;
    const ops::Fp8Tensor a = ops::quantize_fp8(testing::random_tensor({M, K}, DType::F32, 7), ops::Fp8Blocks::kRows);
    const ops::Fp8Tensor b = ops::quantize_fp8(testing::random_tensor({N, K}, DType::F32, 8, 0.05), wmode);
    const Tensor want = ops::linear_forward(ops::dequantize_fp8(a, DType::F64), ops::dequantize_fp8(b, DType::F64));
    const Tensor got = ops::linear_fp8(a, b, DType::F32);
    EXPECT_LT(testing::rel_error(got.to(DType::F64), want), 1e-6);
  }
  // Into an output: written, or added to (a weight gradient over micro-batches).
  {
    const ops::Fp8Tensor a = ops::quantize_fp8(testing::random_tensor({8, 200}, DType::F32, 5), ops::Fp8Blocks::kRows);
    const ops::Fp8Tensor b = ops::quantize_fp8(testing::random_tensor({12, 200}, DType::F32, 6), ops::Fp8Blocks::kRows);
    const Tensor prod = ops::linear_fp8(a, b, DType::F32);
    Tensor y = testing::random_tensor({8, 12}, DType::F32, 9);
    Tensor y0 = y.clone();
    ops::linear_fp8_into(a, b, y, /*accumulate=*/true);
    ops::add_(y0, prod);
    EXPECT_LT(testing::rel_error(y, y0), 1e-7);
    ops::linear_fp8_into(a, b, y, /*accumulate=*/false);
    EXPECT_EQ(y.to_vector<float>(), prod.to_vector<float>());
    Tensor wrong = Tensor::zeros({8, 13}, DType::F32);
    EXPECT_THROW(ops::linear_fp8_into(a, b, wrong, false), Error);
  }
  const ops::Fp8Tensor a = ops::quantize_fp8(testing::random_tensor({4, 128}, DType::F32, 1), ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor w = ops::quantize_fp8(testing::random_tensor({8, 256}, DType::F32, 2), ops::Fp8Blocks::kBlocks);
  EXPECT_THROW(ops::linear_fp8(a, w, DType::F32), Error);  // K differs
  EXPECT_THROW(ops::linear_fp8(w, a, DType::F32), Error);  // a in blocks mode
  ops::Fp8Tensor bad = a;
  bad.scale = Tensor::zeros({2, 4}, DType::F32);
  EXPECT_THROW(ops::dequantize_fp8(bad, DType::F32), Error);  // scales of another shape
}

}  // namespace
}  // namespace moetrain
