// CUDA fused attention (src/ops/cuda/attention.cu) against the CPU reference.
//
// Inputs are random values representable in bf16, so both backends see the same numbers;
// the CPU computes in f32 (double inside), the GPU in bf16 with f32 accumulation. Device
// outputs are NaN-poisoned before the op runs (PoisonScope), so an element a kernel never
// writes fails the comparison. Each comparison prints "BACKEND <op> <output> <rel_err>".
//
// Tolerances: out, dq, dk, dv are stored in bf16 (kBf16Tol, relative L2 error over the
// tensor). lse is stored in f32, but it is not an f32-exact computation: the scores come
// from tensor-core products (f32 accumulation in a different order), exp2 runs at ~2 ulp
// and the GPU folds scale*log2(e) into one f32 constant; each costs ~1e-6 relative, far
// under 1e-3, while any masking or indexing error moves lse by O(0.1). So lse uses 1e-3.
//
// Determinism: the kernels use no atomics; backward (and forward) run twice must agree
// bit for bit. With ops::set_deterministic(false) the Hopper backward adds dQ up with f32
// atomics in one pass (the *OnePass tests): dq is then compared with the CPU only, dk and dv
// must still repeat bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend_compare.h"
#include "core/rng.h"
#include "ops/ops.h"

#if MOETRAIN_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

namespace ops = moetrain::ops;
using moetrain::Device;
using moetrain::DType;
using moetrain::Rng;
using moetrain::Shape;
using moetrain::Tensor;
using moetrain::testing::backend_error;
using moetrain::testing::expect_backend_close;
using moetrain::testing::kBf16Tol;
using moetrain::testing::on_gpu;
using moetrain::testing::PoisonScope;
using moetrain::testing::random_bf16_values;

constexpr double kLseTol = 1e-3;

enum class Segments { kNone, kDocuments, kInterleaved };

struct AttnCase {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  Segments segments = Segments::kNone;
  int64_t v_head_dim = 0;  // 0: head_dim (DeepSeek-V3's MLA: 192 / 128)
  int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

std::string case_name(const AttnCase& c) {
  const char* seg = c.segments == Segments::kNone ? "" : c.segments == Segments::kDocuments ? ",seg" : ",seg_interleaved";
  return "attention[B=" + std::to_string(c.batch) + ",S=" + std::to_string(c.seq) + ",Hq=" +
         std::to_string(c.q_heads) + ",Hkv=" + std::to_string(c.kv_heads) + ",D=" + std::to_string(c.head_dim) +
         (c.value_dim() != c.head_dim ? ",Dv=" + std::to_string(c.value_dim()) : "") + seg + "]";
}

// kDocuments: each sequence cut into packed documents of random length 1..80 (ids
// nondecreasing, crossing tile boundaries). kInterleaved: ids that repeat out of order
// ((s / 7) % 3), so a query sees scattered keys: the kernels must not assume contiguity.
Tensor make_segments(const AttnCase& c, uint64_t seed) {
  std::vector<int32_t> seg(c.batch * c.seq);
  Rng rng(seed);
  for (int64_t b = 0; b < c.batch; ++b) {
    int32_t id = 0;
    int64_t left = 1 + static_cast<int64_t>(rng.below(80));
    for (int64_t s = 0; s < c.seq; ++s) {
      if (c.segments == Segments::kInterleaved) {
        seg[b * c.seq + s] = static_cast<int32_t>((s / 7) % 3);
        continue;
      }
      if (left-- == 0) {
        ++id;
        left = static_cast<int64_t>(rng.below(80));
      }
      seg[b * c.seq + s] = id;
    }
  }
  return Tensor::from_vector(seg, {c.batch * c.seq});
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  const auto x = a.to_double_vector(), y = b.to_double_vector();
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
}

// ops::set_deterministic(on) for a scope.
struct DeterministicScope {
  bool saved = ops::deterministic();
  explicit DeterministicScope(bool on) { ops::set_deterministic(on); }
  ~DeterministicScope() { ops::set_deterministic(saved); }
};

void run_case(const AttnCase& c, uint64_t seed) {
  PoisonScope poison;
  const std::string name = case_name(c) + (ops::deterministic() ? "" : "[one pass]");
  const int64_t T = c.batch * c.seq;
  ops::AttentionShape a;
  a.batch = c.batch;
  a.seq = c.seq;
  a.q_heads = c.q_heads;
  a.kv_heads = c.kv_heads;
  a.head_dim = c.head_dim;
  a.v_head_dim = c.v_head_dim;
  a.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));

  const Tensor q = random_bf16_values({T, c.q_heads * c.head_dim}, seed);
  const Tensor k = random_bf16_values({T, c.kv_heads * c.head_dim}, seed + 1);
  const Tensor v = random_bf16_values({T, c.kv_heads * c.value_dim()}, seed + 2);
  const Tensor dout = random_bf16_values({T, c.q_heads * c.value_dim()}, seed + 3);
  const Tensor seg = c.segments == Segments::kNone ? Tensor() : make_segments(c, seed + 4);

  const ops::AttentionOut ref = ops::attention_forward(q, k, v, seg, a);
  const ops::AttentionGrads ref_g = ops::attention_backward(dout, q, k, v, seg, ref.out, ref.lse, a);

  const Tensor gq = on_gpu(q, DType::BF16), gk = on_gpu(k, DType::BF16), gv = on_gpu(v, DType::BF16);
  const Tensor gdout = on_gpu(dout, DType::BF16);
  const Tensor gseg = seg.defined() ? seg.to(Device::cuda(0)) : Tensor();
  const ops::AttentionOut got = ops::attention_forward(gq, gk, gv, gseg, a);
  ASSERT_EQ(got.out.dtype(), DType::BF16);
  ASSERT_EQ(got.lse.dtype(), DType::F32);
  ASSERT_EQ(got.out.shape(), (Shape{T, c.q_heads * c.value_dim()})) << name;
  expect_backend_close(got.out, ref.out, kBf16Tol, name, "out");
  expect_backend_close(got.lse, ref.lse, kLseTol, name, "lse");

  const ops::AttentionGrads g1 = ops::attention_backward(gdout, gq, gk, gv, gseg, got.out, got.lse, a);
  ASSERT_EQ(g1.dq.shape(), q.shape()) << name;
  ASSERT_EQ(g1.dk.shape(), k.shape()) << name;
  ASSERT_EQ(g1.dv.shape(), v.shape()) << name;
  if (c.seq == 1) {
    // One key per row: P = 1 and dP - delta = dO.(v - O) = 0, so dq = dk = 0 exactly in
    // the reference and a relative error is meaningless; the GPU's delta uses the bf16 O,
    // so it leaves a residue of about |dO||v| * 2^-9.
    for (const Tensor* t : {&g1.dq, &g1.dk}) {
      double mx = 0;
      for (double x : t->to_double_vector()) mx = std::max(mx, std::isfinite(x) ? std::fabs(x) : INFINITY);
      EXPECT_LT(mx, 5e-2) << name << (t == &g1.dq ? " dq" : " dk");
    }
  } else {
    expect_backend_close(g1.dq, ref_g.dq, kBf16Tol, name, "dq");
    expect_backend_close(g1.dk, ref_g.dk, kBf16Tol, name, "dk");
  }
  expect_backend_close(g1.dv, ref_g.dv, kBf16Tol, name, "dv");

  const ops::AttentionOut got2 = ops::attention_forward(gq, gk, gv, gseg, a);
  EXPECT_TRUE(bitwise_equal(got2.out, got.out)) << name << " forward out not reproducible";
  EXPECT_TRUE(bitwise_equal(got2.lse, got.lse)) << name << " forward lse not reproducible";
  const ops::AttentionGrads g2 = ops::attention_backward(gdout, gq, gk, gv, gseg, got.out, got.lse, a);
  if (ops::deterministic()) {
    EXPECT_TRUE(bitwise_equal(g2.dq, g1.dq)) << name << " dq not bitwise reproducible";
  }
  if (c.seq != 1) expect_backend_close(g2.dq, ref_g.dq, kBf16Tol, name, "dq (second run)");
  EXPECT_TRUE(bitwise_equal(g2.dk, g1.dk)) << name << " dk not bitwise reproducible";
  EXPECT_TRUE(bitwise_equal(g2.dv, g1.dv)) << name << " dv not bitwise reproducible";
  std::fflush(stdout);
}

TEST(BackendAttention, MhaD64RaggedBatch) {
  MT_REQUIRE_GPU();
  run_case({2, 77, 2, 2, 64}, 101);
}

TEST(BackendAttention, GqaFourToOneD128) {
  MT_REQUIRE_GPU();
  run_case({1, 200, 4, 1, 128}, 202);
}

TEST(BackendAttention, GqaEightToTwoD64) {
  MT_REQUIRE_GPU();
  run_case({2, 130, 8, 2, 64}, 303);
}

TEST(BackendAttention, MhaD128TileMultiple) {
  MT_REQUIRE_GPU();
  run_case({2, 128, 2, 2, 128}, 404);
}

TEST(BackendAttention, HeadDim32) {
  MT_REQUIRE_GPU();
  run_case({2, 100, 4, 2, 32}, 505);
}

TEST(BackendAttention, TinySequences) {
  MT_REQUIRE_GPU();
  run_case({3, 1, 2, 1, 64}, 606);
  run_case({2, 5, 4, 2, 128}, 607);
}

TEST(BackendAttention, SegmentsD128) {
  MT_REQUIRE_GPU();
  run_case({2, 256, 4, 2, 128, Segments::kDocuments}, 707);
}

TEST(BackendAttention, SegmentsD64Ragged) {
  MT_REQUIRE_GPU();
  run_case({3, 200, 8, 2, 64, Segments::kDocuments}, 808);
}

TEST(BackendAttention, SegmentsInterleaved) {
  MT_REQUIRE_GPU();
  run_case({1, 150, 4, 1, 64, Segments::kInterleaved}, 909);
  run_case({1, 150, 2, 1, 128, Segments::kInterleaved}, 910);
}

// Many small sequences: enough key-tile blocks that the dK/dV pass keeps 2 query heads per
// block (on a 132-SM H100: one block per kv group, then two blocks of 2 heads), so the
// in-block loop over a kv group's heads runs; the cases above split one head per block.
TEST(BackendAttention, GqaHeadLoopInBlock) {
  MT_REQUIRE_GPU();
  run_case({20, 100, 32, 16, 64}, 1101);
  run_case({10, 100, 64, 16, 128}, 1102);
}

// Shapes that take the Hopper (TMA + wgmma) backward on an sm_90 GPU: head_dim 128 and seq
// a multiple of 128; GQA groups of 8, 1 and 16, several query tiles below each key tile,
// and both segment patterns.
TEST(BackendAttention, HopperBackwardShapes) {
  MT_REQUIRE_GPU();
  run_case({2, 384, 8, 1, 128, Segments::kInterleaved}, 1201);
  run_case({2, 512, 16, 2, 128}, 1202);
  run_case({1, 256, 4, 4, 128, Segments::kDocuments}, 1203);
  run_case({1, 640, 16, 1, 128}, 1204);
}

// The same shapes with the one-pass backward (dQ by f32 atomics in the dK/dV blocks).
TEST(BackendAttention, HopperBackwardShapesOnePass) {
  MT_REQUIRE_GPU();
  DeterministicScope one_pass(false);
  run_case({2, 384, 8, 1, 128, Segments::kInterleaved}, 1211);
  run_case({2, 512, 16, 2, 128}, 1212);
  run_case({1, 256, 4, 4, 128, Segments::kDocuments}, 1213);
  run_case({1, 640, 16, 1, 128}, 1214);
  run_case({1, 2048, 32, 4, 128}, 1215);
  run_case({2, 100, 4, 2, 64}, 1216);  // not a Hopper shape: the deterministic kernels run
}

TEST(BackendAttention, RealisticShape) {
  MT_REQUIRE_GPU();
  run_case({1, 2048, 32, 4, 128}, 1001);
}

// DeepSeek-V3's multi-head latent attention: query/key heads of 192 (qk_nope 128 + qk_rope
// 64), value heads of 128, as many kv heads as query heads. The mma.sync kernels take it at
// every seq; on Hopper, with seq a multiple of 128, the wgmma kernels run (attention_hopper.cu:
// fwd_kernel<192>, dkdv_kernel<false, 192>, dq_kernel<192>; GQA with dK/dV splits stays on
// mma.sync): ragged sequences
// (not a multiple of any tile), tile multiples, one and a few tokens, both segment patterns.
TEST(BackendAttention, MlaD192Dv128Mha) {
  MT_REQUIRE_GPU();
  run_case({1, 200, 4, 4, 192, Segments::kNone, 128}, 1301);
  run_case({2, 77, 4, 4, 192, Segments::kNone, 128}, 1302);
  run_case({2, 256, 2, 2, 192, Segments::kNone, 128}, 1303);
}

TEST(BackendAttention, MlaD192Dv128TinySequences) {
  MT_REQUIRE_GPU();
  run_case({3, 1, 2, 2, 192, Segments::kNone, 128}, 1311);
  run_case({2, 5, 4, 4, 192, Segments::kNone, 128}, 1312);
}

TEST(BackendAttention, MlaD192Dv128Segments) {
  MT_REQUIRE_GPU();
  run_case({2, 256, 4, 4, 192, Segments::kDocuments, 128}, 1321);
  run_case({3, 200, 2, 2, 192, Segments::kDocuments, 128}, 1322);
  run_case({1, 150, 4, 4, 192, Segments::kInterleaved, 128}, 1323);
}

// The kernels are general in the group: GQA with 192 / 128 heads, with the dK/dV pass split
// over several blocks of a kv group (f32 partials of both widths, then the reduce kernel:
// B=2, S=130, Hkv=2 has 12 key-tile blocks) and with 2 heads looped inside each block.
TEST(BackendAttention, MlaD192Dv128Gqa) {
  MT_REQUIRE_GPU();
  run_case({2, 130, 8, 2, 192, Segments::kNone, 128}, 1331);
  run_case({10, 100, 64, 16, 192, Segments::kNone, 128}, 1332);
  run_case({2, 200, 8, 2, 192, Segments::kDocuments, 128}, 1333);
  run_case({2, 256, 8, 2, 192, Segments::kDocuments, 128}, 1334);  // the Hopper forward (seq % 128 == 0), grouped
}

// ops::set_deterministic(false) changes nothing for these heads (the one-pass kernel is the
// Hopper one): the deterministic kernels run, seq a multiple of 128 included.
TEST(BackendAttention, MlaD192Dv128OnePassAsked) {
  MT_REQUIRE_GPU();
  DeterministicScope one_pass(false);
  run_case({1, 256, 4, 4, 192, Segments::kNone, 128}, 1341);
}

TEST(BackendAttention, MlaD192Dv128RealisticShape) {
  MT_REQUIRE_GPU();
  run_case({1, 2048, 8, 8, 192, Segments::kNone, 128}, 1351);
}

// ---- parts (context parallelism's ring): ops.h's attention_part_* and attention_merge ----

// lse with rows that saw nothing: those must be -inf on both backends; the rest as kLseTol.
void expect_lse_close(const Tensor& gpu, const Tensor& ref, const std::string& name) {
  std::vector<double> g = gpu.to_double_vector(), r = ref.to_double_vector();
  ASSERT_EQ(g.size(), r.size()) << name;
  int64_t empty = 0, mismatched = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool gi = std::isinf(g[i]) && g[i] < 0, ri = std::isinf(r[i]) && r[i] < 0;
    if (gi != ri) ++mismatched;
    if (ri) ++empty;
    if (gi || ri) g[i] = r[i] = 0;
  }
  EXPECT_EQ(mismatched, 0) << name << ": rows -inf on one backend only";
  std::printf("BACKEND %s lse rows that saw no key: %lld of %zu\n", name.c_str(), static_cast<long long>(empty),
              g.size());
  expect_backend_close(Tensor::from_vector(g, gpu.shape()), Tensor::from_vector(r, ref.shape()), kLseTol, name, "lse");
}

// The zigzag ring's parts of sequences of c.seq rows (own keys causally, an earlier rank's
// first chunk, a later rank's block by the second chunk), and two odd ones; with documents,
// the keys' are another rank's (their own ids). Where the halves are whole tiles of 128 (and
// the heads 128, or MLA's 192 / 128), the ring's parts run the Hopper kernels; the odd ones
// the mma.sync kernels.
void run_part_case(const AttnCase& c, uint64_t seed) {
  PoisonScope poison;
  const int64_t T = c.batch * c.seq, S = c.seq;
  ops::AttentionShape a{c.batch, c.seq, c.q_heads, c.kv_heads, c.head_dim, 1.0 / std::sqrt(double(c.head_dim)),
                        c.v_head_dim};
  const Tensor q = random_bf16_values({T, c.q_heads * c.head_dim}, seed);
  const Tensor k = random_bf16_values({T, c.kv_heads * c.head_dim}, seed + 1);
  const Tensor v = random_bf16_values({T, c.kv_heads * c.value_dim()}, seed + 2);
  const Tensor dout = random_bf16_values({T, c.q_heads * c.value_dim()}, seed + 3);
  const bool docs = c.segments != Segments::kNone;
  const Tensor qseg = docs ? make_segments(c, seed + 4) : Tensor(), kseg = docs ? make_segments(c, seed + 5) : Tensor();
  const Tensor gq = on_gpu(q, DType::BF16), gk = on_gpu(k, DType::BF16), gv = on_gpu(v, DType::BF16);
  const Tensor gdout = on_gpu(dout, DType::BF16);
  const Tensor gqseg = docs ? qseg.to(Device::cuda(0)) : Tensor(), gkseg = docs ? kseg.to(Device::cuda(0)) : Tensor();
  const std::vector<ops::AttentionPart> parts = {
      {0, S, 0, S, true}, {0, S, 0, S / 2, false}, {S / 2, S, 0, S, false}, {S / 5, S - 3, 7, S - 1, false},
      {S / 3, S - S / 4, S / 3, S - S / 4, true}};
  ops::AttentionOut ref_acc, acc;
  for (size_t i = 0; i < parts.size(); ++i) {
    ops::AttentionPart p = parts[i], gp = parts[i];
    if (docs) {
      p.q_segments = qseg;
      gp.q_segments = gqseg;
      p.k_segments = gp.k_segments = Tensor();
      p.k_segments = i == 0 || i == 4 ? qseg : kseg;  // a causal part: one rank's own rows
      gp.k_segments = i == 0 || i == 4 ? gqseg : gkseg;
    }
    const std::string name = case_name(c) + "[part q " + std::to_string(p.q_begin) + ".." + std::to_string(p.q_end) +
                             " k " + std::to_string(p.k_begin) + ".." + std::to_string(p.k_end) +
                             (p.causal ? " causal]" : "]");
    const ops::AttentionOut ref = ops::attention_part_forward(q, k, v, p, a);
    const ops::AttentionOut got = ops::attention_part_forward(gq, gk, gv, gp, a);
    expect_backend_close(got.out, ref.out, kBf16Tol, name, "out");
    expect_lse_close(got.lse, ref.lse, name);
    const ops::AttentionGrads rg = ops::attention_part_backward(dout, q, k, v, p, ref.out, ref.lse, a);
    const ops::AttentionGrads g = ops::attention_part_backward(gdout, gq, gk, gv, gp, got.out, got.lse, a);
    expect_backend_close(g.dq, rg.dq, kBf16Tol, name, "dq");
    expect_backend_close(g.dk, rg.dk, kBf16Tol, name, "dk");
    expect_backend_close(g.dv, rg.dv, kBf16Tol, name, "dv");
    const ops::AttentionGrads g2 = ops::attention_part_backward(gdout, gq, gk, gv, gp, got.out, got.lse, a);
    EXPECT_TRUE(bitwise_equal(g2.dk, g.dk) && bitwise_equal(g2.dv, g.dv)) << name << " dk/dv not reproducible";
    // The running softmax over the parts, f32 on the GPU.
    if (i == 0) {
      ref_acc = ref;
      acc = {got.out.to(DType::F32), got.lse.clone()};
    } else {
      ops::attention_merge(ref_acc, ref);
      ops::attention_merge(acc, got);
    }
    expect_backend_close(acc.out, ref_acc.out, kBf16Tol, name, "merged out");
    expect_lse_close(acc.lse, ref_acc.lse, name + "[merged]");
  }
  std::fflush(stdout);
}

TEST(BackendAttention, PartsD64Ragged) {
  MT_REQUIRE_GPU();
  run_part_case({2, 77, 4, 2, 64}, 1401);
  run_part_case({2, 77, 4, 2, 64, Segments::kDocuments}, 1411);
}

TEST(BackendAttention, PartsD128HopperShape) {
  MT_REQUIRE_GPU();
  run_part_case({2, 256, 8, 2, 128}, 1421);
  run_part_case({1, 512, 4, 4, 128, Segments::kInterleaved}, 1431);
}

TEST(BackendAttention, PartsMlaD192Dv128) {
  MT_REQUIRE_GPU();
  run_part_case({2, 192, 4, 4, 192, Segments::kDocuments, 128}, 1441);
  run_part_case({1, 512, 4, 4, 192, Segments::kDocuments, 128}, 1451);  // the halves: whole tiles (Hopper)
}

TEST(BackendAttention, RejectsBadArguments) {
  MT_REQUIRE_GPU();
  ops::AttentionShape a;
  a.batch = 1;
  a.seq = 8;
  a.q_heads = 2;
  a.kv_heads = 1;
  a.head_dim = 96;
  a.scale = 0.1;
  const Tensor q = on_gpu(random_bf16_values({8, 2 * 96}, 1), DType::BF16);
  const Tensor kv = on_gpu(random_bf16_values({8, 96}, 2), DType::BF16);
  try {
    ops::attention_forward(q, kv, kv, Tensor(), a);
    ADD_FAILURE() << "head_dim 96 accepted";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  a.head_dim = 64;
  a.scale = 0;
  const Tensor q64 = on_gpu(random_bf16_values({8, 2 * 64}, 3), DType::BF16);
  const Tensor kv64 = on_gpu(random_bf16_values({8, 64}, 4), DType::BF16);
  EXPECT_THROW(ops::attention_forward(q64, kv64, kv64, Tensor(), a), moetrain::Error);
  a.scale = 0.125;
  const Tensor k_f32 = kv64.to(DType::F32);
  try {
    ops::attention_forward(q64, k_f32, kv64, Tensor(), a);
    ADD_FAILURE() << "f32 k accepted";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor k has dtype"), std::string::npos) << e.what();
  }
  // Value heads of another size: the kernels take MLA's (192, 128) only (the CPU reference
  // takes any pair).
  a.head_dim = 128;
  a.v_head_dim = 64;
  const Tensor q128 = on_gpu(random_bf16_values({8, 2 * 128}, 5), DType::BF16);
  const Tensor k128 = on_gpu(random_bf16_values({8, 128}, 6), DType::BF16);
  const Tensor v64 = on_gpu(random_bf16_values({8, 64}, 7), DType::BF16);
  try {
    ops::attention_forward(q128, k128, v64, Tensor(), a);
    ADD_FAILURE() << "value heads of 64 with query/key heads of 128 accepted";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 128 with value heads of 64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(192, 128)"), std::string::npos) << e.what();
  }
  // 192 only with value heads of 128.
  a.head_dim = 192;
  a.v_head_dim = 0;
  const Tensor q192 = on_gpu(random_bf16_values({8, 2 * 192}, 8), DType::BF16);
  const Tensor kv192 = on_gpu(random_bf16_values({8, 192}, 9), DType::BF16);
  try {
    ops::attention_forward(q192, kv192, kv192, Tensor(), a);
    ADD_FAILURE() << "head_dim 192 with value heads of 192 accepted";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 192 with value heads of 192"), std::string::npos) << e.what();
  }
  // (192, 128): v, out and dout are Dv wide; a v of k's width is refused by name.
  a.v_head_dim = 128;
  try {
    ops::attention_forward(q192, kv192, kv192, Tensor(), a);
    ADD_FAILURE() << "v of [8, 192] accepted with value heads of 128";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor v has shape"), std::string::npos) << e.what();
  }
  const Tensor v128 = on_gpu(random_bf16_values({8, 128}, 10), DType::BF16);
  const ops::AttentionOut o = ops::attention_forward(q192, kv192, v128, Tensor(), a);
  EXPECT_EQ(o.out.shape(), (Shape{8, 2 * 128}));
  try {
    ops::attention_backward(q192, q192, kv192, v128, Tensor(), o.out, o.lse, a);
    ADD_FAILURE() << "dout of q's shape [8, 384] accepted with value heads of 128";
  } catch (const moetrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor dout has shape"), std::string::npos) << e.what();
  }
}

// Not an assertion: forward and backward time and throughput for the target shapes.
// Causal FLOPs: forward 2 matmuls * 2 * B*Hq*S*S*D / 2; backward 2.5x forward.
TEST(BackendAttention, TimingRealistic) {
  MT_REQUIRE_GPU();
#if MOETRAIN_WITH_CUDA
  struct Shape5 {
    int64_t B, S, Hq, Hkv, D;
  };
  for (const Shape5 s : {Shape5{1, 2048, 32, 4, 128}, Shape5{4, 2048, 32, 4, 128}, Shape5{1, 8192, 32, 4, 128}}) {
    ops::AttentionShape a;
    a.batch = s.B;
    a.seq = s.S;
    a.q_heads = s.Hq;
    a.kv_heads = s.Hkv;
    a.head_dim = s.D;
    a.scale = 1.0 / std::sqrt(static_cast<double>(s.D));
    const int64_t T = s.B * s.S;
    const Tensor q = on_gpu(random_bf16_values({T, s.Hq * s.D}, 1), DType::BF16);
    const Tensor k = on_gpu(random_bf16_values({T, s.Hkv * s.D}, 2), DType::BF16);
    const Tensor v = on_gpu(random_bf16_values({T, s.Hkv * s.D}, 3), DType::BF16);
    const Tensor dout = on_gpu(random_bf16_values({T, s.Hq * s.D}, 4), DType::BF16);
    auto stream = static_cast<cudaStream_t>(moetrain::cuda::current_stream());
    cudaEvent_t e0, e1, e2;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventCreate(&e2);
    ops::AttentionOut o = ops::attention_forward(q, k, v, Tensor(), a);  // warm-up
    ops::AttentionGrads g = ops::attention_backward(dout, q, k, v, Tensor(), o.out, o.lse, a);
    constexpr int kIters = 10;
    cudaEventRecord(e0, stream);
    for (int i = 0; i < kIters; ++i) o = ops::attention_forward(q, k, v, Tensor(), a);
    cudaEventRecord(e1, stream);
    for (int i = 0; i < kIters; ++i) g = ops::attention_backward(dout, q, k, v, Tensor(), o.out, o.lse, a);
    cudaEventRecord(e2, stream);
    cudaEventSynchronize(e2);
    float fwd_ms = 0, bwd_ms = 0;
    cudaEventElapsedTime(&fwd_ms, e0, e1);
    cudaEventElapsedTime(&bwd_ms, e1, e2);
    fwd_ms /= kIters;
    bwd_ms /= kIters;
    const double fwd_flops = 2.0 * 2.0 * s.B * s.Hq * static_cast<double>(s.S) * s.S * s.D / 2;
    const double bwd_flops = 2.5 * fwd_flops;
    std::printf("ATTN_TIMING B=%lld S=%lld Hq=%lld Hkv=%lld D=%lld causal: fwd %.3f ms %.1f TFLOP/s, bwd %.3f ms %.1f TFLOP/s\n",
                static_cast<long long>(s.B), static_cast<long long>(s.S), static_cast<long long>(s.Hq),
                static_cast<long long>(s.Hkv), static_cast<long long>(s.D), fwd_ms, fwd_flops / (fwd_ms * 1e9), bwd_ms,
                bwd_flops / (bwd_ms * 1e9));
    std::fflush(stdout);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
    EXPECT_TRUE(std::isfinite(g.dq.item(0)));
  }
#endif
}

}  // namespace
