// CPU-vs-CUDA comparison of the dense and auxiliary ops: embedding, RMSNorm, RoPE,
// cross-entropy, the element-wise helpers, AdamW, load balancing and the router z-loss.
//
// Each case draws fresh inputs rounded to bf16 (random_bf16_values), so both backends see
// identical values; runs the CPU reference on f32 copies and the CUDA op on device tensors
// in the contract's mixed precision (ops.h: bf16 activations and weights, f32 statistics,
// weight gradients, router probabilities and loss sums), with every new device buffer
// poisoned with NaN; and compares with expect_backend_close (prints "BACKEND op output
// rel_err"). Accumulating outputs start from the same random values on both sides. The
// reductions are also run twice and must agree bitwise. Without a GPU every test skips.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend_compare.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::backend_error;
using testing::bytes_equal;
using testing::expect_backend_close;
using testing::kBf16Tol;
using testing::kF32Tol;
using testing::on_gpu;
using testing::PoisonScope;
using testing::random_bf16_values;
using testing::random_ints;
using testing::random_tensor;

const Device kGpu = Device::cuda(0);

std::string tag(const std::string& op, const Shape& s) { return op + shape_str(s); }

// Same dtype, shape and bytes (device tensors are copied to the host first).
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts = {}) {
  try {
    f();
    ADD_FAILURE() << "expected moetrain::Error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// A host f32 tensor's values with every element replaced by |x|.
Tensor abs_of(const Tensor& t) {
  Tensor o = t.clone();
  float* p = o.data<float>();
  for (int64_t i = 0; i < o.numel(); ++i) p[i] = std::fabs(p[i]);
  return o;
}

// ---- embedding ----------------------------------------------------------------------

TEST(BackendDense, EmbeddingForward) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, V, H;
  };
  // H = 45: rows not a multiple of 16 bytes (element copy); the others copy 16-byte units.
  for (Case c : {Case{37, 101, 45}, Case{5, 7, 8}, Case{512, 8192, 2048}}) {
    Tensor ids = random_ints({c.T}, 0, static_cast<int32_t>(c.V), c.T + c.V);
    Tensor w = random_bf16_values({c.V, c.H}, c.H);
    Tensor ref = ops::embedding_forward(ids, w);
    Tensor got = ops::embedding_forward(ids.to(kGpu), on_gpu(w, DType::BF16));
    EXPECT_EQ(got.dtype(), DType::BF16);
    expect_backend_close(got, ref, kBf16Tol, tag("embedding_forward", {c.T, c.V, c.H}), "y");
    EXPECT_EQ(backend_error(got, ref), 0.0) << "a row copy is exact";
    // An f32 weight (master copy) works too and gives f32 rows.
    Tensor got32 = ops::embedding_forward(ids.to(kGpu), on_gpu(w, DType::F32));
    EXPECT_EQ(got32.dtype(), DType::F32);
    EXPECT_EQ(backend_error(got32, ref), 0.0);
  }
}

// Multi-token prediction's shifted ids, with and without packed documents: exact.
TEST(BackendDense, ShiftTokens) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (int64_t k : {0, 1, 3, 40}) {
    const int64_t B = 3, S = 37;
    Tensor ids = random_ints({B * S}, 0, 1000, 5 + k);
    Tensor seg = random_ints({B * S}, 0, 3, 6 + k);  // sorted per row below: documents
    int32_t* s = seg.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) std::sort(s + b * S, s + (b + 1) * S);
    for (const Tensor& segments : {Tensor(), seg}) {
      Tensor ref = ops::shift_tokens(ids, segments, B, k, -100);
      Tensor got = ops::shift_tokens(ids.to(kGpu), segments.defined() ? segments.to(kGpu) : Tensor(), B, k, -100);
      EXPECT_EQ(got.to(Device::cpu()).to_vector<int32_t>(), ref.to_vector<int32_t>())
          << "k = " << k << (segments.defined() ? " with segments" : "");
    }
  }
}

TEST(BackendDense, EmbeddingForwardBadIdGivesNaNRow) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  // No host check on CUDA (it would wait for the device): a bad id's row is NaN.
  Tensor ids = Tensor::from_vector(std::vector<int32_t>{0, 4, 1, -1}, {4});
  Tensor w = random_bf16_values({4, 16}, 3);
  Tensor y = ops::embedding_forward(ids.to(kGpu), on_gpu(w, DType::BF16)).to(DType::F32).to(Device::cpu());
  const float* p = y.data<float>();
  for (int64_t h = 0; h < 16; ++h) {
    EXPECT_EQ(p[h], w.data<float>()[h]);
    EXPECT_TRUE(std::isnan(p[16 + h]));
    EXPECT_EQ(p[32 + h], w.data<float>()[16 + h]);
    EXPECT_TRUE(std::isnan(p[48 + h]));
  }
}

TEST(BackendDense, EmbeddingBackwardWeight) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, V, H;
    int32_t id_range;  // ids drawn from [0, id_range): small ranges make long runs
  };
  // {1000, 3, 20}: runs of ~333 tokens, longer than the kernel's 128-token staging chunk;
  // H = 20 and 45 take the one-column path on bf16 (H % 4 != 0 for 45), the others four.
  for (Case c : {Case{37, 11, 45, 11}, Case{1000, 3, 20, 3}, Case{300, 50, 64, 50}, Case{512, 32768, 2048, 600}}) {
    Tensor ids = random_ints({c.T}, 0, c.id_range, 100 + c.T);
    int32_t* id = ids.data<int32_t>();
    for (int64_t t = 0; t < c.T; t += 3) id[t] = 1;  // one frequent token: a run of T/3
    Tensor dy = random_bf16_values({c.T, c.H}, 200 + c.T);
    Tensor init = random_tensor({c.V, c.H}, DType::F32, 300 + c.T);
    Tensor ref = init.clone();
    ops::embedding_backward_weight(ids, dy, ref);
    const std::string op = tag("embedding_backward_weight", {c.T, c.V, c.H});
    Tensor gids = ids.to(kGpu), gdy = on_gpu(dy, DType::BF16);
    Tensor a = init.to(kGpu), b = init.to(kGpu);
    ops::embedding_backward_weight(gids, gdy, a);
    ops::embedding_backward_weight(gids, gdy, b);
    expect_backend_close(a, ref, kF32Tol, op, "dweight");
    EXPECT_TRUE(same_bits(a, b)) << op << ": two runs differ";
    // f32 dy takes the same path with four-float loads.
    Tensor c32 = init.to(kGpu);
    ops::embedding_backward_weight(gids, on_gpu(dy, DType::F32), c32);
    expect_backend_close(c32, ref, kF32Tol, op + "_f32dy", "dweight");
  }
}

// A vocabulary shard's embedding on CUDA against the CPU: zero rows for other shards' ids,
// NaN for an id outside the whole vocabulary, the gradient of the shard's rows only.
TEST(BackendDense, EmbeddingVocabularyShard) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  const int64_t V = 1000, H = 64, T = 300;
  for (int64_t r : {0, 1}) {
    const ops::VocabShard shard{r * V / 2, V};
    Tensor ids = random_ints({T}, 0, static_cast<int32_t>(V), 40 + r);
    Tensor w = random_bf16_values({V / 2, H}, 41 + r);
    Tensor ref = ops::embedding_forward(ids, w, shard);
    Tensor got = ops::embedding_forward(ids.to(kGpu), on_gpu(w, DType::BF16), shard);
    EXPECT_EQ(backend_error(got, ref), 0.0) << "shard " << r;
    Tensor dy = random_bf16_values({T, H}, 42 + r);
    Tensor dref = Tensor::zeros({V / 2, H}, DType::F32);
    ops::embedding_backward_weight(ids, dy, dref, true, shard);
    Tensor dgot = Tensor::zeros({V / 2, H}, DType::F32, kGpu);
    ops::embedding_backward_weight(ids.to(kGpu), on_gpu(dy, DType::BF16), dgot, true, shard);
    expect_backend_close(dgot, dref, kF32Tol, tag("embedding_backward_weight shard", {T, V, H}), "dweight");
  }
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{3, static_cast<int32_t>(V)}, {2});
  Tensor y = ops::embedding_forward(bad.to(kGpu), on_gpu(random_bf16_values({V / 2, H}, 5), DType::BF16), {0, V})
                 .to(DType::F32)
                 .to(Device::cpu());
  EXPECT_FALSE(std::isnan(y.data<float>()[0]));
  EXPECT_TRUE(std::isnan(y.data<float>()[H])) << "an id outside the whole vocabulary";
}

// ---- RMSNorm ------------------------------------------------------------------------

struct NormCase {
  Shape x;    // [T, width]
  int64_t D;  // w's length: width (hidden) or head_dim (per-head q/k norm)
};
// The kernels give a row 16 threads (D <= 256), 32 (D <= 1024), 128 (D <= 4096) or 256,
// with 16-byte loads when D % 8 == 0 and element loads otherwise; the weight gradient
// takes column pairs when D is even, single columns when it is odd.
const NormCase kNormCases[] = {
    {{7, 45}, 45},          // odd D: element path, 16 threads a row
    {{13, 24}, 24},         // D a multiple of 8 below the row's thread count
    {{64, 32 * 128}, 128},  // Qwen3 q-norm: 32 heads of 128, a row per head
    {{21, 1000}, 1000},     // a warp a row
    {{6, 3 * 333}, 333},    // a warp a row, odd per-head width
    {{512, 2048}, 2048},    // hidden 2048: four warps a row
    {{9, 5000}, 5000},      // wide rows: eight warps a row
    {{3, 4099}, 4099},      // wide odd rows
};

TEST(BackendDense, RmsNormForward) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const NormCase& c : kNormCases) {
    Tensor x = random_bf16_values(c.x, 1 + c.D, 2.0);
    Tensor w = random_bf16_values({c.D}, 2 + c.D);
    auto ref = ops::rmsnorm_forward(x, w, 1e-6);
    auto got = ops::rmsnorm_forward(on_gpu(x, DType::BF16), on_gpu(w, DType::BF16), 1e-6);
    EXPECT_EQ(got.y.dtype(), DType::BF16);
    EXPECT_EQ(got.rstd.dtype(), DType::F32);
    const std::string op = fmt::format("rmsnorm_forward{}_D{}", shape_str(c.x), c.D);
    expect_backend_close(got.y, ref.y, kBf16Tol, op, "y");
    expect_backend_close(got.rstd, ref.rstd, kF32Tol, op, "rstd");
  }
}

TEST(BackendDense, RmsNormBackwardInput) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const NormCase& c : kNormCases) {
    Tensor x = random_bf16_values(c.x, 3 + c.D, 2.0);
    Tensor w = random_bf16_values({c.D}, 4 + c.D);
    Tensor dy = random_bf16_values(c.x, 5 + c.D);
    Tensor rstd = ops::rmsnorm_forward(x, w, 1e-6).rstd;  // f32 on both sides
    Tensor ref = ops::rmsnorm_backward_input(dy, x, w, rstd);
    Tensor got = ops::rmsnorm_backward_input(on_gpu(dy, DType::BF16), on_gpu(x, DType::BF16),
                                             on_gpu(w, DType::BF16), on_gpu(rstd, DType::F32));
    expect_backend_close(got, ref, kBf16Tol, fmt::format("rmsnorm_backward_input{}_D{}", shape_str(c.x), c.D), "dx");
    // with a residual gradient added before the rounding
    Tensor res = random_bf16_values(c.x, 6 + c.D);
    Tensor ref_r = ops::rmsnorm_backward_input(dy, x, w, rstd, res);
    Tensor got_r = ops::rmsnorm_backward_input(on_gpu(dy, DType::BF16), on_gpu(x, DType::BF16), on_gpu(w, DType::BF16),
                                               on_gpu(rstd, DType::F32), on_gpu(res, DType::BF16));
    expect_backend_close(got_r, ref_r, kBf16Tol, fmt::format("rmsnorm_backward_input{}_D{}+res", shape_str(c.x), c.D),
                         "dx");
  }
}

TEST(BackendDense, RmsNormBackwardWeight) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (const NormCase& c : kNormCases) {
    Tensor x = random_bf16_values(c.x, 6 + c.D, 2.0);
    Tensor dy = random_bf16_values(c.x, 7 + c.D);
    Tensor rstd = ops::rmsnorm_forward(x, random_bf16_values({c.D}, 8 + c.D), 1e-6).rstd;
    Tensor init = random_tensor({c.D}, DType::F32, 9 + c.D);
    Tensor ref = init.clone();
    ops::rmsnorm_backward_weight(dy, x, rstd, ref);
    Tensor gdy = on_gpu(dy, DType::BF16), gx = on_gpu(x, DType::BF16), grstd = on_gpu(rstd, DType::F32);
    Tensor a = init.to(kGpu), b = init.to(kGpu);
    ops::rmsnorm_backward_weight(gdy, gx, grstd, a);
    ops::rmsnorm_backward_weight(gdy, gx, grstd, b);
    const std::string op = fmt::format("rmsnorm_backward_weight{}_D{}", shape_str(c.x), c.D);
    expect_backend_close(a, ref, kF32Tol, op, "dw");
    EXPECT_TRUE(same_bits(a, b)) << op << ": two runs differ";
  }
}

// ---- RoPE ---------------------------------------------------------------------------

TEST(BackendDense, Rope) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, heads, head_dim;
    double theta;
    int32_t max_pos;
  };
  // head_dim 6 and 12: half not a multiple of 8 (pair by pair); 64 and 128: 16-byte path.
  // The CPU reference forms the angles in double, the CUDA op in f32 as Hugging Face does:
  // at position p the angle's f32 rounding is ~p * 6e-8 rad (5e-4 at 8192), far inside
  // the bf16 tolerance.
  for (Case c : {Case{9, 3, 6, 10000.0, 50}, Case{17, 2, 12, 10000.0, 300}, Case{33, 4, 64, 10000.0, 2048},
                 Case{512, 16, 128, 1000000.0, 8192}}) {
    const Shape s{c.T, c.heads * c.head_dim};
    Tensor x = random_bf16_values(s, 10 + c.T);
    Tensor pos = random_ints({c.T}, 0, c.max_pos, 11 + c.T);
    Tensor gpos = pos.to(kGpu);
    const std::string op = "rope" + shape_str({c.T, c.heads, c.head_dim});
    Tensor ref = ops::rope_forward(x, pos, c.head_dim, c.theta);
    Tensor got = ops::rope_forward(on_gpu(x, DType::BF16), gpos, c.head_dim, c.theta);
    expect_backend_close(got, ref, kBf16Tol, op + "_forward", "y");
    Tensor dy = random_bf16_values(s, 12 + c.T);
    Tensor dref = ops::rope_backward(dy, pos, c.head_dim, c.theta);
    Tensor dgot = ops::rope_backward(on_gpu(dy, DType::BF16), gpos, c.head_dim, c.theta);
    expect_backend_close(dgot, dref, kBf16Tol, op + "_backward", "dx");
  }
}

// DeepSeek-V3's rope: YaRN-like given frequencies and a cos/sin scale, interleaved pairs,
// the rotary dims the last 64 of 192-wide heads (MLA's q) or a head of its own (k_pe).
TEST(BackendDense, RopeSpec) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, heads, head_dim, stride;
    bool interleaved;
  };
  for (Case c : {Case{37, 4, 64, 192, true}, Case{37, 1, 64, 64, true}, Case{20, 3, 16, 24, false},
                 Case{64, 2, 64, 64, false}}) {
    ops::RopeSpec r;
    r.head_dim = c.head_dim;
    r.stride = c.stride;
    r.interleaved = c.interleaved;
    r.scale = 1.21;
    for (int64_t i = 0; i < c.head_dim / 2; ++i) r.inv_freq.push_back(std::pow(10000.0, -2.0 * i / c.head_dim) / (1 + i % 3));
    const Shape s{c.T, c.heads * c.stride};
    Tensor x = random_bf16_values(s, 20 + c.T);
    Tensor pos = random_ints({c.T}, 0, 4096, 21 + c.T);
    Tensor gpos = pos.to(kGpu);
    const std::string op = fmt::format("rope{}_stride{}_{}", shape_str({c.T, c.heads, c.head_dim}), c.stride,
                                       c.interleaved ? "interleaved" : "half");
    expect_backend_close(ops::rope_forward(on_gpu(x, DType::BF16), gpos, r), ops::rope_forward(x, pos, r), kBf16Tol,
                         op + "_forward", "y");
    Tensor dy = random_bf16_values(s, 22 + c.T);
    expect_backend_close(ops::rope_backward(on_gpu(dy, DType::BF16), gpos, r), ops::rope_backward(dy, pos, r),
                         kBf16Tol, op + "_backward", "dx");
  }
}

// MLA's keys and values: the split is exact; the shared key's gradient sums the heads in f32.
TEST(BackendDense, MlaKv) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (auto [T, heads, nope, rope, dv] : {std::array<int64_t, 5>{33, 16, 128, 64, 128}, {5, 3, 16, 8, 24}}) {
    Tensor kv = random_bf16_values({T, heads * (nope + dv)}, 30 + T);
    Tensor kr = random_bf16_values({T, rope}, 31 + T);
    const ops::MlaKv ref = ops::mla_kv_forward(kv, kr, heads, nope, dv);
    const ops::MlaKv got = ops::mla_kv_forward(on_gpu(kv, DType::BF16), on_gpu(kr, DType::BF16), heads, nope, dv);
    const std::string op = fmt::format("mla_kv[T={},heads={},nope={},rope={},dv={}]", T, heads, nope, rope, dv);
    EXPECT_TRUE(same_bits(got.k.to(DType::F32), ref.k)) << op << ": k";
    EXPECT_TRUE(same_bits(got.v.to(DType::F32), ref.v)) << op << ": v";
    Tensor dk = random_bf16_values(ref.k.shape(), 32 + T), dvv = random_bf16_values(ref.v.shape(), 33 + T);
    const ops::MlaKvGrads gref = ops::mla_kv_backward(dk, dvv, heads, nope, dv);
    const ops::MlaKvGrads g = ops::mla_kv_backward(on_gpu(dk, DType::BF16), on_gpu(dvv, DType::BF16), heads, nope, dv);
    EXPECT_TRUE(same_bits(g.dkv.to(DType::F32), gref.dkv)) << op << ": dkv";
    expect_backend_close(g.dk_rot, gref.dk_rot, kBf16Tol, op, "dk_rot");
  }
}

// Per-head norm then RoPE: one pass for head_dim 128 (rows past a block's 16, and 32 heads
// as Qwen3's q), the ops in turn for head_dim 64; against the CPU's ops in turn. dw (f32)
// is held to 1e-4 where the GPU keeps rope_backward(dy) in f32 (the one pass) and the
// positions stay below 512: the angles are f32 on the GPU, double on the CPU, an error of
// ~position * 6e-8 rad (rope's test); elsewhere to bf16's tolerance.
TEST(BackendDense, RmsNormRope) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, heads, head_dim;
    bool one_pass;
    int32_t max_pos;
  };
  // 512 x 32 and 600 x 32 rows: the weight gradient's 1,024 and 1,200 block partials are
  // summed in groups of 512 first (the last group partial in the second).
  for (Case c : {Case{512, 32, 128, true, 8192}, Case{600, 32, 128, true, 512}, Case{300, 8, 128, true, 512},
                 Case{33, 4, 128, true, 512}, Case{5, 1, 128, true, 512}, Case{9, 3, 64, false, 8192}}) {
    const Shape s{c.T, c.heads * c.head_dim};
    Tensor x = random_bf16_values(s, 30 + c.T, 2.0);
    Tensor w = random_bf16_values({c.head_dim}, 31 + c.T);
    Tensor pos = random_ints({c.T}, 0, c.max_pos, 32 + c.T);
    Tensor dy = random_bf16_values(s, 33 + c.T);
    const double eps = 1e-6, theta = 1e6;
    const std::string op = "rmsnorm_rope" + shape_str({c.T, c.heads, c.head_dim});
    auto ref = ops::rmsnorm_rope_forward(x, w, eps, pos, c.head_dim, theta);
    Tensor gx = on_gpu(x, DType::BF16), gw = on_gpu(w, DType::BF16), gpos = pos.to(kGpu);
    auto got = ops::rmsnorm_rope_forward(gx, gw, eps, gpos, c.head_dim, theta);
    expect_backend_close(got.y, ref.y, kBf16Tol, op + "_forward", "y");
    expect_backend_close(got.rstd, ref.rstd, kF32Tol, op + "_forward", "rstd");
    auto dref = ops::rmsnorm_rope_backward(dy, x, w, ref.rstd, pos, c.head_dim, theta);
    Tensor grstd = on_gpu(ref.rstd, DType::F32), gdy = on_gpu(dy, DType::BF16);
    auto dgot = ops::rmsnorm_rope_backward(gdy, gx, gw, grstd, gpos, c.head_dim, theta);
    expect_backend_close(dgot.dx, dref.dx, kBf16Tol, op + "_backward", "dx");
    expect_backend_close(dgot.dw, dref.dw, c.one_pass && c.max_pos <= 512 ? 1e-4 : kBf16Tol, op + "_backward",
                         "dw");
    auto again = ops::rmsnorm_rope_backward(gdy, gx, gw, grstd, gpos, c.head_dim, theta);
    EXPECT_TRUE(same_bits(again.dw, dgot.dw) && same_bits(again.dx, dgot.dx)) << op << ": two runs differ";
    // dy in f32 (as the one-pass attention backward leaves dQ): the same bf16 values, so the
    // same results bit for bit.
    auto d32 = ops::rmsnorm_rope_backward(on_gpu(dy, DType::F32), gx, gw, grstd, gpos, c.head_dim, theta);
    EXPECT_TRUE(same_bits(d32.dw, dgot.dw) && same_bits(d32.dx, dgot.dx)) << op << ": f32 dy differs";
  }
}

// ---- cross-entropy ------------------------------------------------------------------

TEST(BackendDense, CrossEntropy) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t T, V;
  };
  // V = 1001: element path; 32768 and 151936 (Qwen vocabulary): 16-byte path.
  for (Case c : {Case{7, 1001}, Case{3, 8}, Case{512, 32768}, Case{4, 151936}}) {
    Tensor logits = random_bf16_values({c.T, c.V}, 20 + c.T, 2.0);
    Tensor targets = random_ints({c.T}, 0, static_cast<int32_t>(c.V), 21 + c.T);
    int64_t valid = c.T;
    for (int64_t t = 1; t < c.T; t += 4) {
      targets.data<int32_t>()[t] = ops::kIgnoreIndex;
      --valid;
    }
    const std::string op = tag("cross_entropy", {c.T, c.V});
    auto ref = ops::cross_entropy_forward(logits, targets);
    Tensor glogits = on_gpu(logits, DType::BF16), gtargets = targets.to(kGpu);
    auto a = ops::cross_entropy_forward(glogits, gtargets);
    auto b = ops::cross_entropy_forward(glogits, gtargets);
    expect_backend_close(a.loss_sum, ref.loss_sum, kF32Tol, op + "_forward", "loss_sum");
    expect_backend_close(a.lse, ref.lse, kF32Tol, op + "_forward", "lse");
    EXPECT_TRUE(same_bits(a.loss_sum, b.loss_sum) && same_bits(a.lse, b.lse)) << op << ": two runs differ";
    const double scale = 1.0 / static_cast<double>(valid);
    Tensor dref = ops::cross_entropy_backward(logits, targets, ref.lse, scale);
    Tensor dgot = ops::cross_entropy_backward(glogits, gtargets, on_gpu(ref.lse, DType::F32), scale);
    EXPECT_EQ(dgot.dtype(), DType::BF16);
    expect_backend_close(dgot, dref, kBf16Tol, op + "_backward", "dlogits");
    // Both in one pass, over the logits: against the CPU, and bit for bit the two kernels
    // (with the GPU's own lse), whether the row fits the fused kernel (V <= 32768) or not.
    Tensor fused = glogits.clone();
    auto f = ops::cross_entropy_forward_backward_(fused, gtargets, scale);
    expect_backend_close(f.loss_sum, ref.loss_sum, kF32Tol, op + "_forward_backward_", "loss_sum");
    expect_backend_close(f.lse, ref.lse, kF32Tol, op + "_forward_backward_", "lse");
    expect_backend_close(fused, dref, kBf16Tol, op + "_forward_backward_", "dlogits");
    Tensor two = ops::cross_entropy_backward(glogits, gtargets, a.lse, scale);
    EXPECT_TRUE(same_bits(f.loss_sum, a.loss_sum) && same_bits(f.lse, a.lse) && same_bits(fused, two))
        << op << ": one pass differs from the two kernels";
    // The CPU's version of the op: the forward, then the backward over the logits.
    Tensor cpu_fused = logits.clone();
    auto cf = ops::cross_entropy_forward_backward_(cpu_fused, targets, scale);
    EXPECT_TRUE(same_bits(cf.loss_sum, ref.loss_sum) && same_bits(cpu_fused, dref)) << op << ": CPU one pass";
  }
}

// The vocabulary split in two (ops.h's vocab_shard_*): each shard's stats and gradient, and
// the loss from the stacked stats, against the CPU; an odd shard width takes the element path.
TEST(BackendDense, VocabularyShards) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (auto [T, V, cut] : {std::array<int64_t, 3>{7, 1001, 501}, {64, 151936, 75968}}) {
    Tensor logits = random_bf16_values({T, V}, 40 + T, 2.0);
    Tensor targets = random_ints({T}, 0, static_cast<int32_t>(V), 41 + T);
    for (int64_t t = 1; t < T; t += 4) targets.data<int32_t>()[t] = ops::kIgnoreIndex;
    const std::string op = tag("vocab_shards", {T, V, cut});
    const Tensor gtargets = targets.to(kGpu);
    Tensor lse = Tensor::empty({2, T}, DType::F32), tl = Tensor::empty({2, T}, DType::F32);
    Tensor glse = Tensor::empty({2, T}, DType::F32, kGpu), gtl = Tensor::empty({2, T}, DType::F32, kGpu);
    std::vector<Tensor> shards;
    for (int r = 0; r < 2; ++r) {
      const int64_t b = r == 0 ? 0 : cut, e = r == 0 ? cut : V;
      Tensor s = Tensor::empty({T, e - b}, DType::F32);
      for (int64_t t = 0; t < T; ++t) s.slice(t, t + 1).copy_from(logits.slice(t, t + 1).columns(b, e));
      shards.push_back(s);
      const ops::VocabShardStats ref = ops::vocab_shard_stats(s, targets, {b, V});
      const ops::VocabShardStats got = ops::vocab_shard_stats(on_gpu(s, DType::BF16), gtargets, {b, V});
      expect_backend_close(got.lse, ref.lse, kF32Tol, op + "_stats", "lse");
      expect_backend_close(got.target_logit, ref.target_logit, kF32Tol, op + "_stats", "target_logit");
      lse.slice(r, r + 1).copy_from(ref.lse.view({1, T}));
      tl.slice(r, r + 1).copy_from(ref.target_logit.view({1, T}));
      glse.slice(r, r + 1).copy_from(got.lse.view({1, T}));
      gtl.slice(r, r + 1).copy_from(got.target_logit.view({1, T}));
    }
    const ops::CrossEntropyOut ref = ops::vocab_parallel_loss(lse, tl, targets);
    const ops::CrossEntropyOut got = ops::vocab_parallel_loss(glse, gtl, gtargets);
    expect_backend_close(got.loss_sum, ref.loss_sum, kF32Tol, op + "_loss", "loss_sum");
    expect_backend_close(got.lse, ref.lse, kF32Tol, op + "_loss", "lse");
    expect_backend_close(ref.loss_sum, ops::cross_entropy_forward(logits, targets).loss_sum, 1e-6, op, "loss against the whole");
    for (int r = 0; r < 2; ++r) {
      const int64_t b = r == 0 ? 0 : cut;
      const Tensor dref = ops::vocab_shard_backward(shards[r], targets, ref.lse, {b, V}, 0.5);
      const Tensor dgot =
          ops::vocab_shard_backward(on_gpu(shards[r], DType::BF16), gtargets, on_gpu(ref.lse, DType::F32), {b, V}, 0.5);
      expect_backend_close(dgot, dref, kBf16Tol, op + "_backward", "dlogits");
    }
  }
}

TEST(BackendDense, LinearCrossEntropyChunked) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  const int64_t T = 777, H = 256, V = 3001;
  Tensor x = random_bf16_values({T, H}, 80), w = random_bf16_values({V, H}, 81, 0.2);
  Tensor targets = random_ints({T}, 0, static_cast<int32_t>(V), 82);
  for (int64_t t = 0; t < T; t += 7) targets.data<int32_t>()[t] = ops::kIgnoreIndex;
  Tensor dx_ref, dw_ref = Tensor::zeros({V, H}, DType::F32);
  auto ref = ops::linear_cross_entropy(x, w, targets, 1.0 / T, &dx_ref, &dw_ref);
  for (int64_t chunk : {int64_t{100}, int64_t{0}}) {
    Tensor dx, dw = Tensor::zeros({V, H}, DType::F32, kGpu);
    auto out = ops::linear_cross_entropy(on_gpu(x, DType::BF16), on_gpu(w, DType::BF16), targets.to(kGpu), 1.0 / T,
                                         &dx, &dw, chunk);
    const std::string op = fmt::format("linear_cross_entropy[T={},H={},V={},chunk={}]", T, H, V, chunk);
    expect_backend_close(out.loss_sum, ref.loss_sum, kBf16Tol, op, "loss_sum");
    expect_backend_close(dx, dx_ref, kBf16Tol, op, "dx");
    expect_backend_close(dw, dw_ref, kBf16Tol, op, "dw");
  }
}

TEST(BackendDense, CrossEntropyBadTargetGivesNaN) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  // No host check on CUDA: a target outside [0, V) (not -100) makes the loss NaN.
  Tensor logits = random_bf16_values({3, 16}, 5);
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{2, 16, -100}, {3});
  auto o = ops::cross_entropy_forward(on_gpu(logits, DType::BF16), targets.to(kGpu));
  EXPECT_TRUE(std::isnan(o.loss_sum.item(0)));
  Tensor d = ops::cross_entropy_backward(on_gpu(logits, DType::BF16), targets.to(kGpu), o.lse, 1.0);
  EXPECT_TRUE(std::isnan(d.item(16)));
  EXPECT_EQ(d.item(32), 0.0);  // ignored row
}

// ---- element-wise helpers -----------------------------------------------------------

TEST(BackendDense, SumSquares) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}, int64_t{2048} * 2048 + 5}) {
    Tensor x = random_bf16_values({n}, 30 + n);
    const double ref = ops::sum_squares(x);
    for (DType dt : {DType::F32, DType::BF16}) {
      Tensor g = on_gpu(x, dt);
      const double a = ops::sum_squares(g), b = ops::sum_squares(g);
      // Both sides add exact squares in double; only the order of the additions differs.
      expect_backend_close(Tensor::from_vector(std::vector<double>{a}, {1}),
                           Tensor::from_vector(std::vector<double>{ref}, {1}), 1e-12,
                           fmt::format("sum_squares[{}]_{}", n, dtype_name(dt)), "sum");
      EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << "two runs differ";
    }
  }
  // Unaligned start (a view one bf16 row in): the element path.
  Tensor x = random_bf16_values({1001, 3}, 31);
  Tensor g = on_gpu(x, DType::BF16).slice(1, 1001);
  EXPECT_NEAR(ops::sum_squares(g), ops::sum_squares(x.slice(1, 1001)), 1e-9 * ops::sum_squares(x));
  EXPECT_EQ(ops::sum_squares(Tensor::empty({0}, DType::F32, kGpu)), 0.0);
}

TEST(BackendDense, ScaleAndAdd) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{100003}, int64_t{2048} * 2048}) {
    Tensor x = random_bf16_values({n}, 40 + n), y = random_bf16_values({n}, 41 + n);
    Tensor sref = x.clone();
    ops::scale_(sref, 0.37);
    Tensor aref = y.clone();
    ops::add_(aref, x);
    const std::string sz = fmt::format("[{}]", n);
    for (DType dt : {DType::F32, DType::BF16}) {
      const double tol = dt == DType::F32 ? kF32Tol : kBf16Tol;
      const std::string d(dtype_name(dt));
      Tensor gs = on_gpu(x, dt);
      ops::scale_(gs, 0.37);
      expect_backend_close(gs, sref, tol, "scale_" + sz + "_" + d, "x");
      Tensor ga = on_gpu(y, dt);
      ops::add_(ga, on_gpu(x, dt));
      expect_backend_close(ga, aref, tol, "add_" + sz + "_" + d, "y");
    }
  }
  // Unaligned views take the element path.
  Tensor x = random_bf16_values({101, 3}, 42), y = random_bf16_values({101, 3}, 43);
  Tensor aref = y.slice(1, 101).clone();
  ops::add_(aref, x.slice(1, 101));
  Tensor gy = on_gpu(y, DType::BF16);
  Tensor gv = gy.slice(1, 101);
  ops::add_(gv, on_gpu(x, DType::BF16).slice(1, 101));
  expect_backend_close(gv, aref, kBf16Tol, "add_unaligned", "y");
  expect_error([&] { ops::add_(gy, on_gpu(y, DType::F32)); }, {"dtype"});
}

TEST(BackendDense, AllFinite) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{100003}}) {
    Tensor x = random_bf16_values({n}, 50 + n);
    for (DType dt : {DType::F32, DType::BF16}) {
      EXPECT_TRUE(ops::all_finite(on_gpu(x, dt))) << n;
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
        for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
          Tensor y = x.clone();
          y.data<float>()[at] = bad;
          EXPECT_FALSE(ops::all_finite(on_gpu(y, dt))) << "n=" << n << " at " << at << " value " << bad;
        }
      }
    }
  }
  EXPECT_TRUE(ops::all_finite(Tensor::empty({0}, DType::BF16, kGpu)));
}

// ---- AdamW --------------------------------------------------------------------------

TEST(BackendDense, AdamW) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  ops::AdamWStep s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.step = 3;
  for (int64_t n : {int64_t{7}, int64_t{1000003}}) {
    Tensor p = random_tensor({n}, DType::F32, 60 + n), g = random_tensor({n}, DType::F32, 61 + n, 0.1);
    Tensor m = random_tensor({n}, DType::F32, 62 + n, 0.01);
    Tensor v = abs_of(random_tensor({n}, DType::F32, 63 + n, 1e-3));
    Tensor gp = p.to(kGpu), gm = m.to(kGpu), gv = v.to(kGpu);
    const Tensor p0 = p.clone(), m0 = m.clone(), v0 = v.clone();
    ops::adamw_update(p, g, m, v, s);
    ops::adamw_update(gp, g.to(kGpu), gm, gv, s);
    const std::string op = fmt::format("adamw[{}]", n);
    expect_backend_close(gp, p, kF32Tol, op, "param");
    expect_backend_close(gm, m, kF32Tol, op, "m");
    expect_backend_close(gv, v, kF32Tol, op, "v");
    // One arithmetic on both sides (ops/adamw_math.h): the same bits, on both launch shapes.
    EXPECT_TRUE(bytes_equal(gp.to(Device::cpu()), p)) << op << ": param differs from the CPU's bits";
    EXPECT_TRUE(bytes_equal(gm.to(Device::cpu()), m)) << op << ": m differs from the CPU's bits";
    EXPECT_TRUE(bytes_equal(gv.to(Device::cpu()), v)) << op << ": v differs from the CPU's bits";
    for (int sms : {1, 3}) {
      s.max_sms = sms;
      Tensor cp = p0.to(kGpu), cm = m0.to(kGpu), cv = v0.to(kGpu);
      ops::adamw_update(cp, g.to(kGpu), cm, cv, s);
      s.max_sms = 0;
      EXPECT_TRUE(bytes_equal(cp.to(Device::cpu()), p)) << op << " on " << sms << " multiprocessors: param";
      EXPECT_TRUE(bytes_equal(cm.to(Device::cpu()), m)) << op << " on " << sms << " multiprocessors: m";
      EXPECT_TRUE(bytes_equal(cv.to(Device::cpu()), v)) << op << " on " << sms << " multiprocessors: v";
    }
  }
}

// bf16 moments (stochastic rounding keyed by step and element index: the same bits on both
// backends, whose f32 values before rounding are the same).
TEST(BackendDense, AdamWBf16Moments) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  ops::AdamWStep s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.999, s.eps = 1e-8, s.weight_decay = 0.1;
  for (int64_t n : {int64_t{7}, int64_t{1000003}}) {
    Tensor p = random_tensor({n}, DType::F32, 70 + n);
    Tensor m = random_tensor({n}, DType::F32, 72 + n, 0.01).to(DType::BF16);
    Tensor v = abs_of(random_tensor({n}, DType::F32, 73 + n, 1e-3)).to(DType::BF16);
    Tensor gp = p.to(kGpu), gm = m.to(kGpu), gv = v.to(kGpu);
    for (int step = 1; step <= 3; ++step) {
      s.step = step;
      const Tensor g = random_tensor({n}, DType::F32, 80 + n + step, 0.1);
      ops::adamw_update(p, g, m, v, s);
      ops::adamw_update(gp, g.to(kGpu), gm, gv, s);
    }
    ASSERT_EQ(gm.dtype(), DType::BF16);
    const std::string op = fmt::format("adamw_bf16_moments[{}]", n);
    expect_backend_close(gp, p, kF32Tol, op, "param");
    expect_backend_close(gm, m, kBf16Tol, op, "m");
    expect_backend_close(gv, v, kBf16Tol, op, "v");
    EXPECT_TRUE(bytes_equal(gp.to(Device::cpu()), p)) << op << ": param differs from the CPU's bits";
    EXPECT_TRUE(bytes_equal(gm.to(Device::cpu()), m)) << op << ": m differs from the CPU's bits";
    EXPECT_TRUE(bytes_equal(gv.to(Device::cpu()), v)) << op << ": v differs from the CPU's bits";
  }
}

// Stochastic rounding of bf16 moments keys on each element's place in the moment buffer, so
// one launch over views that lie back to back (coalesced into one run) rounds exactly as a
// launch per view: the optimizer may cut its update anywhere (LayerwiseOptimizer).
TEST(BackendDense, AdamWBf16MomentsRoundAlikeHoweverTheUpdateIsCut) {
  MT_REQUIRE_GPU();
  ops::AdamWStep s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.999, s.eps = 1e-8, s.weight_decay = 0.1, s.step = 3;
  const std::vector<int64_t> sizes{1000, 4096, 77, 30000};
  int64_t n = 0;
  for (int64_t k : sizes) n += k;
  const Tensor p0 = random_tensor({n}, DType::F32, 5).to(kGpu), g = random_tensor({n}, DType::F32, 6, 0.1).to(kGpu);
  const Tensor m0 = random_tensor({n}, DType::F32, 7, 0.01).to(DType::BF16).to(kGpu);
  const Tensor v0 = abs_of(random_tensor({n}, DType::F32, 8, 1e-3)).to(DType::BF16).to(kGpu);
  Tensor pa = p0.clone(), ma = m0.clone(), va = v0.clone(), pb = p0.clone(), mb = m0.clone(), vb = v0.clone();
  ops::AdamWTensors whole;
  int64_t at = 0;
  for (int64_t k : sizes) {
    whole.params.push_back(pa.slice(at, at + k));
    whole.grads.push_back(g.slice(at, at + k));
    whole.m.push_back(ma.slice(at, at + k));
    whole.v.push_back(va.slice(at, at + k));
    whole.values.push_back(Tensor());
    whole.decay.push_back(true);
    Tensor p = pb.slice(at, at + k), m = mb.slice(at, at + k), v = vb.slice(at, at + k);
    ops::adamw_update(p, g.slice(at, at + k), m, v, s);
    at += k;
  }
  ops::adamw_update_all(whole, s);
  EXPECT_TRUE(bytes_equal(ma.to(Device::cpu()), mb.to(Device::cpu())));
  EXPECT_TRUE(bytes_equal(va.to(Device::cpu()), vb.to(Device::cpu())));
  EXPECT_TRUE(bytes_equal(pa.to(Device::cpu()), pb.to(Device::cpu())));
}

// A parameter list as the optimizer sees it, on the host: many odd sizes, a large tensor,
// and an expert stack's rows; more tensors than one launch carries.
ops::AdamWTensors host_list(uint64_t seed) {
  std::vector<int64_t> sizes;
  for (int i = 0; i < 90; ++i) sizes.push_back(1 + (i * 7919) % 3001);
  sizes.push_back(1 << 20);
  for (int e = 0; e < 16; ++e) sizes.push_back(4096);
  ops::AdamWTensors t;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const uint64_t k = seed + 8 * i;
    t.params.push_back(random_tensor({n}, DType::F32, k));
    t.grads.push_back(random_tensor({n}, DType::F32, k + 1, 0.1));
    t.m.push_back(random_tensor({n}, DType::F32, k + 2, 0.01));
    t.v.push_back(abs_of(random_tensor({n}, DType::F32, k + 3, 1e-3)));
    t.values.push_back(i % 2 == 0 ? Tensor::empty({n}, DType::F32) : Tensor());  // f32 stand-in on the CPU
    t.decay.push_back(i % 5 != 0);
  }
  return t;
}

TEST(BackendDense, WholeListAdamWNormAndZero) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  ops::AdamWStep s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.step = 4, s.grad_scale = 0.3;
  ops::AdamWTensors cpu = host_list(90), gpu;
  // The GPU list: the same values, laid out flat on the device in every role, so the
  // stacked rows coalesce; every 13th tensor is a separate allocation, splitting runs.
  auto flat_on_gpu = [&](const std::vector<Tensor>& host) {
    int64_t total = 0;
    for (const Tensor& t : host) total += t.numel();
    Tensor flat = Tensor::empty({total + 1}, DType::F32, kGpu).slice(1, total + 1);  // unaligned start
    std::vector<Tensor> out;
    int64_t at = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      Tensor view = i % 13 == 0 ? Tensor::empty(host[i].shape(), DType::F32, kGpu)
                                : flat.slice(at, at + host[i].numel());
      view.copy_from(host[i].to(kGpu));
      out.push_back(view);
      at += host[i].numel();
    }
    return out;
  };
  auto list_on_gpu = [&](const ops::AdamWTensors& host) {
    ops::AdamWTensors t;
    t.params = flat_on_gpu(host.params);
    t.grads = flat_on_gpu(host.grads);
    t.m = flat_on_gpu(host.m);
    t.v = flat_on_gpu(host.v);
    t.decay = host.decay;
    for (const Tensor& v : host.values) t.values.push_back(v.defined() ? Tensor::empty(v.shape(), DType::BF16, kGpu) : v);
    return t;
  };
  gpu = list_on_gpu(cpu);

  const double norm_cpu = ops::sum_squares_all(cpu.grads);
  const double norm_gpu = ops::sum_squares_all(gpu.grads), again = ops::sum_squares_all(gpu.grads);
  EXPECT_NEAR(norm_gpu, norm_cpu, 1e-12 * norm_cpu);
  EXPECT_EQ(std::memcmp(&norm_gpu, &again, sizeof again), 0) << "two runs differ";
  // The same sum left on the device (no wait) at a chosen place, as the optimizer's norm parts.
  Tensor parts = Tensor::full({3}, NAN, DType::F64, kGpu);
  ops::sum_squares_all_into(gpu.grads, parts, 1);
  ops::sum_squares_all_into({}, parts, 2);
  const double into = parts.item(1);
  EXPECT_EQ(std::memcmp(&norm_gpu, &into, sizeof into), 0) << "sum_squares_all_into differs from sum_squares_all";
  EXPECT_EQ(parts.item(2), 0.0);
  EXPECT_TRUE(std::isnan(parts.item(0))) << "sum_squares_all_into wrote outside its element";

  // The same update on 5 multiprocessors (the capped launch LayerwiseOptimizer runs beside
  // the forward), on a second flat copy: unaligned runs (the element-wise path) and aligned
  // separate tensors, several launches.
  ops::AdamWTensors capped = list_on_gpu(cpu);
  ops::AdamWStep on_five = s;
  on_five.max_sms = 5;
  ops::adamw_update_all(capped, on_five);

  ops::adamw_update_all(cpu, s);
  for (size_t i = 0; i < cpu.values.size(); ++i) {
    if (cpu.values[i].defined()) cpu.values[i] = cpu.params[i].to(DType::BF16);
  }
  ops::adamw_update_all(gpu, s);
  auto same_bits = [](const Tensor& a, const Tensor& b) { return bytes_equal(a.to(Device::cpu()), b.to(Device::cpu())); };
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    const std::string op = fmt::format("adamw_update_all[{}: n={}]", i, cpu.params[i].numel());
    expect_backend_close(gpu.params[i], cpu.params[i], kF32Tol, op, "param");
    expect_backend_close(gpu.m[i], cpu.m[i], kF32Tol, op, "m");
    expect_backend_close(gpu.v[i], cpu.v[i], kF32Tol, op, "v");
    if (cpu.values[i].defined()) expect_backend_close(gpu.values[i], cpu.values[i], kBf16Tol, op, "value");
    EXPECT_TRUE(same_bits(gpu.params[i], cpu.params[i]) && same_bits(gpu.m[i], cpu.m[i]) && same_bits(gpu.v[i], cpu.v[i]))
        << op << ": not the CPU's bits";
    EXPECT_TRUE(same_bits(capped.params[i], gpu.params[i]) && same_bits(capped.m[i], gpu.m[i]) &&
                same_bits(capped.v[i], gpu.v[i]) && (!cpu.values[i].defined() || same_bits(capped.values[i], gpu.values[i])))
        << op << ": the capped launch differs";
    if (::testing::Test::HasFailure()) break;
  }
  ops::zero_all(gpu.grads);
  for (const Tensor& g : gpu.grads) {
    ASSERT_EQ(ops::sum_squares(g), 0.0) << "zero_all left " << g.str() << " nonzero";
  }
}

// Split f32 masters: join and split give the CPU's bits, and the whole-list AdamW on split
// masters (the bf16 weight and its i16 low half, ops/adamw_math.h) gives the CPU's bits for
// both halves and both moments: flat runs with an unaligned start (the element-wise path)
// and aligned ones (four elements a thread), separate tensors, and the capped launch.
TEST(BackendDense, SplitMastersJoinSplitAndAdamW) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  const int64_t n = 70001;
  Tensor master = random_tensor({n}, DType::F32, 81, 3.0);
  float* mp = master.data<float>();
  for (int64_t i = 0; i < n; i += 97) {  // exact ties of the rounding, both signs
    uint32_t u;
    std::memcpy(&u, &mp[i], 4);
    u = (u & 0xffff0000u) | 0x8000u;
    std::memcpy(&mp[i], &u, 4);
  }
  Tensor high = Tensor::empty({n}, DType::BF16), low = Tensor::empty({n}, DType::I16);
  ops::master_split_into(master, high, low);
  Tensor gmaster = master.to(kGpu), ghigh = Tensor::empty({n}, DType::BF16, kGpu), glow = Tensor::empty({n}, DType::I16, kGpu);
  ops::master_split_into(gmaster, ghigh, glow);
  EXPECT_TRUE(bytes_equal(ghigh.to(Device::cpu()), high)) << "master_split_into: high halves differ";
  EXPECT_TRUE(bytes_equal(glow.to(Device::cpu()), low)) << "master_split_into: low halves differ";
  Tensor joined = Tensor::empty({n}, DType::F32, kGpu);
  ops::master_join_into(joined, ghigh, glow);
  EXPECT_TRUE(bytes_equal(joined.to(Device::cpu()), master)) << "master_join_into does not give the master back";

  // A list of split masters on the CPU, and the same on the GPU laid out flat (start offset
  // `skew` elements) with every 7th tensor a separate allocation.
  ops::AdamWTensors cpu;
  for (int i = 0; i < 30; ++i) {
    const int64_t k = 37 * i + 5;
    Tensor m32 = random_tensor({k}, DType::F32, 200 + i, 0.5);
    Tensor h = Tensor::empty({k}, DType::BF16), l = Tensor::empty({k}, DType::I16);
    ops::master_split_into(m32, h, l);
    cpu.params.push_back(h);
    cpu.lows.push_back(l);
    cpu.grads.push_back(random_tensor({k}, DType::F32, 300 + i));
    cpu.m.push_back(random_tensor({k}, DType::F32, 400 + i, 0.01));
    cpu.v.push_back(abs_of(random_tensor({k}, DType::F32, 500 + i, 1e-3)));
    cpu.values.push_back(Tensor());
    cpu.decay.push_back(i % 3 != 0);
  }
  auto flat_on_gpu = [&](const std::vector<Tensor>& host, int64_t skew) {
    int64_t total = 0;
    for (const Tensor& t : host) total += t.numel();
    const DType dt = host.front().dtype();
    Tensor flat = Tensor::empty({total + skew}, dt, kGpu).slice(skew, total + skew);
    std::vector<Tensor> out;
    int64_t at = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      Tensor view = i % 7 == 3 ? Tensor::empty(host[i].shape(), dt, kGpu) : flat.slice(at, at + host[i].numel());
      view.copy_from(host[i].to(kGpu));
      out.push_back(view);
      at += host[i].numel();
    }
    return out;
  };
  auto list_on_gpu = [&](int64_t skew) {
    ops::AdamWTensors t;
    t.params = flat_on_gpu(cpu.params, skew);
    t.lows = flat_on_gpu(cpu.lows, skew);
    t.grads = flat_on_gpu(cpu.grads, skew);
    t.m = flat_on_gpu(cpu.m, skew);
    t.v = flat_on_gpu(cpu.v, skew);
    t.values.resize(cpu.values.size());
    t.decay = cpu.decay;
    return t;
  };
  ops::AdamWStep s;
  s.lr = 1e-3, s.weight_decay = 0.1, s.step = 3, s.grad_scale = 0.8;
  ops::AdamWTensors unaligned = list_on_gpu(1), aligned = list_on_gpu(0), capped = list_on_gpu(0);
  ops::adamw_update_all(unaligned, s);
  ops::adamw_update_all(aligned, s);
  ops::AdamWStep on_five = s;
  on_five.max_sms = 5;
  ops::adamw_update_all(capped, on_five);
  ops::adamw_update_all(cpu, s);
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    for (const ops::AdamWTensors* g : {&unaligned, &aligned, &capped}) {
      const char* which = g == &unaligned ? "unaligned" : g == &aligned ? "aligned" : "capped";
      EXPECT_TRUE(bytes_equal(g->params[i].to(Device::cpu()), cpu.params[i])) << which << " high half " << i;
      EXPECT_TRUE(bytes_equal(g->lows[i].to(Device::cpu()), cpu.lows[i])) << which << " low half " << i;
      EXPECT_TRUE(bytes_equal(g->m[i].to(Device::cpu()), cpu.m[i]) && bytes_equal(g->v[i].to(Device::cpu()), cpu.v[i]))
          << which << " moments " << i;
    }
    if (::testing::Test::HasFailure()) break;
  }
}

// ---- MoE auxiliary losses -----------------------------------------------------------

TEST(BackendDense, LoadBalanceAccumulate) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t R, E, K;
  };
  for (Case c : {Case{37, 5, 2}, Case{16, 64, 8}, Case{4096, 128, 8}, Case{1000, 33, 3}}) {
    auto routed = ops::router_forward(random_bf16_values({c.R, c.E}, 70 + c.R), c.K, false);
    Tensor sel0 = random_ints({c.E}, 0, 1000, 71 + c.R).to(DType::F32);
    Tensor ps0 = random_tensor({c.E}, DType::F32, 72 + c.R);
    Tensor sel = sel0.clone(), ps = ps0.clone();
    ops::load_balance_accumulate(routed.probs, routed.topk_idx, sel, ps);
    Tensor gprobs = routed.probs.to(kGpu), gidx = routed.topk_idx.to(kGpu);
    Tensor s1 = sel0.to(kGpu), p1 = ps0.to(kGpu), s2 = sel0.to(kGpu), p2 = ps0.to(kGpu);
    ops::load_balance_accumulate(gprobs, gidx, s1, p1);
    ops::load_balance_accumulate(gprobs, gidx, s2, p2);
    const std::string op = tag("load_balance_accumulate", {c.R, c.E, c.K});
    expect_backend_close(s1, sel, kF32Tol, op, "selections");
    expect_backend_close(p1, ps, kF32Tol, op, "prob_sum");
    EXPECT_TRUE(same_bits(s1, s2) && same_bits(p1, p2)) << op << ": two runs differ";
  }
}

TEST(BackendDense, LoadBalanceBackward) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (int64_t E : {int64_t{5}, int64_t{128}}) {
    Tensor sel = random_ints({E}, 0, 5000, 80 + E).to(DType::F32);
    Tensor ref = ops::load_balance_backward(sel, 300, 900, 0.01);
    Tensor got = ops::load_balance_backward(sel.to(kGpu), 300, 900, 0.01);
    expect_backend_close(got, ref, kF32Tol, fmt::format("load_balance_backward[300, {}]", E), "dprobs");
  }
}

// DeepSeek-V3's sequence-wise balance loss: its sum and gradient against the CPU reference,
// at V3's 256 experts top-8 and a small odd shape; two runs bitwise equal.
TEST(BackendDense, SeqBalanceLoss) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (auto [B, S, E, K] : {std::array<int64_t, 4>{2, 300, 256, 8}, {3, 17, 6, 2}}) {
    const ops::RouterOut r = ops::router_sigmoid_forward(random_tensor({B * S, E}, DType::F32, 90 + S), Tensor(), K, 1,
                                                         1, true, 1.0);
    const std::string op = fmt::format("seq_balance[B={},S={},E={},K={}]", B, S, E, K);
    Tensor gp = r.probs.to(kGpu), gi = r.topk_idx.to(kGpu);
    expect_backend_close(ops::seq_balance_loss_sum(gp, gi, B), ops::seq_balance_loss_sum(r.probs, r.topk_idx, B),
                         kF32Tol, op, "loss_sum");
    Tensor d1 = ops::seq_balance_backward(gp, gi, B, 0.25), d2 = ops::seq_balance_backward(gp, gi, B, 0.25);
    expect_backend_close(d1, ops::seq_balance_backward(r.probs, r.topk_idx, B, 0.25), kF32Tol, op, "dprobs");
    EXPECT_TRUE(same_bits(d1, d2)) << op << ": two runs differ";
    // Context parallelism: the counts, and the loss over the sequences' second halves with
    // the whole sequences' counts and length.
    const Tensor counts = ops::seq_balance_counts(r.topk_idx, B, E);
    EXPECT_EQ(ops::seq_balance_counts(gi, B, E).to(moetrain::Device::cpu()).to_double_vector(),
              counts.to_double_vector())
        << op << " counts";
    const int64_t half = S / 2;
    Tensor p = Tensor::empty({B * (S - half), E}, DType::F32), idx = Tensor::empty({B * (S - half), K}, DType::I32);
    for (int64_t b = 0; b < B; ++b) {
      p.slice(b * (S - half), (b + 1) * (S - half)).copy_from(r.probs.slice(b * S + half, (b + 1) * S));
      idx.slice(b * (S - half), (b + 1) * (S - half)).copy_from(r.topk_idx.slice(b * S + half, (b + 1) * S));
    }
    const ops::SeqBalanceWhole whole{counts, S}, gwhole{counts.to(kGpu), S};
    expect_backend_close(ops::seq_balance_loss_sum(p.to(kGpu), idx.to(kGpu), B, gwhole),
                         ops::seq_balance_loss_sum(p, idx, B, whole), kF32Tol, op + "[second halves]", "loss_sum");
    expect_backend_close(ops::seq_balance_backward(p.to(kGpu), idx.to(kGpu), B, 0.25, gwhole),
                         ops::seq_balance_backward(p, idx, B, 0.25, whole), kF32Tol, op + "[second halves]", "dprobs");
  }
}

TEST(BackendDense, RouterZLoss) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  struct Case {
    int64_t R, E;
  };
  for (Case c : {Case{37, 5}, Case{4096, 128}, Case{100, 60}}) {
    Tensor logits = random_bf16_values({c.R, c.E}, 90 + c.R, 3.0);
    auto ref = ops::router_z_loss_forward(logits);
    for (DType dt : {DType::BF16, DType::F32}) {
      Tensor g = on_gpu(logits, dt);
      auto a = ops::router_z_loss_forward(g);
      auto b = ops::router_z_loss_forward(g);
      const std::string op = fmt::format("router_z_loss_forward[{}, {}]_{}", c.R, c.E, dtype_name(dt));
      expect_backend_close(a.loss_sum, ref.loss_sum, kF32Tol, op, "loss_sum");
      expect_backend_close(a.lse, ref.lse, kF32Tol, op, "lse");
      EXPECT_TRUE(same_bits(a.loss_sum, b.loss_sum) && same_bits(a.lse, b.lse)) << op << ": two runs differ";
    }
    // Backward: f32 probs and lse in, bf16 dlogits out (the router logits' dtype on CUDA).
    Tensor probs = ops::router_forward(logits, 1, false).probs;
    const double scale = 1e-3 / static_cast<double>(c.R);
    Tensor dref = ops::router_z_loss_backward(probs, ref.lse, scale);
    Tensor dgot = ops::router_z_loss_backward(probs.to(kGpu), ref.lse.to(kGpu), scale);
    EXPECT_EQ(dgot.dtype(), DType::BF16);
    expect_backend_close(dgot, dref, kBf16Tol, tag("router_z_loss_backward", {c.R, c.E}), "dlogits");
  }
}

// Router entropy (telemetry): softmax probs of spread and peaked logits, and rows with exact zeros.
TEST(BackendDense, RouterEntropySum) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (auto [R, E] : {std::pair<int64_t, int64_t>{37, 5}, {4096, 128}, {100, 60}}) {
    for (double spread : {0.5, 30.0}) {
      Tensor probs = ops::router_forward(random_bf16_values({R, E}, 7 + R, spread), 1, false).probs;
      probs.data<float>()[0] = 0.0f;  // a zero prob adds nothing (0 log 0 = 0), not NaN
      const std::string op = fmt::format("router_entropy_sum[{}, {}]_spread{}", R, E, spread);
      Tensor got = ops::router_entropy_sum(probs.to(kGpu));
      EXPECT_EQ(got.dtype(), DType::F32);
      expect_backend_close(got, ops::router_entropy_sum(probs), kF32Tol, op, "sum");
      EXPECT_TRUE(same_bits(got, ops::router_entropy_sum(probs.to(kGpu)))) << op << ": two runs differ";
    }
  }
}

// ---- argument checks ----------------------------------------------------------------

TEST(BackendDense, Errors) {
  MT_REQUIRE_GPU();
  Tensor x = on_gpu(random_bf16_values({4, 8}, 1), DType::BF16);
  Tensor w32 = on_gpu(random_bf16_values({8}, 2), DType::F32);
  expect_error([&] { ops::rmsnorm_forward(x, w32, 1e-6); }, {"w", "bf16"});
  expect_error([&] { ops::rmsnorm_forward(x, on_gpu(random_bf16_values({3}, 2), DType::BF16), 1e-6); }, {"3"});
  expect_error([&] { ops::rope_forward(x, random_ints({4}, 0, 4, 3).to(kGpu), 3, 1e4); }, {"head_dim"});
  expect_error([&] { ops::rope_forward(x, random_ints({5}, 0, 4, 3).to(kGpu), 4, 1e4); }, {"positions"});
  expect_error([&] { ops::cross_entropy_forward(x, random_ints({3}, 0, 8, 4).to(kGpu)); }, {"targets"});
  Tensor dw = Tensor::zeros({6, 8}, DType::BF16, kGpu);
  expect_error([&] { ops::embedding_backward_weight(random_ints({4}, 0, 6, 5).to(kGpu), x, dw); }, {"dweight"});
  Tensor p = Tensor::zeros({4}, DType::F32, kGpu);
  expect_error([&] { ops::adamw_update(p, Tensor::zeros({4}, DType::BF16, kGpu), p, p, ops::AdamWStep{}); },
               {"grad"});
  // A CPU tensor among CUDA ones is named.
  expect_error([&] { ops::rmsnorm_forward(x, random_bf16_values({8}, 2), 1e-6); }, {"CPU"});
}

}  // namespace
}  // namespace moetrain
