// Fused causal GQA attention (src/ops/cuda/attention.cu) at the bench model's shape:
// batch 2, seq 4096, 32 query heads, 4 kv heads, head_dim 128.
//
// FLOP convention (as FlashAttention reports): forward = 4 * B * Hq * S^2 * D / 2 (QK^T and
// PV, causal halves the square); backward = 2.5x that (five S x S x D products instead of
// two). Work the kernels repeat (the dQ pass recomputes QK^T and dO V^T) is not counted.
// Floor at the bench shape (forward 275 GFLOP, backward 687): H100 dense bf16 peak 989
// TFLOP/s -> forward 0.28 ms, backward 0.69 ms. MOETRAIN_ATTENTION_MMA_SYNC=1 times the
// portable mma.sync kernels instead of the Hopper ones.
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
  explicit AttnBench(const benchmark::State& state) {
    a.batch = state.range(0);
    a.seq = state.range(1);
    a.q_heads = state.range(2);
    a.kv_heads = state.range(3);
    a.head_dim = state.range(4);
    a.scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
    const int64_t T = a.batch * a.seq;
    q = random_gpu({T, a.q_heads * a.head_dim}, 1);
    k = random_gpu({T, a.kv_heads * a.head_dim}, 2);
    v = random_gpu({T, a.kv_heads * a.head_dim}, 3);
    dout = random_gpu({T, a.q_heads * a.head_dim}, 4);
  }
  double fwd_flops() const {
    return 4.0 * a.batch * a.q_heads * static_cast<double>(a.seq) * a.seq * a.head_dim / 2;
  }
};

template <typename F>
void time_loop(benchmark::State& state, double flops, F&& body) {
  set_rate(state, "TFLOP/s", flops, time_iterations(state, body));
}

void BM_AttentionForward(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  AttnBench b(state);
  time_loop(state, b.fwd_flops(), [&] { ops::AttentionOut o = ops::attention_forward(b.q, b.k, b.v, Tensor(), b.a); });
}

void BM_AttentionBackward(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  AttnBench b(state);
  const ops::AttentionOut fwd = ops::attention_forward(b.q, b.k, b.v, Tensor(), b.a);
  const bool saved = ops::deterministic();
  ops::set_deterministic(state.range(5) == 0);
  time_loop(state, 2.5 * b.fwd_flops(), [&] {
    ops::AttentionGrads g = ops::attention_backward(b.dout, b.q, b.k, b.v, Tensor(), fwd.out, fwd.lse, b.a);
  });
  ops::set_deterministic(saved);
}

// {batch, seq, q_heads, kv_heads, head_dim}: the bench model, and a short-sequence case;
// backward also {one pass}: 0 deterministic (dK/dV pass + dQ pass), 1 the one-pass kernel.
BENCHMARK(BM_AttentionForward)->Args({2, 4096, 32, 4, 128})->Args({1, 2048, 32, 4, 128})->UseManualTime();
BENCHMARK(BM_AttentionBackward)
    ->Args({2, 4096, 32, 4, 128, 0})
    ->Args({2, 4096, 32, 4, 128, 1})
    ->Args({1, 2048, 32, 4, 128, 0})
    ->Args({1, 2048, 32, 4, 128, 1})
    ->UseManualTime();

}  // namespace
}  // namespace moetrain
