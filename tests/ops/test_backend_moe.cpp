// CPU-vs-CUDA comparison of the linear layer and the MoE ops: router, permutation,
// permute/unpermute, combine and the grouped expert SwiGLU.
//
// Each case draws fresh inputs rounded to bf16 (random_bf16_values), so both backends see
// identical values; runs the CPU reference on f32 copies and the CUDA op on device tensors
// in the contract's mixed precision (ops.h: bf16 activations and weights, f32 router
// probabilities, routing weights and weight gradients, i64 counts on the device), with every
// new device buffer poisoned with NaN; and compares with expect_backend_close (prints
// "BACKEND op output rel_err"). Index outputs (top-k ids, counts, permutation rows) must
// match exactly. Accumulating outputs start from the same random values on both sides. The
// permutation and the grouped weight gradient also run twice and must agree bitwise.
// Without a GPU every test skips.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "backend_compare.h"
#include "core/rng.h"
#include "ops/ops.h"
#include "test_util.h"

namespace moetrain {
namespace {

using testing::expect_backend_close;
using testing::kBf16Tol;
using testing::kF32Tol;
using testing::on_gpu;
using testing::PoisonScope;
using testing::random_bf16_values;
using testing::random_ints;
using testing::random_tensor;

const Device kGpu = Device::cuda(0);

std::string tag(const std::string& op, const std::vector<std::pair<const char*, int64_t>>& dims) {
  std::string s = op + "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ',';
    s += dims[i].first;
    s += '=';
    s += std::to_string(dims[i].second);
  }
  return s + "]";
}

// Same dtype, shape and bytes (device tensors are copied to the host first).
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return std::memcmp(ha.raw(), hb.raw(), ha.nbytes()) == 0;
}

template <typename T>
void expect_same_values(const Tensor& gpu, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(gpu.shape(), ref.shape()) << what;
  ASSERT_EQ(gpu.dtype(), ref.dtype()) << what;
  const std::vector<T> g = gpu.to_vector<T>(), r = ref.to_vector<T>();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] != r[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " differ, first at " << first << " (gpu "
                    << (first >= 0 ? g[first] : 0) << ", cpu " << (first >= 0 ? r[first] : 0) << ")";
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected moetrain::Error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// random_tensor (f32) or, with round_to_bf16, random_bf16_values for large tensors: the
// same values, drawn by OpenMP threads a chunk each (the stream is counter-based, so a
// chunk starting at element b draws exactly what the whole tensor holds there).
Tensor big_random(const Shape& shape, uint64_t seed, double scale, bool round_to_bf16) {
  Tensor t = Tensor::empty(shape, DType::F32);
  Tensor flat = t.view({t.numel()});
  const int64_t n = t.numel(), chunk = int64_t{1} << 20, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic)
  for (int64_t c = 0; c < chunks; ++c) {
    Tensor part = flat.slice(c * chunk, std::min(n, (c + 1) * chunk));
    fill_normal(part, mix64(seed), scale, c * chunk);
    if (round_to_bf16) {
      float* p = part.data<float>();
      for (int64_t i = 0; i < part.numel(); ++i) p[i] = static_cast<float>(bf16(p[i]));
    }
  }
  return t;
}

// Router logits, exactly representable in bf16, whose values in each row are a random
// permutation of distinct multiples of a power-of-two step (8 / next_pow2(E)), centred
// on 0: no two experts tie, and neighbouring probabilities differ by a factor
// exp(step) >= 1.03, far beyond f32-vs-f64 rounding, so top-k picks match exactly.
Tensor gapped_logits(int64_t T, int64_t E, uint64_t seed) {
  int64_t pow2 = 1;
  while (pow2 < E) pow2 *= 2;
  const double step = 8.0 / static_cast<double>(pow2);
  Tensor t = Tensor::empty({T, E}, DType::F32);
  float* p = t.data<float>();
  Rng rng(mix64(seed));
  std::vector<int64_t> perm(static_cast<size_t>(E));
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t e = 0; e < E; ++e) perm[e] = e;
    for (int64_t e = E - 1; e > 0; --e) std::swap(perm[e], perm[rng.below(static_cast<uint64_t>(e + 1))]);
    for (int64_t e = 0; e < E; ++e) p[r * E + e] = static_cast<float>((perm[e] - E / 2) * step);
  }
  return t;
}

// Logits with many exact ties: each row draws from {-1, 0, 1, 2} only (and some rows are
// constant), so the order among equal probabilities (lower expert id first) decides the
// picks. Equal logits give bitwise-equal probabilities on either backend.
Tensor tied_logits(int64_t T, int64_t E, uint64_t seed) {
  Tensor t = Tensor::empty({T, E}, DType::F32);
  float* p = t.data<float>();
  Rng rng(mix64(seed));
  for (int64_t r = 0; r < T; ++r) {
    const bool constant = r % 5 == 0;
    for (int64_t e = 0; e < E; ++e) p[r * E + e] = constant ? 0.5f : static_cast<float>(rng.below(4)) - 1.0f;
  }
  return t;
}

// Expert ids for the permutation tests: each pair picks one of the first `hot` experts
// with probability 1/2 (a skewed load), otherwise any expert in [0, E) except the multiples
// of 7 above `hot` (left with zero rows).
Tensor skewed_ids(int64_t T, int64_t K, int64_t E, int64_t hot, uint64_t seed) {
  Tensor t = Tensor::empty({T, K}, DType::I32);
  int32_t* p = t.data<int32_t>();
  Rng rng(mix64(seed));
  for (int64_t i = 0; i < T * K; ++i) {
    int64_t e;
    if (rng.below(2) == 0) {
      e = static_cast<int64_t>(rng.below(static_cast<uint64_t>(hot)));
    } else {
      do {
        e = static_cast<int64_t>(rng.below(static_cast<uint64_t>(E)));
      } while (e >= hot && e % 7 == 0);
    }
    p[i] = static_cast<int32_t>(e);
  }
  return t;
}

// ---- linear -----------------------------------------------------------------------------

void check_linear(int64_t T, int64_t in, int64_t out, DType dt, uint64_t seed) {
  const std::string name = tag("linear", {{"T", T}, {"in", in}, {"out", out}}) + (dt == DType::F32 ? "f32" : "");
  const double tol = dt == DType::BF16 ? kBf16Tol : kF32Tol;
  Tensor x = random_bf16_values({T, in}, seed);
  Tensor w = random_bf16_values({out, in}, seed + 1, 1.0 / std::sqrt(static_cast<double>(in)));
  Tensor dy = random_bf16_values({T, out}, seed + 2);
  Tensor dw0 = random_tensor({out, in}, DType::F32, seed + 3);

  Tensor y_ref = ops::linear_forward(x, w);
  Tensor dx_ref = ops::linear_backward_input(dy, w);
  Tensor dw_ref = dw0.clone();
  ops::linear_backward_weight(dy, x, dw_ref);

  PoisonScope poison;
  Tensor xg = on_gpu(x, dt), wg = on_gpu(w, dt), dyg = on_gpu(dy, dt);
  Tensor y = ops::linear_forward(xg, wg);
  EXPECT_EQ(y.dtype(), dt);
  expect_backend_close(y, y_ref, tol, name, "y");
  Tensor dx = ops::linear_backward_input(dyg, wg);
  EXPECT_EQ(dx.dtype(), dt);
  expect_backend_close(dx, dx_ref, tol, name, "dx");
  Tensor dw = on_gpu(dw0, DType::F32);
  ops::linear_backward_weight(dyg, xg, dw);
  // dw is f32: the bf16 products are exact and summed in f32 on both sides.
  expect_backend_close(dw, dw_ref, kF32Tol, name, "dw");
  // The epilogue forms: y = residual + x W^T, dx += dy W.
  Tensor res = random_bf16_values({T, out}, seed + 4), dx0 = random_bf16_values({T, in}, seed + 5);
  Tensor yr_ref = ops::linear_forward(x, w, res);
  Tensor dxa_ref = dx0.clone();
  ops::linear_backward_input_add(dy, w, dxa_ref);
  expect_backend_close(ops::linear_forward(xg, wg, on_gpu(res, dt)), yr_ref, tol, name, "y+residual");
  Tensor dxa = on_gpu(dx0, dt);
  ops::linear_backward_input_add(dyg, wg, dxa);
  expect_backend_close(dxa, dxa_ref, tol, name, "dx+=");
}

TEST(BackendMoe, LinearRealistic) {
  MT_REQUIRE_GPU();
  check_linear(8192, 2048, 4096, DType::BF16, 101);
}

TEST(BackendMoe, LinearOddShapes) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, in, out;
  };
  // Odd sizes: leading dimensions that are not multiples of 8 (unaligned rows), one token.
  for (Case c : {Case{37, 40, 24}, Case{5, 13, 7}, Case{1, 8, 3}, Case{129, 264, 200}}) {
    check_linear(c.T, c.in, c.out, DType::BF16, 200 + c.T);
  }
}

// A bf16 GEMM with an f32 output: the f32 GEMM of the bf16 values (exact products), against
// the CPU's in f32 (DeepSeek-V3's router logits).
TEST(BackendMoe, LinearF32Out) {
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (auto [T, in, out] : {std::array<int64_t, 3>{300, 2048, 256}, {7, 33, 5}}) {
    Tensor x = random_bf16_values({T, in}, 40 + T), w = random_bf16_values({out, in}, 41 + T);
    Tensor got = ops::linear_forward_f32_out(on_gpu(x, DType::BF16), on_gpu(w, DType::BF16));
    EXPECT_EQ(got.dtype(), DType::F32);
    expect_backend_close(got, ops::linear_forward(x, w), kF32Tol, fmt::format("linear_f32_out[{},{},{}]", T, in, out),
                         "y");
  }
}

TEST(BackendMoe, LinearF32) {
  MT_REQUIRE_GPU();
  check_linear(33, 64, 48, DType::F32, 300);
  check_linear(7, 9, 5, DType::F32, 301);
}

// ---- router -------------------------------------------------------------------------------

void check_router_forward(const Tensor& logits, int64_t K, bool norm, DType dt, const std::string& name,
                          const Tensor& bias = Tensor()) {
  const ops::RouterOut ref = ops::router_forward(logits, K, norm, bias);
  PoisonScope poison;
  const ops::RouterOut got =
      ops::router_forward(on_gpu(logits, dt), K, norm, bias.defined() ? bias.to(kGpu) : Tensor());
  EXPECT_EQ(got.probs.dtype(), DType::F32);
  EXPECT_EQ(got.topk_weight.dtype(), DType::F32);
  expect_same_values<int32_t>(got.topk_idx, ref.topk_idx, name + " topk_idx");
  expect_backend_close(got.probs, ref.probs, kF32Tol, name, "probs");
  expect_backend_close(got.topk_weight, ref.topk_weight, kF32Tol, name, "topk_weight");
}

struct RouterCase {
  int64_t T, E, K;
};
// E = 60 and 6: not multiples of 32 (padded lanes); 256 experts top-8 (DeepSeek-V3 size).
const RouterCase kRouterCases[] = {{1000, 128, 8}, {517, 64, 6}, {300, 256, 8}, {77, 60, 4}, {64, 6, 2}, {33, 8, 8}};

TEST(BackendMoe, RouterForward) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K] : kRouterCases) {
    Tensor logits = gapped_logits(T, E, T + E);
    for (bool norm : {false, true}) {
      const std::string name = tag("router_forward", {{"T", T}, {"E", E}, {"K", K}, {"norm", norm}});
      check_router_forward(logits, K, norm, DType::BF16, name);
      if (E == 128) check_router_forward(logits, K, norm, DType::F32, name + "f32");
    }
  }
}

// With a selection bias (aux-loss-free balancing): picks by prob + bias, weights the probs.
TEST(BackendMoe, RouterForwardWithSelectionBias) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K] : kRouterCases) {
    Tensor logits = gapped_logits(T, E, 5 * T + E);
    // Two tiers: every third expert raised by 1.5, more than any prob, so a raised expert
    // beats every other one and, within a tier, the probs' gaps order the picks: no score
    // comes near a tie (random biases would, at f32's resolution), and the picks move.
    Tensor bias = Tensor::zeros({E}, DType::F32);
    for (int64_t e = 1; e < E; e += 3) bias.data<float>()[e] = 1.5f;
    for (bool norm : {false, true}) {
      const std::string name = tag("router_forward_bias", {{"T", T}, {"E", E}, {"K", K}, {"norm", norm}});
      check_router_forward(logits, K, norm, DType::BF16, name, bias);
      const ops::RouterOut plain = ops::router_forward(logits, K, norm);
      const ops::RouterOut biased = ops::router_forward(logits, K, norm, bias);
      if (K < E) {
        EXPECT_NE(plain.topk_idx.to_vector<int32_t>(), biased.topk_idx.to_vector<int32_t>()) << name;
      }
    }
  }
}

TEST(BackendMoe, RouterForwardTiesGoToLowerExpert) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K] : {RouterCase{200, 128, 8}, RouterCase{50, 40, 6}}) {
    Tensor logits = tied_logits(T, E, 7 * E);
    check_router_forward(logits, K, true, DType::BF16, tag("router_forward_ties", {{"T", T}, {"E", E}, {"K", K}}));
  }
}

TEST(BackendMoe, RouterBackward) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K] : kRouterCases) {
    Tensor logits = gapped_logits(T, E, 3 * T + E);
    Tensor dw = random_tensor({T, K}, DType::F32, T + 1);
    Tensor dprobs = random_tensor({T, E}, DType::F32, T + 2, 0.1);
    for (bool norm : {false, true}) {
      for (bool extra : {false, true}) {
        const std::string name =
            tag("router_backward", {{"T", T}, {"E", E}, {"K", K}, {"norm", norm}, {"dprobs", extra}});
        const ops::RouterOut fwd_ref = ops::router_forward(logits, K, norm);
        Tensor ref = ops::router_backward(dw, extra ? dprobs : Tensor(), fwd_ref, norm);
        PoisonScope poison;
        const ops::RouterOut fwd = ops::router_forward(on_gpu(logits, DType::BF16), K, norm);
        Tensor got = ops::router_backward(dw.to(kGpu), extra ? dprobs.to(kGpu) : Tensor(), fwd, norm);
        EXPECT_EQ(got.dtype(), DType::BF16);
        expect_backend_close(got, ref, kBf16Tol, name, "dlogits");
      }
    }
  }
}

// DeepSeek-V3's router: sigmoid scores, group-limited top-k. The logits are scaled so that
// no score saturates (a sigmoid of 20 is 1 in f32) and rounded to bf16 for the reference too,
// so both sides rank the same values; a bias on every fifth expert moves the picks.
struct SigmoidRouterCase {
  int64_t T, E, K, groups, keep;
};
// DeepSeek-V3 (256 experts, 8 groups keep 4, top-8), Moonlight (64, one group, top-6), groups
// of an odd size with padded lanes (60 = 4 x 15), every expert picked (8 of 8).
const SigmoidRouterCase kSigmoidRouterCases[] = {
    {300, 256, 8, 8, 4}, {517, 64, 6, 1, 1}, {77, 60, 4, 4, 2}, {64, 6, 2, 3, 2}, {33, 8, 8, 2, 2}};

Tensor sigmoid_router_logits(int64_t T, int64_t E, uint64_t seed) {
  Tensor l = gapped_logits(T, E, seed);
  ops::scale_(l, 0.05);
  return l.to(DType::BF16).to(DType::F32);
}

TEST(BackendMoe, RouterSigmoidForward) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K, G, TG] : kSigmoidRouterCases) {
    Tensor logits = sigmoid_router_logits(T, E, 11 * T + E);
    Tensor bias = Tensor::zeros({E}, DType::F32);
    for (int64_t e = 2; e < E; e += 5) bias.data<float>()[e] = 0.03f;
    for (bool norm : {false, true}) {
      for (bool with_bias : {false, true}) {
        const std::string name = tag("router_sigmoid_forward",
                                     {{"T", T}, {"E", E}, {"K", K}, {"G", G}, {"TG", TG}, {"norm", norm}, {"bias", with_bias}});
        const Tensor b = with_bias ? bias : Tensor();
        const ops::RouterOut ref = ops::router_sigmoid_forward(logits, b, K, G, TG, norm, 2.5);
        PoisonScope poison;
        const ops::RouterOut got = ops::router_sigmoid_forward(on_gpu(logits, DType::BF16),
                                                               with_bias ? bias.to(kGpu) : Tensor(), K, G, TG, norm, 2.5);
        EXPECT_EQ(got.topk_weight.dtype(), DType::F32);
        expect_same_values<int32_t>(got.topk_idx, ref.topk_idx, name + " topk_idx");
        expect_backend_close(got.probs, ref.probs, kF32Tol, name, "probs");
        expect_backend_close(got.topk_weight, ref.topk_weight, kF32Tol, name, "topk_weight");
      }
    }
  }
}

TEST(BackendMoe, RouterSigmoidBackward) {
  MT_REQUIRE_GPU();
  for (auto [T, E, K, G, TG] : kSigmoidRouterCases) {
    Tensor logits = sigmoid_router_logits(T, E, 13 * T + E);
    Tensor dw = random_tensor({T, K}, DType::F32, T + 3);
    Tensor dprobs = random_tensor({T, E}, DType::F32, T + 4, 0.1);
    for (bool norm : {false, true}) {
      for (bool extra : {false, true}) {
        const std::string name = tag("router_sigmoid_backward",
                                     {{"T", T}, {"E", E}, {"K", K}, {"G", G}, {"norm", norm}, {"dprobs", extra}});
        PoisonScope poison;
        const ops::RouterOut fwd = ops::router_sigmoid_forward(on_gpu(logits, DType::BF16), Tensor(), K, G, TG, norm, 2.5);
        Tensor got = ops::router_sigmoid_backward(dw.to(kGpu), extra ? dprobs.to(kGpu) : Tensor(), fwd, norm, 2.5);
        // The reference backward from the GPU's own choice: with 256 experts in 8 groups the
        // groups' top-2 sums come within f32 rounding of each other (f32 on the GPU, double on
        // the CPU), and a group picked differently changes the gradient's support; the choice
        // is the forward's test (RouterSigmoidForward), this one is the backward's.
        const ops::RouterOut fwd_host{fwd.probs.to(Device::cpu()).to(DType::F32), fwd.topk_idx.to(Device::cpu()),
                                      fwd.topk_weight.to(Device::cpu()).to(DType::F32)};
        Tensor ref = ops::router_sigmoid_backward(dw, extra ? dprobs : Tensor(), fwd_host, norm, 2.5);
        EXPECT_EQ(got.dtype(), DType::BF16);
        expect_backend_close(got, ref, kBf16Tol, name, "dlogits");
      }
    }
  }
}

// ---- permutation ------------------------------------------------------------------------

void check_permutation(const Tensor& ids, int64_t E, const std::string& name) {
  const ops::Permutation ref = ops::permutation_by_expert(ids, E);
  PoisonScope poison;
  Tensor ids_gpu = ids.to(kGpu);
  const ops::Permutation a = ops::permutation_by_expert(ids_gpu, E);
  const ops::Permutation b = ops::permutation_by_expert(ids_gpu, E);
  EXPECT_EQ(a.num_tokens, ref.num_tokens);
  EXPECT_EQ(a.top_k, ref.top_k);
  expect_same_values<int64_t>(a.expert_counts, ref.expert_counts, name + " expert_counts");
  expect_same_values<int32_t>(a.source_token, ref.source_token, name + " source_token");
  expect_same_values<int32_t>(a.slot_row, ref.slot_row, name + " slot_row");
  EXPECT_TRUE(same_bits(a.expert_counts, b.expert_counts)) << name << " expert_counts: two runs differ";
  EXPECT_TRUE(same_bits(a.source_token, b.source_token)) << name << " source_token: two runs differ";
  EXPECT_TRUE(same_bits(a.slot_row, b.slot_row)) << name << " slot_row: two runs differ";
}

TEST(BackendMoe, PermutationMatchesCpuAndIsDeterministic) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, K, E, hot;
  };
  // 4096 tokens x 8 = 32768 pairs span several scan chunks; E = 3 with one hot expert;
  // one token; 1000 experts (near the CUDA limit).
  for (Case c : {Case{4096, 8, 128, 4}, Case{3, 2, 4, 1}, Case{1, 1, 1, 1}, Case{777, 6, 60, 60},
                 Case{2500, 4, 1000, 10}, Case{20000, 8, 3, 1}}) {
    Tensor ids = skewed_ids(c.T, c.K, c.E, c.hot, c.T * c.K + c.E);
    check_permutation(ids, c.E, tag("permutation_by_expert", {{"T", c.T}, {"K", c.K}, {"E", c.E}}));
  }
  // From the router: distinct experts per token.
  Tensor logits = gapped_logits(3000, 128, 5);
  const ops::RouterOut r = ops::router_forward(logits, 8, true);
  check_permutation(r.topk_idx, 128, "permutation_by_expert[router,T=3000,K=8,E=128]");
}

// take_rows: exact row copies of any dtype by an index with entries outside the rows
// (zero rows), against the CPU's and against the definition.
TEST(BackendMoe, TakeRows) {
  Tensor x = random_bf16_values({37, 24}, 5);
  std::vector<int32_t> idx;
  for (int i = 0; i < 50; ++i) idx.push_back(i % 7 == 3 ? 37 + i : (i * 11) % 37);  // some past the rows
  idx.push_back(-1);
  const Tensor index = Tensor::from_vector(idx, {static_cast<int64_t>(idx.size())});
  const Tensor y = ops::take_rows(x, index);
  for (size_t i = 0; i < idx.size(); ++i) {
    for (int64_t c = 0; c < 24; ++c) {
      const bool in = idx[i] >= 0 && idx[i] < 37;
      ASSERT_EQ(y.item(static_cast<int64_t>(i) * 24 + c), in ? x.item(idx[i] * 24 + c) : 0.0) << i;
    }
  }
  const Tensor ints = testing::random_ints({37}, 0, 1000, 6);
  const Tensor yi = ops::take_rows(ints, index);
  EXPECT_EQ(yi.item(0), ints.item(idx[0]));
  MT_REQUIRE_GPU();
  PoisonScope poison;
  for (DType dt : {DType::BF16, DType::F32}) {
    expect_backend_close(ops::take_rows(on_gpu(x, dt), index.to(kGpu)), y, 1e-30, "take_rows", "y");
  }
  EXPECT_TRUE(testing::bytes_equal(ops::take_rows(ints.to(kGpu), index.to(kGpu)).to(Device::cpu()), yi));
}

TEST(BackendMoe, PermuteAndUnpermute) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, K, E, H;
  };
  // H = 2048: 16-byte row copies; H = 20: 8-byte copies and the scalar backward sum; H = 13
  // (f32 only below): odd rows.
  for (Case c : {Case{512, 8, 64, 2048}, Case{61, 3, 5, 20}}) {
    const std::string name = tag("permute", {{"T", c.T}, {"K", c.K}, {"E", c.E}, {"H", c.H}});
    Tensor ids = skewed_ids(c.T, c.K, c.E, 2, c.T);
    const ops::Permutation pr = ops::permutation_by_expert(ids, c.E);
    Tensor x = random_bf16_values({c.T, c.H}, c.T + 1);
    Tensor dxp = random_bf16_values({c.T * c.K, c.H}, c.T + 2);
    Tensor yp = random_bf16_values({c.T * c.K, c.H}, c.T + 3);
    Tensor dy = random_bf16_values({c.T * c.K, c.H}, c.T + 4);
    Tensor xp_ref = ops::permute_forward(x, pr);
    Tensor dx_ref = ops::permute_backward(dxp, pr);
    Tensor y_ref = ops::unpermute_forward(yp, pr);
    Tensor dyp_ref = ops::unpermute_backward(dy, pr);
    PoisonScope poison;
    const ops::Permutation pg = ops::permutation_by_expert(ids.to(kGpu), c.E);
    // Copies are exact: error 0.
    expect_backend_close(ops::permute_forward(on_gpu(x, DType::BF16), pg), xp_ref, 1e-30, name, "xp");
    expect_backend_close(ops::unpermute_forward(on_gpu(yp, DType::BF16), pg), y_ref, 1e-30, name, "y");
    expect_backend_close(ops::unpermute_backward(on_gpu(dy, DType::BF16), pg), dyp_ref, 1e-30, name, "dyp");
    expect_backend_close(ops::permute_backward(on_gpu(dxp, DType::BF16), pg), dx_ref, kBf16Tol, name, "dx");
    expect_backend_close(ops::permute_backward(on_gpu(dxp, DType::F32), pg), dx_ref, kF32Tol, name + "f32", "dx");
    expect_backend_close(ops::permute_forward(on_gpu(x, DType::F32), pg), xp_ref, 1e-30, name + "f32", "xp");
  }
  {  // f32 rows of 13 elements (52 bytes: 4-byte copies, scalar sums)
    Tensor ids = skewed_ids(40, 2, 6, 2, 9);
    const ops::Permutation pr = ops::permutation_by_expert(ids, 6);
    Tensor x = random_bf16_values({40, 13}, 10), dxp = random_bf16_values({80, 13}, 11);
    PoisonScope poison;
    const ops::Permutation pg = ops::permutation_by_expert(ids.to(kGpu), 6);
    expect_backend_close(ops::permute_forward(on_gpu(x, DType::F32), pg), ops::permute_forward(x, pr), 1e-30,
                         "permute[T=40,K=2,H=13]f32", "xp");
    expect_backend_close(ops::permute_backward(on_gpu(dxp, DType::F32), pg), ops::permute_backward(dxp, pr),
                         kF32Tol, "permute[T=40,K=2,H=13]f32", "dx");
  }
}

// A partial permutation (one range of experts kept, the other pairs absent: expert
// parallelism by all-gather) on both backends: the range's ids, the kept rows' copies and
// sums, zero rows for absent pairs in unpermute, and the combine over the kept rows.
TEST(BackendMoe, PartialPermutation) {
  MT_REQUIRE_GPU();
  const int64_t T = 700, K = 8, E = 64, H = 2048, first = 16, count = 16;
  const std::string name = "partial_permutation[T=700,K=8,E=64,H=2048,experts 16..31]";
  Tensor ids = skewed_ids(T, K, E, 20, 77);
  Tensor local_ref = ops::expert_ids_in_range(ids, first, count);
  ops::Permutation pr = ops::permutation_by_expert(local_ref, count + 1);
  const std::vector<int64_t> counts = pr.expert_counts.to_vector<int64_t>();
  int64_t R = 0;
  for (int64_t e = 0; e < count; ++e) R += counts[e];
  ASSERT_GT(R, 0);
  ASSERT_LT(R, T * K);
  pr.rows = R;
  Tensor x = random_bf16_values({T, H}, 1), dxp = random_bf16_values({R, H}, 2);
  Tensor yp = random_bf16_values({R, H}, 3), dy = random_bf16_values({T * K, H}, 4);
  Tensor w = random_tensor({T, K}, DType::F32, 5), dyt = random_bf16_values({T, H}, 6);
  PoisonScope poison;
  Tensor local = ops::expert_ids_in_range(ids.to(kGpu), first, count);
  expect_same_values<int32_t>(local, local_ref, name + " ids");
  ops::Permutation pg = ops::permutation_by_expert(local, count + 1);
  pg.rows = R;
  expect_backend_close(ops::permute_forward(on_gpu(x, DType::BF16), pg), ops::permute_forward(x, pr), 1e-30, name, "xp");
  expect_backend_close(ops::permute_backward(on_gpu(dxp, DType::BF16), pg), ops::permute_backward(dxp, pr), kBf16Tol,
                       name, "dx");
  expect_backend_close(ops::unpermute_forward(on_gpu(yp, DType::BF16), pg), ops::unpermute_forward(yp, pr), 1e-30, name,
                       "y (absent pairs zero)");
  expect_backend_close(ops::unpermute_backward(on_gpu(dy, DType::BF16), pg), ops::unpermute_backward(dy, pr), 1e-30,
                       name, "dyp");
  Tensor yg = on_gpu(yp, DType::BF16), wg = w.to(kGpu);
  expect_backend_close(ops::combine_forward(yg, wg, Tensor(), pg.slot_row), ops::combine_forward(yp, w, Tensor(), pr.slot_row),
                       kBf16Tol, name, "combine y");
  const ops::CombineGrads g = ops::combine_backward(on_gpu(dyt, DType::BF16), yg, wg, pg.slot_row);
  const ops::CombineGrads g_ref = ops::combine_backward(dyt, yp, w, pr.slot_row);
  expect_backend_close(g.dexpert_out, g_ref.dexpert_out, kBf16Tol, name, "combine dexpert_out");
  expect_backend_close(g.dweight, g_ref.dweight, kF32Tol, name, "combine dweight (absent slots zero)");
}

// ---- combine ----------------------------------------------------------------------------

TEST(BackendMoe, Combine) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t T, K, H;
  };
  // H = 20: the scalar path.
  for (Case c : {Case{512, 8, 2048}, Case{37, 3, 20}, Case{64, 1, 4096}}) {
    for (bool with_residual : {true, false}) {
      const std::string name = tag("combine", {{"T", c.T}, {"K", c.K}, {"H", c.H}, {"residual", with_residual}});
      Tensor eo = random_bf16_values({c.T * c.K, c.H}, c.T + c.H);
      Tensor w = random_tensor({c.T, c.K}, DType::F32, c.T + 1);
      Tensor res = with_residual ? random_bf16_values({c.T, c.H}, c.T + 2) : Tensor();
      Tensor dy = random_bf16_values({c.T, c.H}, c.T + 3);
      Tensor y_ref = ops::combine_forward(eo, w, res);
      const ops::CombineGrads g_ref = ops::combine_backward(dy, eo, w);
      PoisonScope poison;
      Tensor eog = on_gpu(eo, DType::BF16), wg = w.to(kGpu);
      Tensor y = ops::combine_forward(eog, wg, with_residual ? on_gpu(res, DType::BF16) : Tensor());
      EXPECT_EQ(y.dtype(), DType::BF16);
      expect_backend_close(y, y_ref, kBf16Tol, name, "y");
      const ops::CombineGrads g = ops::combine_backward(on_gpu(dy, DType::BF16), eog, wg);
      EXPECT_EQ(g.dweight.dtype(), DType::F32);
      expect_backend_close(g.dexpert_out, g_ref.dexpert_out, kBf16Tol, name, "dexpert_out");
      expect_backend_close(g.dweight, g_ref.dweight, kF32Tol, name, "dweight");
      // the rows in another order, read through an order (a fresh random permutation)
      std::vector<int32_t> order(static_cast<size_t>(c.T * c.K));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
      moetrain::Rng rng(c.T * 31 + c.H);
      for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
      Tensor ord = Tensor::from_vector(order, {c.T * c.K});
      Tensor yo_ref = ops::combine_forward(eo, w, res, ord);
      const ops::CombineGrads go_ref = ops::combine_backward(dy, eo, w, ord);
      Tensor yo = ops::combine_forward(eog, wg, with_residual ? on_gpu(res, DType::BF16) : Tensor(), ord.to(kGpu));
      expect_backend_close(yo, yo_ref, kBf16Tol, name + " order", "y");
      const ops::CombineGrads go = ops::combine_backward(on_gpu(dy, DType::BF16), eog, wg, ord.to(kGpu));
      expect_backend_close(go.dexpert_out, go_ref.dexpert_out, kBf16Tol, name + " order", "dexpert_out");
      expect_backend_close(go.dweight, go_ref.dweight, kF32Tol, name + " order", "dweight");
    }
  }
}

// ---- grouped SwiGLU ----------------------------------------------------------------------

struct SwigluCase {
  int64_t H, I;
  std::vector<int64_t> counts;
};

int64_t total_rows(const std::vector<int64_t>& c) {
  int64_t n = 0;
  for (int64_t v : c) n += v;
  return n;
}

// Runs forward, backward_input and backward_weight on both backends and compares every
// output. The backward inputs (dy, gate, up, dgate, dup) are fresh random values, so each
// op is checked on its own.
void check_swiglu(const SwigluCase& c, uint64_t seed) {
  const int64_t E = static_cast<int64_t>(c.counts.size()), N = total_rows(c.counts), H = c.H, I = c.I;
  const std::string name = tag("grouped_swiglu", {{"E", E}, {"N", N}, {"H", H}, {"I", I}});
  Tensor counts = Tensor::from_vector(c.counts, {E});
  Tensor x = random_bf16_values({N, H}, seed);
  Tensor wg = big_random({E, I, H}, seed + 1, 1.0 / std::sqrt(static_cast<double>(H)), true);
  Tensor wu = big_random({E, I, H}, seed + 2, 1.0 / std::sqrt(static_cast<double>(H)), true);
  Tensor wd = big_random({E, H, I}, seed + 3, 1.0 / std::sqrt(static_cast<double>(I)), true);
  Tensor dy = random_bf16_values({N, H}, seed + 4);
  Tensor gate = random_bf16_values({N, I}, seed + 5, 2.0);
  Tensor up = random_bf16_values({N, I}, seed + 6);
  Tensor dgate = random_bf16_values({N, I}, seed + 7);
  Tensor dup = random_bf16_values({N, I}, seed + 8);
  Tensor dwg0 = big_random({E, I, H}, seed + 9, 1.0, false);
  Tensor dwu0 = big_random({E, I, H}, seed + 10, 1.0, false);
  Tensor dwd0 = big_random({E, H, I}, seed + 11, 1.0, false);

  const ops::SwigluOut f_ref = ops::grouped_swiglu_forward(x, counts, wg, wu, wd);
  const ops::SwigluInputGrads b_ref = ops::grouped_swiglu_backward_input(dy, counts, gate, up, wg, wu, wd);
  Tensor dwg_ref = dwg0.clone(), dwu_ref = dwu0.clone(), dwd_ref = dwd0.clone();
  ops::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dgate, dup, dwg_ref, dwu_ref, dwd_ref);

  PoisonScope poison;
  auto bf = [](const Tensor& t) { return on_gpu(t, DType::BF16); };
  Tensor cg = counts.to(kGpu), xg = bf(x), wgg = bf(wg), wug = bf(wu), wdg = bf(wd);
  const ops::SwigluOut f = ops::grouped_swiglu_forward(xg, cg, wgg, wug, wdg);
  expect_backend_close(f.gate, f_ref.gate, kBf16Tol, name, "gate");
  expect_backend_close(f.up, f_ref.up, kBf16Tol, name, "up");
  expect_backend_close(f.y, f_ref.y, kBf16Tol, name, "y");

  Tensor dyg = bf(dy), gateg = bf(gate), upg = bf(up);
  const ops::SwigluInputGrads b = ops::grouped_swiglu_backward_input(dyg, cg, gateg, upg, wgg, wug, wdg);
  expect_backend_close(b.dgate, b_ref.dgate, kBf16Tol, name, "dgate");
  expect_backend_close(b.dup, b_ref.dup, kBf16Tol, name, "dup");
  expect_backend_close(b.dx, b_ref.dx, kBf16Tol, name, "dx");

  Tensor dgateg = bf(dgate), dupg = bf(dup);
  Tensor dwg = dwg0.to(kGpu), dwu = dwu0.to(kGpu), dwd = dwd0.to(kGpu);
  ops::grouped_swiglu_backward_weight(dyg, xg, cg, gateg, upg, dgateg, dupg, dwg, dwu, dwd);
  // With many experts, the weight gradients are compared on three blocks of experts
  // (the first, middle and last eight: the largest, mid-sized and 0-row experts of the
  // skewed counts): hundreds of millions of elements are slow to compare on the host.
  std::vector<std::pair<int64_t, int64_t>> blocks = {{0, E}};
  if (E > 32) blocks = {{0, 8}, {E / 2, E / 2 + 8}, {E - 8, E}};
  for (auto [e0, e1] : blocks) {
    const std::string part = E > 32 ? fmt::format("[experts {}..{})", e0, e1) : "";
    // dW_gate and dW_up multiply exact bf16 inputs and sum in f32 on both sides.
    expect_backend_close(dwg.slice(e0, e1), dwg_ref.slice(e0, e1), kF32Tol, name, "dw_gate" + part);
    expect_backend_close(dwu.slice(e0, e1), dwu_ref.slice(e0, e1), kF32Tol, name, "dw_up" + part);
    // dW_down's operand act = silu(gate) * up is computed in f32 on the CPU but is a bf16
    // GEMM operand on the GPU (rounded, relative error ~1e-3): the bf16 tolerance.
    expect_backend_close(dwd.slice(e0, e1), dwd_ref.slice(e0, e1), kBf16Tol, name, "dw_down" + part);
  }
  // Overwrite mode (a step's first micro-batch): the starting dW is NaN everywhere, so an
  // element the kernels skip (a 0-row expert's included) fails the comparison.
  Tensor ow_ref[3] = {Tensor::full(dwg0.shape(), NAN, DType::F32), Tensor::full(dwu0.shape(), NAN, DType::F32),
                      Tensor::full(dwd0.shape(), NAN, DType::F32)};
  Tensor ow[3] = {ow_ref[0].to(kGpu), ow_ref[1].to(kGpu), ow_ref[2].to(kGpu)};
  for (const Tensor& t : ow) ASSERT_FALSE(ops::all_finite(t));
  // With the activations given (the forward's SwigluOut::act), dW_down uses them as they
  // are: fresh random ones here, exact bf16 on both sides.
  {
    Tensor act = random_bf16_values({N, I}, seed + 12);
    Tensor a_ref[3] = {dwg0.clone(), dwu0.clone(), dwd0.clone()};
    Tensor a[3] = {dwg0.to(kGpu), dwu0.to(kGpu), dwd0.to(kGpu)};
    ops::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dgate, dup, a_ref[0], a_ref[1], a_ref[2], true, {},
                                        act);
    ops::grouped_swiglu_backward_weight(dyg, xg, cg, gateg, upg, dgateg, dupg, a[0], a[1], a[2], true, {}, bf(act));
    for (auto [e0, e1] : blocks) {
      expect_backend_close(a[2].slice(e0, e1), a_ref[2].slice(e0, e1), kF32Tol, name, "dw_down (act given)");
    }
  }
  // ... and the sum of the squares of what it wrote, asked for at element 1 (NaN before).
  Tensor sq_ref = Tensor::full({2}, NAN, DType::F64), sq = sq_ref.to(kGpu);
  ops::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dgate, dup, ow_ref[0], ow_ref[1], ow_ref[2], false,
                                      {&sq_ref, 1});
  ops::grouped_swiglu_backward_weight(dyg, xg, cg, gateg, upg, dgateg, dupg, ow[0], ow[1], ow[2], false, {&sq, 1});
  {
    const double fused = sq.to_double_vector()[1];
    const double pass = ops::sum_squares_all({ow[0], ow[1], ow[2]});  // the same values, another order
    EXPECT_NEAR(fused, pass, 1e-12 * pass) << name << ": the weight-gradient op's sum of squares";
    const double ref = sq_ref.to_double_vector()[1];
    EXPECT_NEAR(fused, ref, kBf16Tol * ref) << name << ": sum of squares against the CPU";
  }
  const char* names[3] = {"dw_gate=", "dw_up=", "dw_down="};
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(ops::all_finite(ow[i])) << name << " " << names[i] << ": an element was not written";
    for (auto [e0, e1] : blocks) {
      expect_backend_close(ow[i].slice(e0, e1), ow_ref[i].slice(e0, e1), i == 2 ? kBf16Tol : kF32Tol, name,
                           names[i]);
    }
  }
}

// Skewed counts summing to N over E experts: weights 1 / (e + 1)^1.2, every 9th expert
// (and the last) left with 0 rows, the rounding remainder to expert 0.
std::vector<int64_t> skewed_counts(int64_t E, int64_t N) {
  std::vector<double> w(static_cast<size_t>(E));
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    w[e] = (e % 9 == 4 || e == E - 1) ? 0.0 : 1.0 / std::pow(static_cast<double>(e + 1), 1.2);
    sum += w[e];
  }
  std::vector<int64_t> c(static_cast<size_t>(E));
  int64_t used = 0;
  for (int64_t e = 0; e < E; ++e) {
    c[e] = static_cast<int64_t>(std::floor(w[e] / sum * static_cast<double>(N)));
    used += c[e];
  }
  c[0] += N - used;
  return c;
}

TEST(BackendMoe, GroupedSwigluUnevenCounts) {
  MT_REQUIRE_GPU();
  // H = 136, I = 72: partial 128-wide column tiles and 64-deep k tiles; the dx GEMM
  // switches from (dgate, Wg) to (dup, Wu) in the middle of a k tile. Counts with a 0-row
  // expert, a 1-row expert and experts spanning several 128-row tiles.
  check_swiglu({136, 72, {37, 0, 130, 1, 300}}, 1000);
  check_swiglu({64, 16, {0, 5, 0}}, 1100);  // mostly empty experts
  check_swiglu({256, 512, {300}}, 1200);    // E = 1: a dense MLP
}

TEST(BackendMoe, GroupedSwigluRealistic) {
  MT_REQUIRE_GPU();
  // Qwen3-30B-A3B expert shapes: E = 128, H = 2048, I = 768, N = 8192 rows, skewed.
  check_swiglu({2048, 768, skewed_counts(128, 8192)}, 2000);
}

TEST(BackendMoe, GroupedSwigluWeightGradIsDeterministic) {
  MT_REQUIRE_GPU();
  const int64_t E = 16, H = 512, I = 256;
  const std::vector<int64_t> c = skewed_counts(E, 3000);
  const int64_t N = total_rows(c);
  Tensor counts = Tensor::from_vector(c, {E}).to(kGpu);
  auto bf = [](const Shape& s, uint64_t seed) { return on_gpu(random_bf16_values(s, seed), DType::BF16); };
  Tensor dy = bf({N, H}, 1), x = bf({N, H}, 2), gate = bf({N, I}, 3), up = bf({N, I}, 4);
  Tensor dg = bf({N, I}, 5), du = bf({N, I}, 6);
  Tensor dwg0 = random_tensor({E, I, H}, DType::F32, 7), dwu0 = random_tensor({E, I, H}, DType::F32, 8);
  Tensor dwd0 = random_tensor({E, H, I}, DType::F32, 9);
  Tensor a[3] = {dwg0.to(kGpu), dwu0.to(kGpu), dwd0.to(kGpu)};
  Tensor b[3] = {dwg0.to(kGpu), dwu0.to(kGpu), dwd0.to(kGpu)};
  ops::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dg, du, a[0], a[1], a[2]);
  ops::grouped_swiglu_backward_weight(dy, x, counts, gate, up, dg, du, b[0], b[1], b[2]);
  const char* names[3] = {"dw_gate", "dw_up", "dw_down"};
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(a[i], b[i])) << names[i] << ": two runs differ";
  // Experts with no rows keep their starting gradient bit for bit.
  Tensor start = dwd0.select(c.size() - 1), got = a[2].to(Device::cpu()).select(c.size() - 1);
  ASSERT_EQ(c.back(), 0);
  EXPECT_EQ(std::memcmp(start.raw(), got.raw(), start.nbytes()), 0) << "dw_down of a 0-row expert changed";
}

// Several micro-batches' weight gradients in one pass (gradient accumulation): against the
// CPU making them in turn, in overwrite mode from NaN (every element written) and adding to
// a random start. The micro-batches have different row counts per expert, zero rows in some
// or all of them, and partial k tiles in each.
void check_swiglu_group(int64_t H, int64_t I, const std::vector<std::vector<int64_t>>& counts, uint64_t seed) {
  const int64_t E = static_cast<int64_t>(counts[0].size());
  std::vector<ops::SwigluWgradRows> cpu, gpu;
  int64_t rows_all = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const int64_t N = total_rows(counts[k]);
    rows_all += N;
    const uint64_t s = seed + 10 * k;
    ops::SwigluWgradRows r;
    r.counts = Tensor::from_vector(counts[k], {E});
    r.dy = random_bf16_values({N, H}, s);
    r.x = random_bf16_values({N, H}, s + 1);
    r.gate = random_bf16_values({N, I}, s + 2, 2.0);
    r.up = random_bf16_values({N, I}, s + 3);
    r.dgate = random_bf16_values({N, I}, s + 4);
    r.dup = random_bf16_values({N, I}, s + 5);
    r.act = random_bf16_values({N, I}, s + 6);
    if (k % 2 == 1) r.gate = r.up = Tensor();  // act given: gate and up are not needed
    auto bf = [](const Tensor& t) { return t.defined() ? on_gpu(t, DType::BF16) : Tensor(); };
    gpu.push_back({bf(r.dy), bf(r.x), r.counts.to(kGpu), bf(r.gate), bf(r.up), bf(r.dgate), bf(r.dup), bf(r.act)});
    cpu.push_back(std::move(r));
  }
  const std::string name = tag("grouped_swiglu_group", {{"E", E},
                                                         {"micro_batches", static_cast<int64_t>(counts.size())},
                                                         {"N", rows_all},
                                                         {"H", H},
                                                         {"I", I}});
  const char* names[3] = {"dw_gate", "dw_up", "dw_down"};
  for (bool accumulate : {false, true}) {
    Tensor ref[3] = {big_random({E, I, H}, seed + 1000, 1.0, false), big_random({E, I, H}, seed + 1001, 1.0, false),
                     big_random({E, H, I}, seed + 1002, 1.0, false)};
    if (!accumulate) {
      for (Tensor& t : ref) t.fill_(NAN);
    }
    Tensor got[3] = {ref[0].to(kGpu), ref[1].to(kGpu), ref[2].to(kGpu)};
    // Overwriting, the sum of the squares of what was written too, asked for at element 1.
    Tensor sq_ref = Tensor::full({2}, NAN, DType::F64), sq = sq_ref.to(kGpu);
    ops::grouped_swiglu_backward_weight_group(cpu, ref[0], ref[1], ref[2], accumulate,
                                              accumulate ? ops::SumSquaresInto{} : ops::SumSquaresInto{&sq_ref, 1});
    ops::grouped_swiglu_backward_weight_group(gpu, got[0], got[1], got[2], accumulate,
                                              accumulate ? ops::SumSquaresInto{} : ops::SumSquaresInto{&sq, 1});
    if (!accumulate) {
      const double fused = sq.to_double_vector()[1];
      const double pass = ops::sum_squares_all({got[0], got[1], got[2]});
      EXPECT_NEAR(fused, pass, 1e-12 * pass) << name << ": the group's sum of squares";
      const double ref_sq = sq_ref.to_double_vector()[1];
      EXPECT_NEAR(fused, ref_sq, 1e-5 * ref_sq) << name << ": the group's sum of squares against the CPU";
    }
    for (int i = 0; i < 3; ++i) {
      const std::string what = std::string(names[i]) + (accumulate ? "+=" : "=");
      EXPECT_TRUE(ops::all_finite(got[i])) << name << " " << what << ": an element was not written";
      expect_backend_close(got[i], ref[i], kF32Tol, name, what);
    }
  }
}

TEST(BackendMoe, GroupedSwigluWeightGradOfSeveralMicroBatches) {
  MT_REQUIRE_GPU();
  // Expert 1 has rows only in the second micro-batch, expert 3 in none, expert 4 only in the
  // first; counts that end mid k-tile.
  check_swiglu_group(136, 72, {{37, 0, 130, 0, 65, 1}, {20, 70, 3, 0, 0, 129}}, 3000);
  check_swiglu_group(136, 72, {{37, 0, 130, 0, 65, 1}, {0, 0, 0, 0, 0, 0}, {5, 64, 0, 0, 1, 2}}, 3100);
  // The first micro-batch without rows (the overwrite falls to the second); only one with
  // rows (the one-micro-batch op).
  check_swiglu_group(136, 72, {{0, 0, 0, 0, 0, 0}, {20, 70, 3, 0, 0, 129}, {1, 0, 0, 0, 64, 2}}, 3150);
  check_swiglu_group(136, 72, {{0, 0, 0, 0, 0, 0}, {20, 70, 3, 0, 0, 129}}, 3160);
  // More micro-batches than one pass takes (8): two passes, the second adding; one of them
  // without rows.
  std::vector<std::vector<int64_t>> ten;
  for (int k = 0; k < 10; ++k) ten.push_back({k * 7 % 50, 3 + k, 0, 64, 129 - k});
  ten[4] = {0, 0, 0, 0, 0};
  check_swiglu_group(64, 32, ten, 3200);
  check_swiglu_group(2048, 768, {skewed_counts(128, 8192), skewed_counts(128, 6000)}, 3300);
}

TEST(BackendMoe, GroupedSwigluErrorsNameTheTensor) {
  MT_REQUIRE_GPU();
  Tensor counts = Tensor::from_vector(std::vector<int64_t>{4, 4}, {2}).to(kGpu);
  Tensor x = Tensor::zeros({8, 12}, DType::BF16, kGpu);
  Tensor wg = Tensor::zeros({2, 16, 12}, DType::BF16, kGpu), wd = Tensor::zeros({2, 12, 16}, DType::BF16, kGpu);
  expect_error([&] { ops::grouped_swiglu_forward(x, counts, wg, wg, wd); }, {"multiples of 8"});
  Tensor x16 = Tensor::zeros({8, 16}, DType::BF16, kGpu);
  Tensor wg16 = Tensor::zeros({2, 16, 16}, DType::BF16, kGpu);
  expect_error([&] { ops::grouped_swiglu_forward(x16, counts.to(Device::cpu()), wg16, wg16, wg16); },
               {"counts", "CPU"});
  expect_error([&] { ops::grouped_swiglu_forward(x16, counts, wg16, wg16, wg16.to(DType::F32)); }, {"w_down"});
}

}  // namespace
}  // namespace moetrain
