// FP8 on the GPU against the CPU references (ops/cpu/fp8.cpp): the quantizers bit for bit
// (the same e4m3 codes and scales) on bf16 and f32 inputs of ragged shapes; the block-scaled
// GEMM (cuBLASLt) against the CPU's and against the float64 product of the dequantized
// operands, with the weight in 1 x 128 and in 128 x 128 blocks. Skips without a GPU.
// The bound, 5e-4: Hopper's FP8 MMAs accumulate with ~14 bits inside each 128-wide block of
// K before the f32 promotion (DeepSeek-V3 report 3.3.2): measured 1.2e-4 to 1.3e-4 on an
// H200 at every shape; a misplaced scale or block errs by O(1).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend_compare.h"
#include "ops/arg_checks.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::backend_error;
using testing::on_gpu;
using testing::PoisonScope;
using testing::random_bf16_values;

const Device kGpu = Device::cuda(0);

void expect_same_fp8(const ops::Fp8Tensor& gpu, const ops::Fp8Tensor& cpu, const std::string& what) {
  const Tensor q = gpu.q.to(Device::cpu()), s = gpu.scale.to(Device::cpu());
  ASSERT_EQ(q.shape(), cpu.q.shape()) << what;
  ASSERT_EQ(s.shape(), cpu.scale.shape()) << what;
  const uint8_t* a = static_cast<const uint8_t*>(q.raw());
  const uint8_t* b = static_cast<const uint8_t*>(cpu.q.raw());
  int64_t differ = 0;
  for (int64_t i = 0; i < q.numel(); ++i) differ += a[i] != b[i];
  EXPECT_EQ(differ, 0) << what << ": e4m3 codes that differ";
  EXPECT_EQ(s.to_vector<float>(), cpu.scale.to_vector<float>()) << what << ": scales";
}

TEST(BackendFp8, QuantizersMatchTheCpuBitForBit) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t R, C;
  };
  // 144 x 200 and 2064 x 1024: the 16-byte transposed kernel with partial blocks of rows and columns.
  for (Case c : {Case{130, 300}, Case{256, 512}, Case{1, 7}, Case{517, 2048}, Case{144, 200}, Case{2064, 1024}}) {
    Tensor x = random_bf16_values({c.R, c.C}, c.R * 7 + c.C, 3.0);
    float* p = x.data<float>();
    for (int64_t i = 0; i < std::min<int64_t>(c.C, 128); ++i) p[i] = 0;  // an all-zero tile
    for (DType dt : {DType::BF16, DType::F32}) {
      const std::string tag = fmt::format("[{} x {}, {}]", c.R, c.C, dtype_name(dt));
      const Tensor xg = on_gpu(x, dt);
      expect_same_fp8(ops::quantize_fp8(xg, ops::Fp8Blocks::kRows), ops::quantize_fp8(x, ops::Fp8Blocks::kRows),
                      "rows " + tag);
      expect_same_fp8(ops::quantize_fp8(xg, ops::Fp8Blocks::kBlocks), ops::quantize_fp8(x, ops::Fp8Blocks::kBlocks),
                      "blocks " + tag);
      expect_same_fp8(ops::quantize_fp8_transposed(xg), ops::quantize_fp8_transposed(x), "transposed " + tag);
      expect_same_fp8(ops::quantize_fp8_transposed(xg, ops::Fp8Blocks::kBlocks),
                      ops::quantize_fp8_transposed(x, ops::Fp8Blocks::kBlocks), "transposed blocks " + tag);
      const ops::Fp8BothWays ways = ops::quantize_fp8_both_ways(xg);  // one pass where C % 8 == 0, R % 16 == 0
      expect_same_fp8(ways.rows, ops::quantize_fp8(x, ops::Fp8Blocks::kRows), "both ways, rows " + tag);
      expect_same_fp8(ways.tokens, ops::quantize_fp8_transposed(x), "both ways, tokens " + tag);
      const ops::Fp8WeightBlocks both = ops::quantize_fp8_weight(xg);  // one pass where C % 8 == 0, R % 16 == 0
      expect_same_fp8(both.w, ops::quantize_fp8(x, ops::Fp8Blocks::kBlocks), "weight " + tag);
      expect_same_fp8(both.w_t, ops::quantize_fp8_transposed(x, ops::Fp8Blocks::kBlocks), "weight^T " + tag);
    }
    const ops::Fp8Tensor qg = ops::quantize_fp8(on_gpu(x, DType::BF16), ops::Fp8Blocks::kBlocks);
    for (DType dt : {DType::F32, DType::BF16}) {
      EXPECT_EQ(backend_error(ops::dequantize_fp8(qg, dt).to(Device::cpu()),
                              ops::dequantize_fp8(ops::quantize_fp8(x, ops::Fp8Blocks::kBlocks), dt)),
                0.0)
          << dtype_name(dt);
    }
  }
}

// An expert weight's blocks both ways in one pass (quantize_fp8_weight of [E, n, k]) against the
// CPU's, which quantizes and then moves the blocks (transpose_fp8_experts); both shapes of
// the bench model's experts (gate/up [E, I, H], down [E, H, I]) at a small E.
TEST(BackendFp8, ExpertWeightBlocksBothWaysMatchTheCpu) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const Shape& shape : {Shape{3, 768, 256}, Shape{2, 256, 768}, Shape{1, 128, 128}}) {
    const Tensor w = random_bf16_values(shape, shape[1] + shape[2], 0.05);
    for (DType dt : {DType::BF16, DType::F32}) {
      const std::string tag = fmt::format("[{}, {}, {}] {}", shape[0], shape[1], shape[2], dtype_name(dt));
      const ops::Fp8WeightBlocks gpu = ops::quantize_fp8_weight(on_gpu(w, dt));
      const ops::Fp8WeightBlocks cpu = ops::quantize_fp8_weight(w);
      expect_same_fp8(gpu.w, cpu.w, "experts' W " + tag);
      expect_same_fp8(gpu.w_t, cpu.w_t, "experts' W^T " + tag);
      expect_same_fp8(gpu.w_t, ops::transpose_fp8_experts(ops::quantize_fp8_experts(w), shape[0]),
                      "experts' W^T as transpose_fp8_experts " + tag);
    }
  }
}

// The quantizers' codes over every bf16 value: for amax over every bf16 exponent (subnormals
// among them) with three mantissas each, every bf16 value x with |x| <= amax, packed 127 to a
// 1 x 128 tile whose first element is amax (so that the tile's scale is amax / 448); and
// f32 tiles of random values whose magnitudes span 2^-140 .. 2^120 tile by tile. Where a
// kernel's quotient x / scale or its conversion differed from the CPU's at any rounding edge
// (x times a rounded reciprocal does), some code here would differ: the rows quantizer's
// (IEEE division) and quantize_fp8_both_ways' (fp8::ScaleDivisor), both directions.
TEST(BackendFp8, QuantizerCodesMatchTheCpuOverEveryBf16Value) {
  MT_REQUIRE_GPU();
  auto bf16_value = [](uint32_t bits) {
    const uint32_t w = bits << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  };
  std::vector<uint32_t> amaxes;
  for (uint32_t exp = 0; exp < 255; ++exp) {
    for (uint32_t mant : {0x00u, 0x35u, 0x7fu}) {
      if (exp > 0 || mant > 0) amaxes.push_back(exp << 7 | mant);
    }
  }
  int64_t checked = 0;
  for (size_t first = 0; first < amaxes.size(); first += 64) {
    std::vector<float> v;
    for (size_t i = first; i < std::min(amaxes.size(), first + 64); ++i) {
      const uint32_t a = amaxes[i];
      int64_t in_tile = 0;
      for (uint32_t bits = 0; bits <= a; ++bits) {
        for (uint32_t sign : {0u, 0x8000u}) {
          if (in_tile == 0) v.push_back(bf16_value(a));
          v.push_back(bf16_value(bits | sign));
          in_tile = (in_tile + 1) % 127;
        }
      }
      while (in_tile != 0) v.push_back(0.f), in_tile = (in_tile + 1) % 127;
    }
    while (v.size() % (16 * 128) != 0) v.push_back(0.f);  // rows a multiple of 16: the both-ways kernel
    const int64_t rows = static_cast<int64_t>(v.size()) / 128;
    const Tensor x = Tensor::from_vector(v, {rows, 128});
    const std::string tag = fmt::format("bf16 amax from {:#06x}", amaxes[first]);
    const ops::Fp8Tensor want = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
    const Tensor xg = on_gpu(x, DType::BF16);
    expect_same_fp8(ops::quantize_fp8(xg, ops::Fp8Blocks::kRows), want, tag);
    const ops::Fp8BothWays ways = ops::quantize_fp8_both_ways(xg);  // its quotients by ScaleDivisor
    expect_same_fp8(ways.rows, want, "both ways, rows, " + tag);
    expect_same_fp8(ways.tokens, ops::quantize_fp8_transposed(x), "both ways, tokens, " + tag);
    checked += static_cast<int64_t>(v.size());
  }
  EXPECT_GT(checked, 20'000'000);
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_int_distribution<int> exponent(-140, 120);
  const int64_t rows = 1 << 14;
  std::vector<float> v(static_cast<size_t>(rows * 128));
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::ldexp(1.f, exponent(rng));
    for (int64_t c = 0; c < 128; ++c) v[static_cast<size_t>(r * 128 + c)] = unit(rng) * mag;
  }
  const Tensor x = Tensor::from_vector(v, {rows, 128});
  const ops::Fp8Tensor want = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
  expect_same_fp8(ops::quantize_fp8(x.to(kGpu), ops::Fp8Blocks::kRows), want, "f32 tiles of spread magnitudes");
  const ops::Fp8BothWays ways = ops::quantize_fp8_both_ways(x.to(kGpu));
  expect_same_fp8(ways.rows, want, "both ways, rows, f32 tiles of spread magnitudes");
  expect_same_fp8(ways.tokens, ops::quantize_fp8_transposed(x), "both ways, tokens, f32 tiles of spread magnitudes");
}

// RMSNorm with its output quantized in the same pass: y as the plain kernel makes it, and its
// codes and scales bit for bit what the quantizer makes of that y. Widths for each row shape
// (16 threads a row at 256, 32 at 384 and 768, where a warp's second half idles in the last
// pass at 384, 128 at 2048, 256 at 5120); rows not a multiple of a block's.
TEST(BackendFp8, RmsNormQuantizesItsOutputAsTheQuantizer) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const int64_t D : {256, 384, 768, 2048, 5120}) {
    const int64_t R = 301;
    const std::string tag = fmt::format("rmsnorm_forward_fp8 [{} x {}]", R, D);
    const Tensor x = on_gpu(random_bf16_values({R, D}, 97 + D, 2.0), DType::BF16);
    const Tensor w = on_gpu(random_bf16_values({D}, 98 + D, 1.0), DType::BF16);
    const ops::RmsNormOut got = ops::rmsnorm_forward_fp8(x, w, 1e-6);
    const ops::RmsNormOut plain = ops::rmsnorm_forward(x, w, 1e-6);
    const Tensor y = got.y.to(Device::cpu());
    ASSERT_EQ(y.shape(), (Shape{R, D})) << tag;
    EXPECT_EQ(0, std::memcmp(y.raw(), plain.y.to(Device::cpu()).raw(), y.nbytes())) << tag << ": y";
    EXPECT_EQ(got.rstd.to(Device::cpu()).to_vector<float>(), plain.rstd.to(Device::cpu()).to_vector<float>()) << tag;
    expect_same_fp8(got.y_q, ops::quantize_fp8(y, ops::Fp8Blocks::kRows), tag);
  }
}

// The packed rows of an FP8 dispatch: packing on the GPU gives the CPU's bytes, and unpacking
// the CPU's bytes on the GPU gives its codes, scales and values (bf16 and f32) bit for bit.
// Widths for each piece the kernels move: a partial tile (bytes), 384 (4 bytes: 3 scales a
// row), 768 (8), 2048 and 7168 (16); and no rows, and no columns.
// The combine's backward with quantize_rows: the rows' gradient's codes made in its kernel
// (bf16, H % 128 == 0; H = 384 leaves a half-warp past the row in its last pass) or, where
// it cannot (H = 20), by the quantizer after it: either way the bits the CPU's quantizer
// makes of the gradient it wrote, which is the same as without quantize_rows.
TEST(BackendFp8, CombineBackwardQuantizesItsRowsAsTheQuantizer) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, K, H;
  };
  for (Case c : {Case{512, 8, 2048}, Case{96, 4, 384}, Case{37, 3, 20}}) {
    const std::string tag = "T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " H=" + std::to_string(c.H);
    const Tensor eo = on_gpu(random_bf16_values({c.T * c.K, c.H}, 5 + c.H), DType::BF16);
    const Tensor w = testing::random_tensor({c.T, c.K}, DType::F32, 6 + c.T).to(kGpu);
    const Tensor dy = on_gpu(random_bf16_values({c.T, c.H}, 7 + c.K), DType::BF16);
    std::vector<int32_t> order(static_cast<size_t>(c.T * c.K));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>((i * 7 + 3) % order.size());
    const Tensor ord = Tensor::from_vector(order, {c.T * c.K}).to(kGpu);
    for (const Tensor& o : {Tensor(), ord}) {
      const std::string what = tag + (o.defined() ? " order" : "");
      PoisonScope poison;
      const ops::CombineGrads plain = ops::combine_backward(dy, eo, w, o);
      const ops::CombineGrads g = ops::combine_backward(dy, eo, w, o, /*quantize_rows=*/true);
      ASSERT_TRUE(g.dexpert_out_q.q.defined()) << what;
      const Tensor d = g.dexpert_out.to(Device::cpu());
      EXPECT_EQ(std::memcmp(d.raw(), plain.dexpert_out.to(Device::cpu()).raw(), static_cast<size_t>(d.numel()) * 2), 0)
          << what << ": the gradient changed";
      expect_same_fp8(g.dexpert_out_q, ops::quantize_fp8(d, ops::Fp8Blocks::kRows), what);
    }
  }
}

TEST(BackendFp8, PackedRowsMatchTheCpu) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const auto& [R, C] : std::vector<std::pair<int64_t, int64_t>>{
           {517, 300}, {517, 384}, {517, 768}, {517, 2048}, {517, 7168}, {0, 2048}, {5, 0}}) {
    const ops::Fp8Tensor x = ops::quantize_fp8(random_bf16_values({R, C}, 94 + C, 3.0), ops::Fp8Blocks::kRows);
    const Tensor packed = ops::pack_fp8_rows(x);
    const ops::Fp8Tensor xg{x.q.to(kGpu), x.scale.to(kGpu), ops::Fp8Blocks::kRows};
    const Tensor got = ops::pack_fp8_rows(xg).to(Device::cpu());
    ASSERT_EQ(got.shape(), packed.shape());
    EXPECT_EQ(0, std::memcmp(got.raw(), packed.raw(), packed.nbytes())) << "pack_fp8_rows [" << R << " x " << C << "]";
    for (DType dt : {DType::BF16, DType::F32}) {
      const std::string tag = fmt::format("unpack_fp8_rows [{} x {}, {}]", R, C, dtype_name(dt));
      const ops::UnpackedFp8Rows u = ops::unpack_fp8_rows(packed.to(kGpu), C, dt);
      const ops::UnpackedFp8Rows want = ops::unpack_fp8_rows(packed, C, dt);
      expect_same_fp8(u.q, want.q, tag);
      ASSERT_EQ(u.values.dtype(), dt) << tag;
      EXPECT_EQ(backend_error(u.values.to(Device::cpu()), want.values), 0.0) << tag;
    }
  }
}

TEST(BackendFp8, LinearMatchesTheCpuAndTheDequantizedProduct) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t M, N, K;
  };
  for (Case c : {Case{256, 384, 512}, Case{72, 136, 272}, Case{8192, 2048, 2048}}) {
    const Tensor x = random_bf16_values({c.M, c.K}, c.M + c.K, 1.0);
    const Tensor w = random_bf16_values({c.N, c.K}, c.N + 3 * c.K, 0.02);
    const ops::Fp8Tensor a = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
    const ops::Fp8Tensor ag = ops::quantize_fp8(on_gpu(x, DType::BF16), ops::Fp8Blocks::kRows);
    for (const ops::Fp8Blocks wmode : {ops::Fp8Blocks::kBlocks, ops::Fp8Blocks::kRows}) {
      const ops::Fp8Tensor b = ops::quantize_fp8(w, wmode);
      const ops::Fp8Tensor bg = ops::quantize_fp8(on_gpu(w, DType::BF16), wmode);
      const std::string tag = fmt::format("linear_fp8[M={},N={},K={},w {}]", c.M, c.N, c.K,
                                          wmode == ops::Fp8Blocks::kBlocks ? "128x128" : "1x128");
      const Tensor ref = ops::linear_forward(ops::dequantize_fp8(a, DType::F64), ops::dequantize_fp8(b, DType::F64));
      const Tensor got32 = ops::linear_fp8(ag, bg, DType::F32).to(Device::cpu());
      testing::expect_backend_close(got32, ref, 5e-4, tag, "y f32 vs dequantized product");
      if (c.M * c.N * c.K <= (1 << 26)) {
        testing::expect_backend_close(got32, ops::linear_fp8(a, b, DType::F32), 5e-4, tag, "y f32 vs cpu");
      }
      const Tensor got16 = ops::linear_fp8(ag, bg, DType::BF16).to(Device::cpu());
      testing::expect_backend_close(got16, ref, testing::kBf16Tol, tag, "y bf16 vs dequantized product");
      // Added into an f32 output (the weight gradient's accumulation, in the epilogue).
      const Tensor start = testing::random_tensor({c.M, c.N}, DType::F32, 77, 0.5);
      Tensor acc = start.to(kGpu);
      ops::linear_fp8_into(ag, bg, acc, /*accumulate=*/true);
      Tensor want = start.clone();
      ops::add_(want, got32);
      testing::expect_backend_close(acc.to(Device::cpu()), want, 1e-6, tag, "y += f32");
    }
  }
  const ops::Fp8Tensor a = ops::quantize_fp8(on_gpu(random_bf16_values({6, 128}, 1), DType::BF16), ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor w = ops::quantize_fp8(on_gpu(random_bf16_values({8, 128}, 2), DType::BF16), ops::Fp8Blocks::kBlocks);
  try {
    ops::linear_fp8(a, w, DType::F32);
    ADD_FAILURE() << "M = 6 is not a multiple of 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 4"), std::string::npos) << e.what();
  }
}

// The tokens' codes gathered into the experts' rows (the dispatch's rows_q) on the GPU: the
// CPU's bits, for a whole permutation and a partial one (rows of other experts dropped).
TEST(BackendFp8, PermutedTokenCodesMatchTheCpu) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  const int64_t T = 1000, E = 16, K = 4, H = 384;
  const Tensor idx = ops::router_forward(testing::random_tensor({T, E}, DType::F32, 92), K, false).topk_idx;
  const Tensor x = random_bf16_values({T, H}, 93, 2.0);
  ops::Permutation part = ops::permutation_by_expert(ops::expert_ids_in_range(idx, 4, 8), 9);
  part.rows = T * K - part.expert_counts.to_vector<int64_t>()[8];
  for (const ops::Permutation& p : {ops::permutation_by_expert(idx, E), part}) {
    const ops::Fp8Tensor cpu = ops::permute_forward_fp8(ops::quantize_fp8(x, ops::Fp8Blocks::kRows), p);
    ops::Permutation pg = p;
    for (Tensor* t : {&pg.expert_counts, &pg.source_token, &pg.slot_row}) *t = t->to(kGpu);
    const ops::Fp8Tensor xq = ops::quantize_fp8(on_gpu(x, DType::BF16), ops::Fp8Blocks::kRows);
    expect_same_fp8(ops::permute_forward_fp8(xq, pg), cpu, fmt::format("permute_forward_fp8 [{} rows]", p.permuted_rows()));
    for (DType dt : {DType::BF16, DType::F32}) {
      const std::string tag = fmt::format("permute_forward_fp8_values [{} rows, {}]", p.permuted_rows(), dtype_name(dt));
      const ops::UnpackedFp8Rows v = ops::permute_forward_fp8_values(xq, pg, dt);
      expect_same_fp8(v.q, cpu, tag);
      EXPECT_EQ(backend_error(v.values.to(Device::cpu()), ops::dequantize_fp8(cpu, dt)), 0.0) << tag;
    }
  }
}

// The experts' FP8 GEMMs' shapes: ragged counts (an empty expert, one row, rows not a multiple
// of 128), a width whose second column half of a tile lies past the weight (384), the bench's.
struct ExpertCase {
  std::vector<int64_t> counts;
  int64_t H, I;
  int64_t experts() const { return static_cast<int64_t>(counts.size()); }
  int64_t rows() const {
    int64_t n = 0;
    for (int64_t c : counts) n += c;
    return n;
  }
};
std::vector<ExpertCase> expert_cases() {
  std::vector<int64_t> big(128);
  for (int64_t e = 0; e < 128; ++e) big[e] = e % 9 == 4 ? 0 : 20 + (e * 37) % 100;
  return {{{130, 0, 257, 1}, 256, 256}, {{64, 300, 0, 77, 129}, 384, 384}, {big, 2048, 768}};
}

// The experts' FP8 forward (the wgmma kernels with the promotion every 128 of K) against the
// f32 products of its dequantized operands: gate and up from x and the gate/up weights, y from
// the GPU's own act quantized as the kernel quantizes it (bf16 act -> the same codes on both
// backends). Ragged counts (an empty expert, one row, rows not a multiple of 128), a width
// whose down tile's second half lies past the weight (H = 384), and the bench's shape. Outputs
// are bf16 (~1.1e-3 relative rounding); a scale on the wrong row or block errs by O(1).
TEST(BackendFp8, GroupedSwigluForwardMatchesTheDequantizedProducts) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const ExpertCase& c : expert_cases()) {
    const int64_t E = c.experts(), H = c.H, I = c.I, N = c.rows();
    const std::string tag = fmt::format("grouped_swiglu_forward_fp8[E={},N={},H={},I={}]", E, N, H, I);
    const Tensor x = random_bf16_values({N, H}, N + H, 1.0);
    const Tensor wg = random_bf16_values({E, I, H}, 11 + E, 0.05), wu = random_bf16_values({E, I, H}, 12 + E, 0.05);
    const Tensor wd = random_bf16_values({E, H, I}, 13 + E, 0.05);
    const Tensor counts = Tensor::from_vector(c.counts, {E});
    const ops::Fp8Tensor xq = ops::quantize_fp8(x, ops::Fp8Blocks::kRows);
    const ops::Fp8Tensor gq = ops::quantize_fp8_experts(wg), uq = ops::quantize_fp8_experts(wu);
    const ops::Fp8Tensor dq = ops::quantize_fp8_experts(wd);
    const ops::SwigluOut got = ops::grouped_swiglu_forward_fp8(
        ops::quantize_fp8(on_gpu(x, DType::BF16), ops::Fp8Blocks::kRows), counts.to(kGpu),
        ops::quantize_fp8_experts(on_gpu(wg, DType::BF16)), ops::quantize_fp8_experts(on_gpu(wu, DType::BF16)),
        ops::quantize_fp8_experts(on_gpu(wd, DType::BF16)), E);
    const ops::SwigluOut ref = ops::grouped_swiglu_forward_fp8(xq, counts, gq, uq, dq, E);  // the CPU's
    testing::expect_backend_close(got.gate.to(Device::cpu()), ref.gate, 3e-3, tag, "gate");
    testing::expect_backend_close(got.up.to(Device::cpu()), ref.up, 3e-3, tag, "up");
    testing::expect_backend_close(got.act.to(Device::cpu()), ref.act, 3e-3, tag, "act");
    // act's codes, made in the gate/up kernel's epilogue: the bits the quantizer makes of the
    // GPU's bf16 act (every row, those of tiles that cross an expert's end included).
    const ops::Fp8Tensor act_q = ops::quantize_fp8(got.act.to(Device::cpu()), ops::Fp8Blocks::kRows);
    expect_same_fp8(got.act_q, act_q, tag + " act");
    // y from the GPU's act, quantized per 1 x 128 tile, times each expert's dequantized Wd.
    const Tensor act = ops::dequantize_fp8(act_q, DType::F64);
    const Tensor wdd = ops::dequantize_fp8(dq, DType::F64).view({E, H, I});
    Tensor y_ref = Tensor::zeros({N, H}, DType::F64);
    int64_t r0 = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r1 = r0 + c.counts[e];
      if (r1 > r0) y_ref.slice(r0, r1).copy_from(ops::linear_forward(act.slice(r0, r1), wdd.select(e)));
      r0 = r1;
    }
    testing::expect_backend_close(got.y.to(Device::cpu()), y_ref, 3e-3, tag, "y");
  }
}

// The experts' FP8 input gradient on the GPU (da with the dSwiGLU epilogue, dgate and dup
// quantized, dx over K = 2I from two sources): each expert's W^T blocks bitwise the CPU's;
// dgate and dup against the CPU reference (f32 products of the same dequantized operands);
// dx against the f64 products of the GPU's own dgate and dup quantized as the kernels
// quantize them. Shapes as the forward's test, I = 384 putting the second half of da's last
// column tile past the weight.
TEST(BackendFp8, GroupedSwigluBackwardInputMatchesTheDequantizedProducts) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const ExpertCase& c : expert_cases()) {
    const int64_t E = c.experts(), H = c.H, I = c.I, N = c.rows();
    const std::string tag = fmt::format("grouped_swiglu_backward_input_fp8[E={},N={},H={},I={}]", E, N, H, I);
    const Tensor dy = random_bf16_values({N, H}, N + H + 1, 1.0);
    const Tensor gate = random_bf16_values({N, I}, N + 2, 1.0), up = random_bf16_values({N, I}, N + 3, 1.0);
    const Tensor wg = random_bf16_values({E, I, H}, 21 + E, 0.05), wu = random_bf16_values({E, I, H}, 22 + E, 0.05);
    const Tensor wd = random_bf16_values({E, H, I}, 23 + E, 0.05);
    const Tensor counts = Tensor::from_vector(c.counts, {E});
    auto t_cpu = [&](const Tensor& w) { return ops::transpose_fp8_experts(ops::quantize_fp8_experts(w), E); };
    auto t_gpu = [&](const Tensor& w) {
      return ops::transpose_fp8_experts(ops::quantize_fp8_experts(on_gpu(w, DType::BF16)), E);
    };
    const ops::Fp8Tensor gt = t_cpu(wg), ut = t_cpu(wu), dt = t_cpu(wd);
    const ops::Fp8Tensor ggt = t_gpu(wg), gut = t_gpu(wu), gdt = t_gpu(wd);
    expect_same_fp8(ggt, gt, tag + " w_gate_t");
    expect_same_fp8(gut, ut, tag + " w_up_t");
    expect_same_fp8(gdt, dt, tag + " w_down_t");
    const ops::SwigluInputGrads got = ops::grouped_swiglu_backward_input_fp8(
        ops::quantize_fp8(on_gpu(dy, DType::BF16), ops::Fp8Blocks::kRows), counts.to(kGpu),
        on_gpu(gate, DType::BF16), on_gpu(up, DType::BF16), ggt, gut, gdt, E);
    const ops::SwigluInputGrads ref = ops::grouped_swiglu_backward_input_fp8(
        ops::quantize_fp8(dy, ops::Fp8Blocks::kRows), counts, gate, up, gt, ut, dt, E);
    testing::expect_backend_close(got.dgate.to(Device::cpu()), ref.dgate, 3e-3, tag, "dgate");
    testing::expect_backend_close(got.dup.to(Device::cpu()), ref.dup, 3e-3, tag, "dup");
    // dx from the GPU's dgate and dup quantized per 1 x 128 tile, times each expert's W^T^T.
    const Tensor qg = ops::dequantize_fp8(ops::quantize_fp8(got.dgate.to(Device::cpu()), ops::Fp8Blocks::kRows),
                                          DType::F64);
    const Tensor qu = ops::dequantize_fp8(ops::quantize_fp8(got.dup.to(Device::cpu()), ops::Fp8Blocks::kRows),
                                          DType::F64);
    const Tensor gtd = ops::dequantize_fp8(gt, DType::F64).view({E, H, I});
    const Tensor utd = ops::dequantize_fp8(ut, DType::F64).view({E, H, I});
    Tensor dx = Tensor::zeros({N, H}, DType::F64);
    int64_t r0 = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r1 = r0 + c.counts[e];
      if (r1 > r0) {
        Tensor part = ops::linear_forward(qg.slice(r0, r1), gtd.select(e));
        ops::add_(part, ops::linear_forward(qu.slice(r0, r1), utd.select(e)));
        dx.slice(r0, r1).copy_from(part);
      }
      r0 = r1;
    }
    testing::expect_backend_close(got.dx.to(Device::cpu()), dx, 3e-3, tag, "dx");
  }
}

// The experts' weight-gradient operands (quantize_fp8_expert_columns) bit for bit, padding
// tiles included (poisoned memory: every byte must be written), and the FP8 weight-gradient
// GEMM (the wgmma kernel, promoted every 128 of K with a scale per row of each operand)
// against the CPU's f32 product of the same dequantized operands, written and accumulated:
// the three products of the experts' backward at each case's shape (dW_down = dy^T act,
// dW_gate = dgate^T x), the bench's among them. The bound as the GEMM's above.
TEST(BackendFp8, ExpertWeightGradientMatchesTheCpu) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  {  // the quantizer's element-wise loads: f32, and bf16 rows of a width not a multiple of 8
    const std::vector<int64_t> c{3, 0, 140};
    const Tensor counts = Tensor::from_vector(c, {3});
    for (const auto& [C, dt] : {std::pair{int64_t{200}, DType::F32}, std::pair{int64_t{100}, DType::BF16}}) {
      const Tensor x = random_bf16_values({143, C}, C + 1, 2.0);
      expect_same_fp8(ops::quantize_fp8_expert_columns(on_gpu(x, dt), counts.to(kGpu)),
                      ops::quantize_fp8_expert_columns(x, counts), fmt::format("columns of {} ({})", C, dtype_name(dt)));
    }
  }
  for (const ExpertCase& c : expert_cases()) {
    const int64_t E = c.experts(), H = c.H, I = c.I, N = c.rows();
    const std::string tag = fmt::format("[E={},N={},H={},I={}]", E, N, H, I);
    const Tensor counts = Tensor::from_vector(c.counts, {E});
    const Tensor gcounts = counts.to(kGpu);
    const Tensor dy = random_bf16_values({N, H}, N + 5, 1.0), act = random_bf16_values({N, I}, N + 6, 1.0);
    auto quantized = [&](const Tensor& v, const std::string& what) {
      const ops::Fp8Tensor cpu = ops::quantize_fp8_expert_columns(v, counts);
      const ops::Fp8Tensor gpu = ops::quantize_fp8_expert_columns(on_gpu(v, DType::BF16), gcounts);
      expect_same_fp8(gpu, cpu, tag + " " + what);
      return std::pair{gpu, cpu};
    };
    const auto [dyg, dyc] = quantized(dy, "dy^T");
    const auto [actg, actc] = quantized(act, "act^T");
    for (const bool accumulate : {false, true}) {
      const std::string what = tag + (accumulate ? " dW_down += dy^T act" : " dW_down = dy^T act");
      const Tensor start = random_bf16_values({E, H, I}, 77, 1.0).to(DType::F32);
      Tensor want = start.clone();
      ops::grouped_wgrad_fp8(dyc, actc, counts, want, accumulate);
      Tensor got = accumulate ? on_gpu(start, DType::F32) : Tensor::empty({E, H, I}, DType::F32, kGpu);
      ops::grouped_wgrad_fp8(dyg, actg, gcounts, got, accumulate);
      testing::expect_backend_close(got.to(Device::cpu()), want, 5e-4, what, "dW");
    }
    // the other shape: [I, H] from operands of I and H columns
    const Tensor dg = random_bf16_values({N, I}, N + 7, 1.0), x = random_bf16_values({N, H}, N + 8, 1.0);
    const auto [dgg, dgc] = quantized(dg, "dgate^T");
    const auto [xg, xc] = quantized(x, "x^T");
    Tensor want = Tensor::zeros({E, I, H}, DType::F32);
    ops::grouped_wgrad_fp8(dgc, xc, counts, want, false);
    Tensor got = Tensor::empty({E, I, H}, DType::F32, kGpu);
    ops::grouped_wgrad_fp8(dgg, xg, gcounts, got, false);
    testing::expect_backend_close(got.to(Device::cpu()), want, 5e-4, tag + " dW_gate = dgate^T x", "dW");
  }
  // five micro-batches of other counts in one call (two launches: four sources, then one added)
  const int64_t E = 6, H = 256, I = 384;
  std::vector<ops::Fp8WgradOperands> cpu_src, gpu_src;
  for (int i = 0; i < 5; ++i) {
    std::vector<int64_t> c(E);
    int64_t N = 0;
    for (int64_t e = 0; e < E; ++e) N += (c[e] = (e * 53 + i * 97) % 230 * ((e + i) % 4 != 0));
    const Tensor counts = Tensor::from_vector(c, {E}), gcounts = counts.to(kGpu);
    const Tensor dy = random_bf16_values({N, H}, 900 + i, 1.0), act = random_bf16_values({N, I}, 950 + i, 1.0);
    cpu_src.push_back({ops::quantize_fp8_expert_columns(dy, counts), ops::quantize_fp8_expert_columns(act, counts),
                       counts});
    gpu_src.push_back({ops::quantize_fp8_expert_columns(on_gpu(dy, DType::BF16), gcounts),
                       ops::quantize_fp8_expert_columns(on_gpu(act, DType::BF16), gcounts), gcounts});
  }
  for (const bool accumulate : {false, true}) {
    const Tensor start = random_bf16_values({E, H, I}, 78, 1.0).to(DType::F32);
    Tensor want = start.clone();
    ops::grouped_wgrad_fp8(cpu_src, want, accumulate);
    Tensor got = on_gpu(start, DType::F32);
    ops::grouped_wgrad_fp8(gpu_src, got, accumulate);
    testing::expect_backend_close(got.to(Device::cpu()), want, 5e-4,
                                  accumulate ? "five sources, added" : "five sources, written", "dW");
  }
}

}  // namespace
}  // namespace moetrain
