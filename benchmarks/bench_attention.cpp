// Fused causal GQA attention (src/ops/cuda/attention.cu) at the bench model's shape:
// batch 2, seq 4096, 32 query heads, 4 kv heads, head_dim 128; and DeepSeek-V3's MLA heads
// (BM_AttentionMla*: query/key heads of 192, value heads of 128, as many kv heads as query
// heads), with the same heads at 128 / 128 beside them.
//
// FLOP convention (as FlashAttention reports): forward = 2 * B * Hq * S^2 * (D + Dv) / 2
// (QK^T over D and PV over Dv, causal halves the square; 4 * B * Hq * S^2 * D / 2 when Dv =
// D); backward = 2.5x that (five S x S products instead of two). Work the kernels repeat
// (the dQ pass recomputes QK^T and dO V^T) is not counted. Floor at the bench shape (forward
// 275 GFLOP, backward 687): H100 dense bf16 peak 989 TFLOP/s -> forward 0.28 ms, backward
// 0.69 ms; at B=2, S=4096, H=16, 192 / 128 (forward 172 GFLOP, backward 429): 0.17 ms and
// 0.43 ms. MOETRAIN_ATTENTION_MMA_SYNC=1 times the portable mma.sync kernels instead of the
// Hopper ones (which take D = Dv = 128 and MLA's 192 / 128).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cuda_runtime.h"
#include "gpu_timing.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

// Uniform values in [-1, 1) from a fixed LCG, as a bf16 tensor on the GPU.
Tensor random_gpu(const Shape& shape, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& e : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    e = static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
  return Tensor::from_vector(v, shape).to(DType::BF16).to(Device::cuda(0));
}

struct AttnBench {
  ops::AttentionShape a;
  Tensor q, k, v, dout;
  // v_head_dim 0: head_dim.
  AttnBench(const benchmark::State& state, int64_t v_head_dim) {
    a.batch = state.range(0);
    a.seq = state.range(1);
    a.q_heads = state.range(2);
    a.kv_heads = state.range(3);
    a.head_dim = state.range(4);
    a.v_head_dim = v_head_dim;
    a.scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
    const int64_t T = a.batch * a.seq;
    q = random_gpu({T, a.q_heads * a.head_dim}, 1);
    k = random_gpu({T, a.kv_heads * a.head_dim}, 2);
    v = random_gpu({T, a.kv_heads * a.value_dim()}, 3);
    dout = random_gpu({T, a.q_heads * a.value_dim()}, 4);
  }
  double fwd_flops() const {
    return 2.0 * a.batch * a.q_heads * static_cast<double>(a.seq) * a.seq * (a.head_dim + a.value_dim()) / 2;
  }
};

template <typename F>
void time_loop(benchmark::State& state, double flops, F&& body) {
  set_rate(state, "TFLOP/s", flops, time_iterations(state, body));
}

void forward_case(benchmark::State& state, int64_t v_head_dim) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  AttnBench b(state, v_head_dim);
  time_loop(state, b.fwd_flops(), [&] { ops::AttentionOut o = ops::attention_forward(b.q, b.k, b.v, Tensor(), b.a); });
}

void backward_case(benchmark::State& state, int64_t v_head_dim, bool one_pass) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  AttnBench b(state, v_head_dim);
  const ops::AttentionOut fwd = ops::attention_forward(b.q, b.k, b.v, Tensor(), b.a);
  const bool saved = ops::deterministic();
  ops::set_deterministic(!one_pass);
  time_loop(state, 2.5 * b.fwd_flops(), [&] {
    ops::AttentionGrads g = ops::attention_backward(b.dout, b.q, b.k, b.v, Tensor(), fwd.out, fwd.lse, b.a);
  });
  ops::set_deterministic(saved);
}

void BM_AttentionForward(benchmark::State& state) { forward_case(state, 0); }
void BM_AttentionBackward(benchmark::State& state) { backward_case(state, 0, state.range(5) != 0); }
// Args {batch, seq, q_heads, kv_heads, head_dim, v_head_dim}; deterministic backward (the
// one-pass kernel is Hopper's, D = Dv = 128 only).
void BM_AttentionMlaForward(benchmark::State& state) { forward_case(state, state.range(5)); }
void BM_AttentionMlaBackward(benchmark::State& state) { backward_case(state, state.range(5), false); }

// {batch, seq, q_heads, kv_heads, head_dim}: the bench model, and a short-sequence case;
// backward also {one pass}: 0 deterministic (dK/dV pass + dQ pass), 1 the one-pass kernel.
BENCHMARK(BM_AttentionForward)->Args({2, 4096, 32, 4, 128})->Args({1, 2048, 32, 4, 128})->UseManualTime();
BENCHMARK(BM_AttentionBackward)
    ->Args({2, 4096, 32, 4, 128, 0})
    ->Args({2, 4096, 32, 4, 128, 1})
    ->Args({1, 2048, 32, 4, 128, 0})
    ->Args({1, 2048, 32, 4, 128, 1})
    ->UseManualTime();
// DeepSeek-V3's MLA heads (16 of its 128 heads, as with tensor parallelism over 8 GPUs; and
// all 128 at batch 1), and the same 16 heads at 128 / 128 for comparison (the Hopper
// kernels unless MOETRAIN_ATTENTION_MMA_SYNC=1).
BENCHMARK(BM_AttentionMlaForward)
    ->Args({2, 4096, 16, 16, 192, 128})
    ->Args({1, 4096, 128, 128, 192, 128})
    ->Args({2, 4096, 16, 16, 128, 128})
    ->UseManualTime();
BENCHMARK(BM_AttentionMlaBackward)
    ->Args({2, 4096, 16, 16, 192, 128})
    ->Args({1, 4096, 128, 128, 192, 128})
    ->Args({2, 4096, 16, 16, 128, 128})
    ->UseManualTime();

}  // namespace
}  // namespace moetrain
